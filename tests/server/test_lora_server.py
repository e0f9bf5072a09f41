"""LoRA adapters through a real server: ``/v1/models`` lists them, ``model: NAME`` picks
one, a concurrent mix of adapters (more than ``max_loras``) matches transformers + peft
(torch and turbo), and adapters load and unload while streams run (``openai`` and
``httpx`` clients)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from llmctl.engine.detokenizer import IncrementalDetokenizer
from llmctl.engine.sampling_params import SamplingParams
from llmctl.model.tokenizer import Tokenizer
from tests.helpers.lora_adapters import ATTENTION, MLP, free_greedy, make_adapter
from tests.helpers.server_process import running_server
from tests.helpers.tiny_models import load_hf_model

KEY = "lora-test-key"
# Long enough that the streams still run while adapters load and unload: 120 tokens
# took 0.17 s on a quiet day, less than the test's first wait.
TOKENS = 400
PROMPTS = [[5, 77, 301, 42, 9, 250, 13, 404, 88, 61, 7, 199, 23, 310, 64, 3, 120, 11], [30, 31]]
ADAPTERS = {"attn8": (8, ATTENTION), "mlp4": (4, MLP), "all16": (16, ATTENTION + MLP)}


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    """The tiny model, its adapters, and the expected text of every (adapter, prompt)."""
    model_dir = tiny_model_dir("qwen2")
    root = tmp_path_factory.mktemp("served-adapters")
    tokenizer = Tokenizer.from_dir(model_dir)
    references = {None: load_hf_model(model_dir)}
    paths = {}
    for seed, (name, (rank, modules)) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        references[name] = make_adapter(
            root / name, model_dir, rank=rank, target_modules=modules, seed=seed
        )
    want = {
        (name, index): text_of(tokenizer, prompt, free_greedy(reference, prompt, TOKENS))
        for name, reference in references.items()
        for index, prompt in enumerate(PROMPTS)
    }
    return model_dir, paths, want


def text_of(tokenizer: Tokenizer, prompt: list[int], tokens: list[int]) -> str:
    """The text a server streams for ``tokens``: random tiny models emit byte tokens that
    make no whole character, which a one-shot decode renders differently."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(ignore_eos=True))
    for token in tokens:
        detokenizer.add_token(token)
    return detokenizer.take_new_text(final=True)


def serve_args(model_dir, loras: dict[str, str], *extra: str, backend: str = "torch") -> list[str]:
    args = [str(model_dir), "--backend", backend, "--api-key", KEY, "--cache-block-seq-len", "16"]
    for name, path in loras.items():
        args += ["--lora", f"{name}={path}"]
    return [*args, *extra]


async def complete(client: openai.AsyncOpenAI, model: str, index: int, stream: bool) -> str:
    params = dict(
        model=model,
        prompt=PROMPTS[index],
        max_tokens=TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    if not stream:
        return (await client.completions.create(**params)).choices[0].text
    text = ""
    async for chunk in await client.completions.create(stream=True, **params):
        text += chunk.choices[0].text
    return text


@pytest.mark.parametrize("backend", ["torch", "turbo"])
def test_a_concurrent_mix_of_adapters_matches_peft(model, backend):
    model_dir, paths, want = model
    base = str(model_dir)
    with running_server(serve_args(model_dir, paths, "--max-loras", "2", backend=backend)) as url:
        listed = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
        cards = {card["id"]: card for card in listed["data"]}
        assert set(cards) == {base, *ADAPTERS}
        assert cards[base]["parent"] is None
        assert all(cards[name]["parent"] == base for name in ADAPTERS)

        async def run() -> None:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            jobs = [(name, i) for name in [None, *ADAPTERS, None] for i in range(len(PROMPTS))]
            texts = await asyncio.gather(
                *(complete(client, name or base, i, stream=i == 0) for name, i in jobs)
            )
            for (name, i), text in zip(jobs, texts):
                assert text == want[(name, i)], (name, i)
            with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
                await complete(client, "nope", 0, stream=False)
            await client.close()

        asyncio.run(run())
        unauthorized = httpx.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": paths["mlp4"]}
        )
        assert unauthorized.status_code == 401


def test_adapters_load_and_unload_while_streams_run(model):
    """torch only: its streams of TOKENS tokens still run when the calls below are made;
    turbo finishes them before the unload can be seen waiting (the mechanism is the
    shared engine's, and turbo's run-time loading is in test_lora.py)."""
    model_dir, paths, want = model
    headers = {"Authorization": f"Bearer {KEY}"}
    with running_server(serve_args(model_dir, {"attn8": paths["attn8"]})) as url:

        async def run() -> None:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            http = httpx.AsyncClient(base_url=url, headers=headers, timeout=60)
            jobs = [(name, i) for name in [None, "attn8", "attn8"] for i in range(len(PROMPTS))]
            streams = [
                asyncio.create_task(complete(client, name or str(model_dir), i, stream=True))
                for name, i in jobs
            ]
            await asyncio.sleep(0.05)  # the streams are under way
            loaded = await http.post(
                "/v1/load_lora_adapter", json={"lora_name": "mlp4", "lora_path": paths["mlp4"]}
            )
            assert loaded.status_code == 200, loaded.text
            assert not all(task.done() for task in streams)  # loaded under traffic
            unload = asyncio.create_task(
                http.post("/v1/unload_lora_adapter", json={"lora_name": "attn8"})
            )
            await asyncio.sleep(0.05)
            # Retired at once: a new request for it is an unknown model.
            with pytest.raises(openai.NotFoundError):
                await complete(client, "attn8", 0, stream=False)
            assert not unload.done()  # it waits for the streams using attn8
            texts = await asyncio.gather(*streams)
            for (name, i), text in zip(jobs, texts):
                assert text == want[(name, i)], (name, i)  # the streams went on unchanged
            assert (await unload).status_code == 200
            assert await complete(client, "mlp4", 1, stream=False) == want[("mlp4", 1)]
            gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "attn8"})
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
            bad = await http.post(
                "/v1/load_lora_adapter",
                json={"lora_name": str(model_dir), "lora_path": paths["all16"]},
            )
            assert bad.status_code == 400 and "base model's name" in bad.json()["error"]["message"]
            too_big = await http.post(
                "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": paths["all16"]}
            )
            assert too_big.status_code == 200  # rank 16 is the default max_lora_rank
            models = (await http.get("/v1/models")).json()["data"]
            assert {card["id"] for card in models} == {str(model_dir), "mlp4", "x"}
            await http.aclose()
            await client.close()

        asyncio.run(run())
