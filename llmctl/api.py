"""The Python API, shaped like vLLM's::

    from llmctl import LLM, SamplingParams

    llm = LLM("smollm2-135m", backend="auto", cache_block_seq_len=64)
    for out in llm.generate(["Once upon a time"], SamplingParams(max_tokens=32)):
        print(out.text)

Options are the unified ones of ``llmctl/options.py`` (``session_len``,
``cache_max_entry_count``, ...), resolved with a profile and the environment exactly
as the CLI resolves them. All prompts of one call run concurrently through the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmctl.backend import (
    Engine,
    GenerationOutput,
    GenerationRequest,
    TokenLogprob,
    capabilities,
)
from llmctl.engine.sampling_params import SamplingParams

Message = dict[str, Any]

# generate returns whole answers, so its requests' outputs come at the first token and
# the last only (GenerationRequest.stream_interval): no output object per token.
WHOLE_ANSWER = 1 << 30


@dataclass
class CompletionOutput:
    """One choice of a prompt's result (``SamplingParams.n`` of them)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """The whole result of one prompt: its choices in ``outputs``. ``text``,
    ``token_ids``, ``finish_reason`` and ``logprobs`` are the first choice's, the whole
    answer when ``n`` is 1."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # One per prompt token (the first's logprob None), when SamplingParams asked for them.
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs


class LLM:
    def __init__(
        self,
        model: str | None = None,
        backend: str = "auto",
        profile: str | None = None,
        **options,
    ) -> None:
        """``model``: a model argument as the CLI takes it; None: the ``model`` option
        (profile, environment), else the default model ``smollm2-135m``."""
        from llmctl.options import unknown_env_vars
        from llmctl.profiles import Keywords
        from llmctl.selection import select

        for warning in unknown_env_vars(os.environ):
            warnings.warn(warning, stacklevel=2)
        flags = Keywords(checked_options({**options, "backend": backend}))
        choice = select(model, flags, profile=profile)
        self.engine: Engine = choice.create_engine()
        self.backend = choice.backend.name
        self._ids = itertools.count()
        # An LLM dropped without shutdown() (``del llm``, the end of a script) still stops
        # its engine: a tensor-parallel one holds ranks and the process group, which the
        # next LLM of this process needs. The finalizer holds the engine, never self.
        self._finalizer = weakref.finalize(self, _shutdown_engine, self.engine)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids); results in prompt order,
        each with ``n`` choices.

        ``lora``: the LoRA adapter (a name given with the ``lora`` option, or loaded with
        ``load_lora``) every prompt runs with, or one name (None: the base model) per
        prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(
            [
                {"prompt": p, "lora": adapter}
                if isinstance(p, str)
                else {"prompt_token_ids": list(p), "lora": adapter}
                for p, adapter in zip(prompts, _per_prompt_lora(lora, prompts))
            ],
            _per_prompt(sampling_params, len(prompts)),
        )

    def load_lora(self, name: str, path: str) -> None:
        """Serve the LoRA adapter at ``path`` (a PEFT directory) as ``name`` from now on."""
        _run_sync(capabilities(self.engine).load_lora(name, str(path)))

    def unload_lora(self, name: str) -> None:
        """Stop serving ``name``; returns once the requests using it have finished."""
        _run_sync(capabilities(self.engine).unload_lora(name))

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several, via the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run(
            [{"messages": list(m)} for m in conversations],
            _per_prompt(sampling_params, len(conversations)),
        )

    def shutdown(self) -> None:
        """Stop the engine and release what it holds (worker ranks); safe to call twice."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def _run(
        self, prompts: list[dict[str, Any]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        """One engine request per choice of each prompt; the outputs grouped back."""
        results, requests, slots = [], [], []
        for prompt, sampling in zip(prompts, params):
            request_id = f"llm-{next(self._ids)}"
            choices = sampling.choices()
            result = RequestOutput(
                request_id=request_id,
                prompt=prompt.get("prompt"),
                prompt_token_ids=list(prompt.get("prompt_token_ids") or []),
                outputs=[CompletionOutput(index=j) for j in range(len(choices))],
            )
            results.append(result)
            for j, choice in enumerate(choices):
                rid = request_id if len(choices) == 1 else f"{request_id}-{j}"
                requests.append(
                    GenerationRequest(
                        request_id=rid, sampling=choice, stream_interval=WHOLE_ANSWER, **prompt
                    )
                )
                slots.append((result, result.outputs[j]))
        if not requests:
            return results
        engine = capabilities(self.engine)
        if not engine.serves_lora and any(request.lora for request in requests):
            from llmctl.errors import InvalidRequest

            raise InvalidRequest(
                f"the {self.backend} backend serves no LoRA adapters: use backend='torch'",
                param="lora",
            )
        if engine.can_generate_all:  # a local engine: no event loop needed
            for (result, choice), output in zip(slots, engine.generate_all(requests)):
                _merge(result, choice, output)
            return results

        async def collect(request: GenerationRequest, result, choice) -> None:
            async for output in self.engine.generate(request):
                _merge(result, choice, output)

        async def run_all() -> None:
            await asyncio.gather(*(collect(r, *slot) for r, slot in zip(requests, slots)))

        _run_sync(run_all())
        return results


def checked_options(options: dict[str, Any]) -> dict[str, Any]:
    """The keyword options of ``LLM(...)``, each checked and converted by its schema entry:
    a misspelled or unknown name is the error a profile gives, with a "did you mean"."""
    from llmctl.errors import OptionError
    from llmctl.options import all_options, unknown_key_message

    schema = {opt.name: opt for opt in all_options()}
    checked = {}
    for name, value in options.items():
        if name not in schema:
            raise OptionError(unknown_key_message(name, f"LLM({name}=...)"))
        checked[name] = schema[name].convert(value, f"LLM({name}=...)")
    return checked


def _merge(result: RequestOutput, choice: CompletionOutput, output: GenerationOutput) -> None:
    if output.prompt_token_ids is not None:
        result.prompt_token_ids = list(output.prompt_token_ids)
    if output.prompt_logprobs is not None:
        result.prompt_logprobs = list(output.prompt_logprobs)
    choice.text += output.text
    choice.token_ids.extend(output.token_ids)
    if output.logprobs is not None:
        choice.logprobs = (choice.logprobs or []) + output.logprobs
    if output.finished:
        choice.finish_reason = output.finish_reason


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)


def _per_prompt_lora(lora: str | Sequence[str | None] | None, prompts: Sequence) -> list:
    if lora is None or isinstance(lora, str):
        return [lora] * len(prompts)
    if len(lora) != len(prompts):
        raise ValueError(f"got {len(lora)} LoRA adapter names for {len(prompts)} prompts")
    return list(lora)


def _shutdown_engine(engine: Engine) -> None:
    _run_sync(engine.shutdown())


def _run_sync(coroutine):
    """Run a coroutine to completion, also from code already inside an event loop
    (a notebook), where it runs on a loop of its own in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
