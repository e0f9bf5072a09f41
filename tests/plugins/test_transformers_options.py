"""The transformers backend as ``--backend auto`` and the option schema meet it: its
registration, the one mapping from llmctl's options to transformers' names, the values it
refuses (each by a rule naming option, value and reason), and the architectures it takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmctl.hardware import Hardware
from llmctl.kv_budget import KVBudget
from llmctl.profiles import resolve
from tests.conftest import STORIES
from tests.helpers.cli import run_llmctl
from tests.plugins.conftest import TRANSFORMERS_DISTRIBUTION, require_transformers_plugin

CPU = Hardware(cpu_count=2, memory_bytes=2**34)


@pytest.fixture(scope="module")
def backend():
    require_transformers_plugin()
    from llmctl_transformers.plugin import TransformersBackend

    return TransformersBackend()


def options(backend, **flags) -> dict:
    """Every option's value for this backend, as resolution gives them (no env, no profile)."""
    settings = resolve(
        flags, backend=backend.name, backend_defaults=backend.option_defaults, env={}
    )
    return {name: setting.value for name, setting in settings.items()}


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_registered_as_a_plugin_below_the_native_backends() -> None:
    require_transformers_plugin()
    listing = run_llmctl("backends", env={"LLMCTL_PLUGINS": "torch,transformers"})
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if "transformers" in line)
    assert TRANSFORMERS_DISTRIBUTION in row and " 5 " in row and "yes" in row


def test_translate_maps_every_unified_option(backend) -> None:
    config = backend.translate(
        options(
            backend,
            cache_block_seq_len=32,
            cache_max_entry_count="300",
            max_prefill_token_num=512,
            max_batch_size=16,
            enable_prefix_caching=False,
            dtype="bfloat16",
            device="cpu",
            seed=7,
            session_len=128,
            model_name="served",
            cuda_graphs=False,
        )
    )
    assert config.page_size == 32
    assert (config.num_blocks, config.max_memory_percent, config.max_cache_bytes) == (
        300,
        None,
        None,
    )
    assert config.max_batch_tokens == 512
    assert config.max_requests_per_batch == 16
    assert config.allow_block_sharing is False
    assert (config.dtype, config.device, config.seed) == ("bfloat16", "cpu", 7)
    assert config.max_model_len == 128 and config.served_model_name == "served"
    assert config.use_cuda_graph is False  # on: None, transformers decides
    assert backend.translate(options(backend)).use_cuda_graph is None


@pytest.mark.parametrize(
    "budget, fields, kv_budget",
    [
        ("0.5", (None, 0.5, None), KVBudget("fraction", 0.5)),
        ("80%", (None, 0.8, None), KVBudget("fraction", 0.8)),
        ("2GiB", (None, None, 2**31), KVBudget("bytes", 2**31)),
        ("300", (300, None, None), KVBudget("blocks", 300)),
    ],
)
def test_all_three_forms_of_the_kv_budget(backend, budget, fields, kv_budget) -> None:
    config = backend.translate(options(backend, cache_max_entry_count=budget))
    assert (config.num_blocks, config.max_memory_percent, config.max_cache_bytes) == fields
    assert config.kv_budget == kv_budget


def test_defaults_are_transformers_own(backend) -> None:
    import transformers
    from llmctl_transformers.config import DEFAULT_PAGE_SIZE, MIN_PAGE_SIZE
    from transformers.generation.continuous_batching.initialization import BOUNDS

    assert DEFAULT_PAGE_SIZE == transformers.ContinuousBatchingConfig().page_size
    assert MIN_PAGE_SIZE == BOUNDS["page_size"][0]
    assert backend.translate(options(backend)).page_size == DEFAULT_PAGE_SIZE

    shown = run_llmctl("config", "show", "--backend", "transformers", "--explain")
    assert shown.returncode == 0, shown.stderr
    row = next(line for line in shown.stdout.splitlines() if "cache_block_seq_len" in line)
    assert f"{DEFAULT_PAGE_SIZE}" in row and "backend default" in row


