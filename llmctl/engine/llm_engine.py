"""The synchronous engine loop: add requests, run steps, collect each request's progress.

One ``step()`` schedules a batch, runs the model once over it, samples a token for
every sequence whose input is fully computed, and checks stop conditions. It is not
thread-safe; ``AsyncEngine`` drives it from one thread.
"""

from __future__ import annotations

from dataclasses import replace

from llmctl.backend import GenerationOutput, TokenLogprob
from llmctl.engine.block_manager import BlockManager
from llmctl.engine.config import EngineOptions
from llmctl.engine.detokenizer import IncrementalDetokenizer
from llmctl.engine.faults import FaultPlan
from llmctl.engine.request_rules import finish_reason, validate_request
from llmctl.engine.runner import ModelRunner
from llmctl.engine.sampler import SampledToken, Sampler
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.scheduler import Scheduler
from llmctl.engine.sequence import Sequence
from llmctl.engine.tokenizer import Tokenizer
from llmctl.errors import InvalidRequest


class StepFailed(Exception):
    """Running the model on one step's batch raised (the cause is ``__cause__``); the
    requests of that step cannot go on, the engine's own state is intact."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"the model call failed for {len(request_ids)} request(s)")
        self.request_ids = request_ids


class LLMEngine:
    """``options`` is the backend's own config (see ``EngineOptions``); the rest is what
    loading the model decided: the session length, the stop tokens and the vocabulary.
    The KV cache is the runner's, already allocated."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        options: EngineOptions,
        *,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        vocab_size: int | None = None,
    ) -> None:
        if runner.block_size != options.block_size or runner.num_blocks < 1:
            raise ValueError(
                f"the runner's cache ({runner.num_blocks} blocks of {runner.block_size}) does "
                f"not fit the engine's block size {options.block_size}"
            )
        self.runner = runner
        self.tokenizer = tokenizer
        self.block_size = options.block_size
        self.num_blocks = runner.num_blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.block_manager = BlockManager(
            self.num_blocks, self.block_size, options.enable_prefix_caching
        )
        self.scheduler = Scheduler(options, self.block_manager)
        self.sampler = Sampler(eos_token_ids, options.seed)
        self._seqs: dict[str, Sequence] = {}
        self._faults = FaultPlan.from_env()  # only tests set LLMCTL_TEST_FAULT

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ``InvalidRequest`` if this request can never run here."""
        validate_request(
            prompt_token_ids,
            sampling,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
        )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> None:
        if request_id in self._seqs:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, sampling)
        if sampling.max_tokens is None:  # "until the session is full"
            sampling = replace(sampling, max_tokens=self.max_model_len - len(prompt_token_ids))
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sampling)
        seq = Sequence(request_id, prompt_token_ids, sampling, detokenizer)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> GenerationOutput | None:
        """Stop a request and free its blocks; ``None`` if it is not in flight."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        return GenerationOutput.aborted(
            request_id,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            prompt_token_ids=seq.prompt_token_ids if seq.num_output_tokens == 0 else None,
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[GenerationOutput]:
        """Run one batch; return the progress of every request that got a token.

        Raises ``StepFailed`` when the model call (or sampling from its logits) raises:
        the step's requests are still in flight, for the caller to abort.
        """
        step = self.scheduler.schedule()
        if step is None:
            if self.has_unfinished():  # validation guarantees every request fits alone
                raise RuntimeError("the scheduler could not run any waiting request")
            return []
        try:
            self._faults.before_model_call()
            logits = self.runner.execute(step.to_batch(self.block_size))
            ready = self.scheduler.mark_computed(step)
            if not ready:
                return []
            ready_ids = {id(seq) for seq in ready}
            rows = [i for i, seq in enumerate(step.seqs) if id(seq) in ready_ids]
            sampled = self.sampler(logits[rows], ready)
        except Exception as exc:
            raise StepFailed([seq.request_id for seq in step.seqs]) from exc
        return [self._advance(seq, token) for seq, token in zip(ready, sampled)]

    def _advance(self, seq: Sequence, sampled: SampledToken) -> GenerationOutput:
        """Append the sampled token, decode it and decide whether ``seq`` is done."""
        token_id = sampled.token_id
        seq.append_token(token_id)
        reason = finish_reason(
            token_id, seq.num_output_tokens, seq.sampling, self.eos_token_ids, seq.detokenizer
        )
        finished = reason is not None
        output = GenerationOutput(
            request_id=seq.request_id,
            text=seq.detokenizer.take_new_text(final=finished),
            token_ids=[token_id],
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            finished=finished,
            finish_reason=reason,
            logprobs=[self._token_logprob(sampled)] if sampled.logprob is not None else None,
            prompt_token_ids=seq.prompt_token_ids if seq.num_output_tokens == 1 else None,
        )
        if finished:
            self.scheduler.finish(seq, reason)
            del self._seqs[seq.request_id]
        return output

    def _token_logprob(self, sampled: SampledToken) -> TokenLogprob:
        text = self.tokenizer.token_text
        return TokenLogprob(
            token_id=sampled.token_id,
            token=text(sampled.token_id),
            logprob=sampled.logprob,
            top=[(token_id, text(token_id), logprob) for token_id, logprob in sampled.top],
        )
