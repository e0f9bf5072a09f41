"""The synchronous engine loop: add requests, run steps, collect each request's progress.

One ``step()`` schedules a batch, runs the model once over it, samples a token for
every sequence whose input is fully computed, and checks stop conditions. It is not
thread-safe; ``AsyncEngine`` drives it from one thread.

On the GPU steps overlap, as vLLM's async scheduling does: ``step()`` prepares and
launches step N+1 while the device still runs step N (the tokens N samples stay on the
device and N+1 reads them there), and only then waits for step N's tokens and turns
them into outputs. So a call returns the outputs of the step before the one it
launched; a request that turns out finished has one extra token computed and dropped.
A request with penalties or a grammar needs its previous tokens on the host, so while
one runs the steps do not overlap; a grammar's next mask is filled on another thread
while the model runs (``grammar.GrammarMasks``). On the CPU nothing runs behind the host's back, so each step
completes before the next is prepared.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from time import perf_counter
from typing import TYPE_CHECKING, cast

import torch

from llmctl.backend import GenerationOutput, TokenLogprob
from llmctl.engine.block_manager import BlockManager
from llmctl.engine.config import EngineConfig
from llmctl.engine.detokenizer import IncrementalDetokenizer
from llmctl.engine.draft import DraftModel
from llmctl.engine.faults import FaultPlan
from llmctl.engine.held_steps import HeldSteps
from llmctl.engine.lora import LoraRunner, LoraSlots
from llmctl.engine.runner import ModelRunner
from llmctl.engine.sampler import SampledBatch, SampledToken, Sampler
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.scheduler import InFlight, ScheduledStep, Scheduler
from llmctl.engine.sequence import Sequence, SequenceStatus, finish_reason, validate_request
from llmctl.engine.speculative import Speculator
from llmctl.engine.step_profile import StepProfile
from llmctl.engine.transfer import to_device
from llmctl.errors import InvalidRequest
from llmctl.model.token_bytes import token_pieces
from llmctl.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llmctl.engine.grammar import GrammarCompiler, GrammarMasks


def take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``. On the CPU through numpy: torch's indexing right after a native
    step was measured at ~9 ms for 16 rows of 512 (its threads wake while turbo's still
    spin on the 2-core test machine), numpy's at ~0.03 ms."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy()[rows])
    return logits[to_device(rows, torch.int64, logits.device)]


class StepFailed(Exception):
    """Running the model on one step's batch raised (the cause is ``__cause__``); the
    requests of that step cannot go on, the engine's own state is intact. ``outputs``
    are those the step had already collected from the step before (overlapped steps):
    they must still be delivered."""

    def __init__(self, request_ids: list[str], outputs: list[GenerationOutput]) -> None:
        super().__init__(f"the model call failed for {len(request_ids)} request(s)")
        self.request_ids = request_ids
        self.outputs = outputs


class LLMEngine:
    """``config`` is the engine configuration the runner was built from; the rest is what
    loading the model decided: the session length, the stop tokens and the vocabulary.
    The KV cache is the runner's, already allocated: its ``block_size`` and ``num_blocks``
    are the block manager's."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        config: EngineConfig,
        *,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        vocab_size: int | None = None,
        overlap: bool | None = None,
        draft_runner: ModelRunner | None = None,
    ) -> None:
        """``draft_runner``: the draft model of ``speculative_method=draft``, its cache
        allocated with as many blocks as ``runner``'s (``llmctl.engine.draft``)."""
        if runner.num_blocks < 1:
            raise ValueError("the runner's KV cache must be allocated before the engine starts")
        if draft_runner is not None and draft_runner.num_blocks != runner.num_blocks:
            raise ValueError("the draft model's KV cache must have the target's blocks")
        self.runner = runner
        # A runner that can hand back each row's argmax with the logits (PagedRunner's
        # execute_greedy; optional in ModelRunner): steps whose every row is greedy use it.
        self._execute_greedy = getattr(runner, "execute_greedy", None)
        self.tokenizer = tokenizer
        self.block_size = runner.block_size
        self.num_blocks = runner.num_blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.block_manager = BlockManager(
            self.num_blocks, self.block_size, config.enable_prefix_caching
        )
        # LoRA adapters, where the runner serves them (None: it does not)
        self.loras = LoraSlots(cast(LoraRunner, runner)) if runner.serves_lora else None
        # A held token's text is its table entry (``Sequence.hold_below``): its id is
        # in the table and not among those without an entry.
        pieces = token_pieces(tokenizer)
        self._num_texts = len(pieces.texts) if pieces is not None else 0
        self._untabled = pieces.untabled if pieces is not None else frozenset()
        # ``overlap`` None: steps overlap where the device runs apart from the host. Not
        # under speculation: proposals are read from each request's tokens, which must
        # be on the host.
        if overlap is None:
            overlap = runner.device.type == "cuda"
        self.overlap = overlap and not config.speculation.enabled
        self.scheduler = Scheduler(
            config,
            self.block_manager,
            self.block_manager.blocks_needed(max_model_len),
            HeldSteps(self.block_manager, self._num_texts, self._untabled, self.overlap),
            self.loras,
        )
        self.sampler = Sampler(eos_token_ids, config.seed)
        self.profile = StepProfile()
        self.speculator: Speculator | None = None
        if config.speculation.enabled:
            draft = None
            if draft_runner is not None:
                draft = DraftModel(draft_runner, vocab_size or tokenizer.vocab_size)
            self.speculator = Speculator(config.speculation, self.sampler, draft)
        self._in_flight: InFlight | None = None
        # The step in flight whose rows' pending tokens the step after it took over
        # (``_sample``): ``_process`` does not count them off.
        self._carried: ScheduledStep | None = None
        self._seqs: dict[str, Sequence] = {}
        self._num_needing_host_tokens = 0  # requests with penalties or grammars in flight
        self._num_not_plain_greedy = 0  # requests in flight that are not a plain argmax
        self._num_streamed = 0  # requests in flight whose every token goes out
        self._num_min_tokens = 0  # requests in flight with min_tokens
        self._grammars: GrammarCompiler | None = None  # made on the first grammar
        self._grammar_lock = threading.Lock()
        self._grammar_masks: GrammarMasks | None = None
        self._num_constrained = 0  # requests with a grammar in flight
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

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of structured-output grammars (xgrammar is imported on first use)."""
        with self._grammar_lock:  # the async engine compiles from the event loop's thread
            if self._grammars is None:
                from llmctl.engine.grammar import GrammarCompiler, GrammarMasks

                vocab_size = self.vocab_size or self.tokenizer.vocab_size
                self._grammar_masks = GrammarMasks(vocab_size)
                self._grammars = GrammarCompiler(self.tokenizer, vocab_size, self.eos_token_ids)
        return self._grammars

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        lora: str | None = None,
        stream_interval: int = 1,
    ) -> None:
        """Queue a request; ``lora`` names the LoRA adapter it runs with (None: the base
        model). Its outputs come at the first token, every ``stream_interval``-th and the
        last (``GenerationRequest.stream_interval``)."""
        if request_id in self._seqs:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, sampling)
        adapter = self.lora_adapter(lora)
        grammar = None
        if sampling.structured is not None:
            from llmctl.engine.grammar import GrammarState

            # Compiled already when the async engine awaited it; else compiled here.
            grammar = GrammarState(self.grammars.compiled(sampling.structured))
        if sampling.max_tokens is None:  # "until the session is full"
            sampling = replace(sampling, max_tokens=self.max_model_len - len(prompt_token_ids))
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sampling)
        seq = Sequence(
            request_id, prompt_token_ids, sampling, detokenizer, self.eos_token_ids, grammar
        )
        seq.stream_interval = stream_interval
        if sampling.prompt_logprobs is not None:  # the first token has nothing before it
            first = prompt_token_ids[0]
            seq.prompt_logprobs = [TokenLogprob(first, self.tokenizer.token_text(first), None)]
        if adapter is not None:
            seq.lora, seq.cache_salt = adapter, adapter.cache_salt
            self.loras.add_request(adapter)
        self._seqs[request_id] = seq
        self._num_needing_host_tokens += seq.needs_host_tokens
        self._num_not_plain_greedy += not seq.plain_greedy
        self._num_streamed += stream_interval == 1
        self._num_min_tokens += bool(sampling.min_tokens)
        self._num_constrained += grammar is not None
        self.scheduler.add(seq)

    def lora_adapter(self, name: str | None):
        """The registered adapter ``name`` (None for None); ``InvalidRequest`` if unknown."""
        if name is None:
            return None
        if self.loras is None:
            raise InvalidRequest(
                f"the LoRA adapter {name!r} is not loaded here: this engine serves no "
                "adapters (the torch backend does, and turbo on the CPU)",
                param="model",
                code="model_not_found",
            )
        return self.loras.get(name)

    def abort(self, request_id: str) -> GenerationOutput | None:
        """Stop a request and free its blocks; ``None`` if it is not in flight."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort")
        output = GenerationOutput.aborted(
            request_id,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            prompt_token_ids=seq.prompt_token_ids if seq.num_output_tokens == 0 else None,
        )
        if seq.num_held_tokens:
            seq.release_held()
        if seq.unsent_texts:  # what a stream_interval held back still goes out
            output.text, output.token_ids, output.logprobs = seq.take_unsent("", 0, None)
        return output

    def has_unfinished(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished()

    def step(self, before_model: Callable[[], None] | None = None) -> list[GenerationOutput]:
        """Run one batch; return the progress of every request that got a token (with
        overlapping steps, the tokens of the step launched before).

        ``before_model`` runs just before the model call: the async engine hands over the
        previous step's outputs there, so their consumers run while the model computes
        (torch releases the GIL) instead of between steps.

        Raises ``StepFailed`` when the model call (or sampling from its logits) raises:
        the step's requests are still in flight, for the caller to abort.
        """
        outputs = []
        if self._in_flight is not None and self._num_needing_host_tokens:
            outputs = self._collect()  # sampling needs the last tokens on the host
        profile = self.profile
        started = perf_counter()
        if self.speculator is not None and self.speculator.propose(self.scheduler.running):
            self.scheduler.forget_repeatable()
        step = self.scheduler.schedule()
        if step is None:
            if self._in_flight is not None:
                return outputs + self._collect()
            if self.has_unfinished():  # validation guarantees every request fits alone
                raise RuntimeError("the scheduler could not run any waiting request")
            return outputs
        drafting = perf_counter()
        if self.speculator is not None:
            self.speculator.fill_proposals(step)  # a draft model's, once blocks are there
        scheduled = perf_counter()
        batch = self.scheduler.batches.build(step, self._in_flight)
        masks = self._start_masks(step)
        built = perf_counter()
        if before_model is not None:
            before_model()
        launched = perf_counter()
        try:
            self._faults.before_model_call()
            greedy_ids = None
            if self._execute_greedy is not None and self._plain_argmax(step):
                logits, greedy_ids = self._execute_greedy(batch)
            else:
                logits = self.runner.execute(batch)
            ran = perf_counter()
            self.scheduler.mark_computed(step)
            marked = perf_counter()
            sampled = self._sample(step, logits, masks, greedy_ids)
        except Exception as exc:
            raise StepFailed([seq.request_id for seq in step.seqs], outputs) from exc
        # A draft model's calls (speculative_method=draft; 0 otherwise) are model time,
        # and a verification step costs them too (what adaptive speculation weighs).
        draft_seconds = scheduled - drafting
        if self.speculator is not None:
            seconds = perf_counter() - launched + draft_seconds
            accepted = sum(len(tokens) - 1 for tokens, _ in step.verified.values())
            emitted = len(step.ready) + accepted
            tokens = len(batch.input_ids)
            proposals = sum(map(len, step.proposed.values()))
            decodes = tokens == len(step.seqs) + proposals  # no prompt chunk
            self.speculator.step_seconds(tokens, seconds, emitted, len(step.proposed), decodes)
        previous, self._in_flight = self._in_flight, (step, sampled)
        profile.steps += 1
        profile.scheduled_seqs += len(step.seqs)
        profile.schedule += drafting - started + marked - ran
        profile.inputs += built - scheduled
        profile.model += ran - launched + draft_seconds
        profile.sample += perf_counter() - marked
        if not self.overlap:
            return outputs + self._collect()
        return outputs + (self._process(*previous) if previous is not None else [])

    def _start_masks(self, step: ScheduledStep) -> Future | None:
        """Start filling the grammar masks of the rows the sampler serves this step
        (``None``: no constrained row). A constrained row never verifies proposals."""
        if not self._num_constrained or not step.ready:
            return None
        return self._grammar_masks.start([step.seqs[i].grammar for i in step.sampled_rows()])

    def _plain_argmax(self, step: ScheduledStep) -> bool:
        """Whether every row of ``step``'s logits samples its argmax: then the runner may
        find those with the logits (``execute_greedy``)."""
        # Counted, not asked of each row: right after the model call every row's object
        # is out of the cache, and a look at each costs more than the argmax. Verified
        # positions of plain greedy requests are accepted by their argmax too.
        return not self._num_not_plain_greedy and not step.scored

    def _sample(
        self,
        step: ScheduledStep,
        logits: torch.Tensor,
        masks: Future | None = None,
        greedy_ids: torch.Tensor | None = None,
    ) -> SampledBatch | None:
        """Sample the ready rows; their tokens are pending until ``_process``. Rows that
        verify proposals are verified here, their tokens kept in ``step.verified``.
        ``greedy_ids``: each row's argmax, when the runner found it (``_plain_argmax``)."""
        if step.scored:
            logits = self._score_prompts(step, logits)
        # With greedy ids the logits are not read again: a copy of rows that other cores
        # just wrote costs more than the argmax did (~80 µs for one SmolLM2 row).
        if step.proposed:
            last_rows = self._verify(step, logits, greedy_ids)
            if greedy_ids is not None:
                greedy_ids = take_rows(greedy_ids, last_rows)
            else:
                logits = take_rows(logits, last_rows)
        ready, seqs = step.sampled_rows(), step.seqs
        if not ready:
            return None
        if len(ready) < len(seqs):
            seqs = [seqs[i] for i in ready]
            if greedy_ids is not None:
                greedy_ids = take_rows(greedy_ids, ready)
            else:
                logits = take_rows(logits, ready)
        if greedy_ids is not None:
            sampled = SampledBatch(greedy_ids)
        else:
            plain_greedy = not self._num_not_plain_greedy  # as in _plain_argmax
            sampled = self.sampler.sample(logits, seqs, masks, plain_greedy=plain_greedy)
        if self.overlap:  # else ``_process`` takes the tokens before anything reads these
            if step.pending and step.repeats is not None:
                # A repeat of the step in flight, which ``_process`` takes next: each row
                # trades that step's pending token for this one's, so neither step
                # counts its rows' tokens (right after the model call each row is a
                # cache miss).
                self._carried = step.repeats
            else:
                for seq in seqs:
                    seq.num_pending_tokens += 1
        return sampled

    def _score_prompts(self, step: ScheduledStep, logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt logprobs of the scored rows (``logits`` has a row per new token
        of those, per verified position of proposing rows, and one per other sequence);
        the same logits without the scored rows' earlier positions."""
        keep: list[int] = []
        row = 0
        for index, (seq, start, count) in enumerate(
            zip(step.seqs, step.starts, step.num_new_tokens)
        ):
            if index in step.scored:
                self._record_prompt_logprobs(seq, start, logits[row : row + count])
                row += count
                keep.append(row - 1)
            else:
                width = len(step.proposed.get(index, ())) + 1
                keep.extend(range(row, row + width))
                row += width
        return take_rows(logits, keep)

    def _record_prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """``logits[j]`` (from position ``start + j``) scores prompt token ``start + j + 1``:
        append the logprobs of the tokens not scored yet (a recompute after preemption
        feeds scored positions again), from the model's own distribution."""
        scored = seq.prompt_logprobs
        first = len(scored) - 1 - start  # the row of the first token not scored yet
        end = min(len(logits), seq.num_prompt_tokens - 1 - start)
        if first < 0:
            raise RuntimeError(f"{seq.request_id}: prompt scored out of order")
        if first >= end:
            return
        targets = seq.prompt_token_ids[start + first + 1 : start + end + 1]
        logprobs = torch.log_softmax(logits[first:end].float(), dim=-1)
        target_ids = torch.tensor(targets, dtype=torch.int64, device=logprobs.device)
        chosen = logprobs.gather(1, target_ids.unsqueeze(1))
        ranks = (logprobs > chosen).sum(dim=1) + 1
        k = seq.sampling.prompt_logprobs
        top_values, top_ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
        text = self.tokenizer.token_text
        for token_id, logprob, rank, values, ids in zip(
            targets,
            chosen.squeeze(1).tolist(),
            ranks.tolist(),
            top_values.tolist(),
            top_ids.tolist(),
        ):
            top = [(i, text(i), v) for i, v in zip(ids, values)]
            scored.append(TokenLogprob(token_id, text(token_id), logprob, top, rank))

    def _verify(
        self, step: ScheduledStep, logits: torch.Tensor, greedy_ids: torch.Tensor | None
    ) -> list[int]:
        """Verify the proposing rows of a speculative step (``logits`` has a row per
        position verified, and one per other sequence; ``greedy_ids`` their argmax, when
        the runner found it); the rows of every sequence's last position, those a plain
        step's logits would have."""
        speculator = self.speculator
        last_rows = []
        row = 0
        for index, seq in enumerate(step.seqs):
            proposal = step.proposed.get(index)
            if proposal:
                end = row + len(proposal) + 1
                targets = None if greedy_ids is None else greedy_ids[row:end]
                tokens, logprobs = speculator.verify(seq, proposal, logits[row:end], targets)
                step.verified[index] = (tokens, logprobs)
                self.profile.speculation.record(len(proposal), len(tokens) - 1)
                row = end
            else:
                row += 1
            last_rows.append(row - 1)
        return last_rows

    def _collect(self) -> list[GenerationOutput]:
        """Wait for the step in flight and turn its tokens into outputs."""
        step, sampled = self._in_flight
        self._in_flight = None
        return self._process(step, sampled)

    def _process(self, step: ScheduledStep, sampled: SampledBatch | None) -> list[GenerationOutput]:
        """Append each ready sequence's new token, decode it, decide whether it is done."""
        outputs = self._process_verified(step) if step.verified else []
        if sampled is None:
            return outputs
        profile = self.profile
        started = perf_counter()
        token_ids, logprobs = sampled.host()
        received = perf_counter()
        overlap = self.overlap
        # Rows whose pending token this step was (overlapped steps), unless the next step
        # took their count over (``_sample``).
        counted_off = overlap and step is not self._carried
        self._carried = None
        # A block is keyed when the step computing it is marked, unless its last token was
        # still on the device then (overlapped steps): only then is it keyed here.
        caching = overlap and self.block_manager.enable_prefix_caching
        block_size = self.block_size
        finished = SequenceStatus.FINISHED
        seqs = step.seqs
        num_texts, untabled = self._num_texts, self._untabled
        held_steps = self.scheduler.held
        covered = held_steps.covers(step)
        if covered:  # the rows that do not only hold their token; a repeat samples every
            # row, so a row of the sampled batch is the step's row
            full_rows = held_steps.hold(step, token_ids)
            rows = zip(full_rows, full_rows, map(token_ids.__getitem__, full_rows))
        else:
            rows = zip(itertools.count(), step.sampled_rows(), token_ids)
        for row, index, token_id in rows:
            seq = seqs[index]
            if counted_off:
                seq.num_pending_tokens -= 1
            if seq.status is finished:  # aborted, or done while this step ran
                continue
            all_token_ids = seq.token_ids
            # Most tokens of a stream_interval's request only wait for the next output:
            # counted, and nothing else of the request read.
            held = (
                len(all_token_ids) < seq.hold_below
                and token_id < num_texts
                and token_id not in untabled
                and token_id not in seq.stop_token_ids
            )
            if not held and seq.num_held_tokens:
                seq.release_held()
            all_token_ids.append(token_id)
            if caching and seq.num_computed_tokens // block_size > len(seq.block_hashes):
                self.block_manager.cache_full_blocks(seq)
            if held:
                seq.num_held_tokens += 1
                continue
            num_output = len(all_token_ids) - seq.num_prompt_tokens
            texts = seq.detokenizer.plain_texts
            if (
                texts is not None
                and token_id < len(texts)
                and (text := texts[token_id]) is not None
                and seq.grammar is None
            ):
                # The common case, inline (``finish_reason`` without stop strings): the
                # token's text is its table entry, nothing held back.
                if token_id in seq.stop_token_ids:
                    reason = "stop"
                    if not seq.sampling.include_stop_str_in_output:
                        text = ""
                else:
                    reason = "length" if num_output >= seq.max_tokens else None
            else:
                reason = finish_reason(
                    token_id, num_output, seq.sampling, seq.stop_token_ids, seq.detokenizer
                )
                if seq.grammar is not None:
                    reason = self._advance_grammar(seq, token_id, reason)
                text = seq.detokenizer.take_new_text(reason is not None)
            sampled_token = logprobs.get(row) if logprobs else None
            interval = seq.stream_interval
            if interval > 1 and reason is None:
                if (
                    sampled_token is None
                    and seq.grammar is None
                    and seq.detokenizer.plain_texts is not None
                ):  # hold its next tokens up to its next output while its text stays plain
                    output_due = min((num_output // interval + 1) * interval, seq.max_tokens)
                    seq.hold_below = seq.num_prompt_tokens + output_due - 1  # tokens before one
                elif seq.hold_below:  # a character half done, say: the next needs it all
                    seq.hold_below = 0
                if num_output > 1 and num_output % interval:
                    seq.unsent_texts.append(text)  # no output object for this token
                    if sampled_token is not None:
                        seq.unsent_logprobs.append(self._token_logprob(sampled_token))
                    continue
            token_logprobs = None if sampled_token is None else [self._token_logprob(sampled_token)]
            new_token_ids = None
            if seq.unsent_texts:  # a stream_interval held tokens back: they go out with it
                text, new_token_ids, token_logprobs = seq.take_unsent(text, 1, token_logprobs)
            done = reason is not None
            # Positional: keyword arguments make this dataclass' __init__ three times
            # slower, and this runs once per sequence per step.
            outputs.append(
                GenerationOutput(
                    seq.request_id,
                    text,
                    new_token_ids or [token_id],
                    seq.num_prompt_tokens,
                    num_output,
                    done,
                    reason,
                    token_logprobs,
                    seq.prompt_token_ids if num_output == 1 else None,
                    seq.num_cached_tokens if num_output == 1 else None,
                    seq.prompt_logprobs if num_output == 1 else None,
                )
            )
            if done:
                self._finish(seq, reason)
        if covered:
            held_steps.reopen(full_rows)
        elif self._may_hold(step):
            held_steps.start(step)
        self.scheduler.tokens_sampled(step, token_ids)
        profile.wait += received - started
        profile.outputs += perf_counter() - received
        return outputs

    def _may_hold(self, step: ScheduledStep) -> bool:
        """Whether the repeats of ``step`` may keep their held tokens by step
        (``HeldSteps``): nothing reads a sequence between steps (no proposals, no sampling
        that reads a request's tokens: penalties, min_tokens, a grammar), and most rows
        hold their tokens (a stream_interval)."""
        return (
            self.speculator is None
            and not self._num_needing_host_tokens
            and not self._num_min_tokens
            and self._num_texts > 0
            and self._num_streamed * 2 <= len(step.seqs)
            and self.scheduler.may_repeat(step)
        )

    def _advance_grammar(self, seq: Sequence, token_id: int, reason: str | None) -> str | None:
        """Feed the new token to the sequence's matcher. A grammar that is complete ends
        the request (``stop``) even where EOS would not (``ignore_eos``): nothing more may
        follow it."""
        if not seq.grammar.accept(token_id):
            # The mask allowed only grammatical tokens, so only a row whose every token
            # was forbidden (min_tokens holding back the one stop token) lands here.
            return reason or "stop"
        if reason is None and seq.grammar.finished:
            return "stop"
        return reason

    def _process_verified(self, step: ScheduledStep) -> list[GenerationOutput]:
        """Append each verified sequence's tokens up to the first that ends it (stop ids
        and strings, max_tokens: never past it), and roll back the K/V of the rest."""
        outputs = []
        for index, (tokens, logprobs) in step.verified.items():
            seq = step.seqs[index]
            seq.proposal = []
            if seq.status is SequenceStatus.FINISHED:  # aborted while this step ran
                continue
            if seq.num_held_tokens:
                seq.release_held()
            seq.hold_below = 0  # its tokens go through the detokenizer, which may leave
            # the text not plain: the next token takes the full checks, which say again
            num_prompt = len(seq.prompt_token_ids)
            reason = None
            taken = 0
            for token_id in tokens:
                seq.token_ids.append(token_id)
                taken += 1
                num_output = len(seq.token_ids) - num_prompt
                reason = finish_reason(
                    token_id, num_output, seq.sampling, seq.stop_token_ids, seq.detokenizer
                )
                if reason is not None:
                    break
            done = reason is not None
            if not done:
                # The K/V up to the last accepted proposal stay; the bonus token is fed next.
                self.scheduler.rollback(seq, len(seq.token_ids) - 1)
                if self.block_manager.enable_prefix_caching:
                    self.block_manager.cache_full_blocks(seq)
            wanted = [self._token_logprob(lp) for lp in logprobs[:taken] if lp is not None]
            text, new_token_ids = seq.detokenizer.take_new_text(done), tokens[:taken]
            if seq.unsent_texts:  # a verification step always hands its tokens out
                text, new_token_ids, wanted = seq.take_unsent(text, taken, wanted)
            outputs.append(
                GenerationOutput(
                    seq.request_id,
                    text,
                    new_token_ids,
                    num_prompt,
                    num_output,
                    done,
                    reason,
                    wanted or None,
                    seq.prompt_token_ids if num_output == taken else None,
                )
            )
            if done:
                self._finish(seq, reason)
        return outputs

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if seq.lora is not None:
            self.loras.finish_request(seq.lora)
        del self._seqs[seq.request_id]
        self._num_needing_host_tokens -= seq.needs_host_tokens
        self._num_not_plain_greedy -= not seq.plain_greedy
        self._num_streamed -= seq.stream_interval == 1
        self._num_min_tokens -= bool(seq.sampling.min_tokens)
        self._num_constrained -= seq.grammar is not None

    def _token_logprob(self, sampled: SampledToken) -> TokenLogprob:
        text = self.tokenizer.token_text
        return TokenLogprob(
            token_id=sampled.token_id,
            token=text(sampled.token_id),
            logprob=sampled.logprob,
            top=[(token_id, text(token_id), logprob) for token_id, logprob in sampled.top],
        )