@pytest.mark.parametrize(
    "flags, option, rule",
    [
        ({"cache_block_seq_len": 2}, "cache_block_seq_len", "at least 4 tokens"),
        (
            {"max_batch_size": 64, "max_prefill_token_num": 32},
            "max_batch_size",
            "at most max_prefill_token_num (32)",
        ),
        ({"lora": {"a": "/tmp/adapter"}}, "lora", "does not serve LoRA adapters"),
        ({"quantization": "int8"}, "quantization", "does not quantize weights"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype", "in the model's dtype"),
    ],
)
def test_each_refused_value_has_its_rule(backend, flags, option, rule) -> None:
    errors = backend.option_errors(options(backend, **flags), CPU)
    assert list(errors) == [option]
    assert rule in errors[option]


def test_cuda_without_a_gpu_is_refused(backend) -> None:
    errors = backend.option_errors(options(backend, device="cuda"), CPU)
    assert "no CUDA GPU" in errors["device"]


def test_defaults_are_accepted(backend) -> None:
    assert backend.option_errors(options(backend), CPU) == {}


def test_an_explicit_value_it_refuses_stops_serve_with_the_rule(tiny_non_llama) -> None:
    require_transformers_plugin()
    gpt2 = str(tiny_non_llama("gpt2"))
    chosen = run_llmctl(
        "serve", gpt2, "--backend", "transformers", "--cache-block-seq-len", "2", "--port", "0"
    )
    assert chosen.returncode != 0
    message = one_line(chosen.stderr + chosen.stdout)
    assert "Error:" in message and "Traceback" not in message
    assert "cache_block_seq_len=2 (set by flag (--cache-block-seq-len)) is refused by" in message
    assert "transformers: " in message and "at least 4 tokens" in message
    # Under `auto` the refused value is still the news (the proxy tried after it fails
    # for want of an upstream), with the other backends' reasons after it.
    auto = run_llmctl("serve", gpt2, "--cache-block-seq-len", "2", "--port", "0")
    assert auto.returncode != 0
    message = one_line(auto.stderr + auto.stdout)
    assert "cache_block_seq_len=2 (set by flag (--cache-block-seq-len)) is refused by" in message
    assert "is refused by transformers:" in message and "at least 4 tokens" in message
    assert "Other backends' reasons: turbo:" in message


@pytest.mark.parametrize(
    "kind, architecture", [("gpt2", "GPT2LMHeadModel"), ("phi", "PhiForCausalLM")]
)
def test_auto_picks_it_for_what_turbo_and_torch_cannot_serve(
    tiny_non_llama, kind, architecture
) -> None:
    require_transformers_plugin()
    result = run_llmctl("backends", "check", str(tiny_non_llama(kind)))
    assert result.returncode == 0, result.stderr
    out = one_line(result.stdout)
    assert "auto would pick transformers" in out
    assert f"turbo skipped: architecture {architecture} is not supported" in out
    assert f"torch skipped: architecture {architecture} is not supported" in out


def test_auto_does_not_pick_it_for_a_llama_the_native_backends_serve() -> None:
    require_transformers_plugin()
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES}")
    result = run_llmctl("backends", "check", str(STORIES))
    out = one_line(result.stdout)
    assert "✓ transformers can serve" in out  # it could, but it is tried last
    assert "auto would pick turbo" in out or "auto would pick torch" in out


def write_config(directory: Path, config: dict) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_architecture_checks_say_why(tmp_path: Path) -> None:
    require_transformers_plugin()
    from llmctl_transformers.support import architecture_problem

    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    assert architecture_problem(gpt2) is None
    bert = {"model_type": "bert", "architectures": ["BertForMaskedLM"]}
    assert "BertForMaskedLM is not a causal language model" in architecture_problem(bert)
    t5 = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}
    assert "not a causal language model" in architecture_problem(t5)
    unknown = {"model_type": "no-such-model", "architectures": ["NoSuchForCausalLM"]}
    assert "does not know model_type 'no-such-model'" in architecture_problem(unknown)
    remote = {**gpt2, "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    assert "ships its own modelling code" in architecture_problem(remote)

    # A BERT checkpoint: `backends check` says why no backend, this one included, serves it.
    bert_dir = write_config(tmp_path / "bert", bert)
    result = run_llmctl(
        "backends", "check", str(bert_dir), env={"LLMCTL_PLUGINS": "torch,transformers"}
    )
    out = one_line(result.stdout + result.stderr)
    assert "transformers cannot serve" in out
    assert "BertForMaskedLM is not a causal language model" in out
