"""``PlainGenerateEngine``: serve a model through transformers' plain ``generate``, for
the architectures its continuous batching cannot run (GPT-NeoX in transformers 5.24;
``engine._probe_continuous_batching`` finds out at engine start).

Dynamic batches: one worker thread takes every request waiting with the same sampling
settings (up to ``max_batch`` of them), left-pads their prompts into one batch and runs
one ``generate`` call for it; requests that arrive meanwhile wait for the next batch. A
streamer hands each step's tokens to their requests as they come, and a stopping
criterion ends each row on its own (its finish reason, an abort), as llmctl's engines
do. The request side (validation, detokenizing, stop strings, finish reasons) is the
continuous-batching engine's (``requests.admit``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import transformers

from llmctl.backend import EngineStats, GenerationOutput
from llmctl.engine.async_engine import joined
from llmctl.errors import InvalidRequest
from llmctl.model.tokenizer import Tokenizer
from llmctl_transformers.requests import RequestEngine, RequestState


class PlainGenerateEngine(RequestEngine):
    def __init__(
        self,
        model: Any,  # a transformers causal LM, loaded and in eval mode
        tokenizer: Tokenizer,
        *,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        max_batch: int,
        seed: int,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_size = 1  # no paged cache: only the session bounds a request
        self.num_blocks = max_model_len
        self._max_batch = max_batch
        self._generator_seed = seed
        self._lock = threading.Condition()  # guards the four fields below
        self._waiting: list[Any] = []
        self._running: dict[str, Any] = {}
        self._aborted: set[str] = set()
        self._stopping = False
        self._worker = threading.Thread(target=self._serve, name="llmctl-generate", daemon=True)
        self._worker.start()

    def _submit(self, state: RequestState) -> None:
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine has been shut down")
            if state.request_id in self._running or any(
                w.request_id == state.request_id for w in self._waiting
            ):
                raise InvalidRequest(f"request id {state.request_id!r} is already in use")
            self._waiting.append(state)
            self._lock.notify()

    def is_alive(self) -> bool:
        return self._worker.is_alive() and not self._stopping

    def _abort(self, request_id: str) -> None:
        with self._lock:
            waiting = next((w for w in self._waiting if w.request_id == request_id), None)
            if waiting is not None:
                self._waiting.remove(waiting)
                _deliver(waiting, waiting.aborted())
            elif request_id in self._running:
                self._aborted.add(request_id)  # its row stops at the next step

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(running=len(self._running), waiting=len(self._waiting))

    async def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._aborted.update(self._running)
            for state in self._waiting:
                _deliver(state, state.aborted())
            self._waiting.clear()
            self._lock.notify()
        await joined(self._worker)

    # -- the worker thread --------------------------------------------------------------

    def _serve(self) -> None:
        torch.manual_seed(self._generator_seed)  # sampled batches follow the seed option
        while True:
            with self._lock:
                while not self._waiting and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    return
                batch = self._next_batch()
            try:
                self._run(batch)
            except Exception as exc:  # a failed batch fails its requests; the engine goes on
                with self._lock:
                    for state in batch:
                        if self._running.pop(state.request_id, None) is not None:
                            _deliver(state, RuntimeError(f"transformers failed: {exc}"))

    def _next_batch(self) -> list[Any]:
        """The oldest waiting request and those waiting with the same sampling settings."""
        key = _sampling_key(self._waiting[0])
        batch = [s for s in self._waiting if _sampling_key(s) == key][: self._max_batch]
        for state in batch:
            self._waiting.remove(state)
            self._running[state.request_id] = state
        return batch

    def _run(self, batch: list[Any]) -> None:
        longest = max(len(s.prompt_token_ids) for s in batch)
        pad = self.tokenizer.eos_token_ids[0] if self.tokenizer.eos_token_ids else 0
        ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, state in enumerate(batch):  # left padding: every row ends where it decodes
            prompt = state.prompt_token_ids
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        rows = _Rows(self, batch)
        sampling = batch[0].sampling
        device = self.model.device
        self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max(s.sampling.max_tokens for s in batch),
            min_new_tokens=0,
            streamer=rows,
            stopping_criteria=transformers.StoppingCriteriaList([rows]),
            pad_token_id=pad,
            eos_token_id=None,  # llmctl ends each row itself (its stop ids, its reasons)
            **_generate_sampling(sampling, self.vocab_size),
        )
        rows.end()


class _Rows(transformers.generation.streamers.BaseStreamer, transformers.StoppingCriteria):
    """The rows of one ``generate`` call: takes each step's tokens (as its streamer) and
    says which rows are done (as its stopping criterion)."""

    def __init__(self, engine: PlainGenerateEngine, batch: list[Any]) -> None:
        self.engine = engine
        self.batch = batch
        self.done = [False] * len(batch)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call is the prompt
            self.prompt_seen = True
            return
        tokens = value.reshape(len(self.batch), -1)[:, -1].tolist()
        with self.engine._lock:
            for row, (state, token) in enumerate(zip(self.batch, tokens)):
                if self.done[row]:
                    continue
                if state.request_id in self.engine._aborted:
                    self._finish(row, state.aborted())
                    continue
                output = state.advance(token)
                if output.finished:
                    self._finish(row, output)
                else:
                    _deliver(state, output)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> Any:
        with self.engine._lock:
            for row, state in enumerate(self.batch):
                if not self.done[row] and state.request_id in self.engine._aborted:
                    self._finish(row, state.aborted())
            done = list(self.done)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    def end(self) -> None:
        """After ``generate``: a row it stopped at its length limit ends with ``length``."""
        with self.engine._lock:
            for row, state in enumerate(self.batch):
                if not self.done[row]:
                    self._finish(row, state.ended("length"))

    def _finish(self, row: int, output: GenerationOutput) -> None:
        self.done[row] = True
        state = self.batch[row]
        self.engine._running.pop(state.request_id, None)
        self.engine._aborted.discard(state.request_id)
        _deliver(state, output)


def _sampling_key(state: Any) -> tuple:
    s = state.sampling
    return (s.greedy, s.temperature, s.top_k, s.top_p) if not s.greedy else (True,)


def _generate_sampling(sampling: Any, vocab_size: int) -> dict[str, Any]:
    if sampling.greedy:
        return {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    top_k = sampling.top_k if sampling.top_k > 0 else vocab_size
    return {
        "do_sample": True,
        "temperature": float(sampling.temperature),
        "top_k": int(top_k),
        "top_p": float(sampling.top_p),
    }


def _deliver(state: Any, item: GenerationOutput | BaseException) -> None:
    try:
        state.loop.call_soon_threadsafe(state.outputs.put_nowait, item)
    except RuntimeError:  # its event loop is closed: nobody is listening any more
        pass
