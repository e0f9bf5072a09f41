"""``TransformersEngine``: the ``Engine`` surface (llmctl/backend.py) over transformers'
continuous-batching manager.

transformers does the model's work in a thread of its own (``ContinuousBatchingManager``):
scheduling, the forward pass over its paged KV cache, and sampling. llmctl does what makes
every backend answer alike: tokenizer and chat template, request validation, incremental
detokenization, stop strings and stop tokens, token counts.

One router thread reads transformers' streamed outputs (each one a snapshot of a request's
tokens so far), turns the new tokens into ``GenerationOutput`` deltas and hands them to the
event loop of the request's ``generate`` call, as ``AsyncEngine`` does for the native
engines; so any event loop may use the engine.
"""

from __future__ import annotations

import logging
import queue
import threading
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from transformers.generation.continuous_batching.utils import (
    find_head_dim,
    find_num_key_value_heads,
)

from llmctl.backend import (
    EngineStats,
    GenerationOutput,
    Hardware,
    ModelInfo,
)
from llmctl.engine.assemble import free_memory_bytes
from llmctl.engine.kv_cache import KVPlan, plan_kv_cache
from llmctl.errors import InvalidRequest, OptionError
from llmctl.kv_budget import format_bytes
from llmctl.model.gguf import transformers_source
from llmctl.model.tokenizer import Tokenizer
from llmctl_transformers.config import TransformersConfig
from llmctl_transformers.requests import RequestEngine, RequestState
from llmctl_transformers.sampling import ENGINE_SAMPLING, processor_kwargs

# transformers' continuous-batching logger, by its name: the module holding it moved
# between releases (requests.py in 5.18, utils.py later).
CB_LOGGER = logging.getLogger("ContinuousBatchingLogger")

logger = logging.getLogger("llmctl")

# How long the router waits for transformers' next output before checking its thread.
POLL_S = 0.1
SELF_TEST_ID = "llmctl-self-test"


def create_transformers_engine(
    model: ModelInfo, config: TransformersConfig, hardware: Hardware
) -> TransformersEngine:
    """Load ``model`` with transformers, size its paged cache as llmctl's budget says,
    start the continuous-batching manager and check that it can run this architecture."""
    device = torch.device(hardware.device_for(config.device))
    if config.cpu_threads and device.type == "cpu":
        torch.set_num_threads(config.cpu_threads)
    # transformers' tqdm bar ("Loading weights") would cut through llmctl's rich output.
    transformers.utils.logging.disable_progress_bar()
    source, gguf = transformers_source(model.path)  # a GGUF: transformers dequantizes it
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        source, dtype=_torch_dtype(config.dtype, device), **gguf
    )
    loaded = loaded.to(device).eval()
    text_config = loaded.config.get_text_config()
    max_model_len = _session_len(text_config, config.max_model_len)
    tokenizer = Tokenizer.from_dir(model.path, chat_template=config.chat_template)
    bytes_per_block = _kv_bytes_per_block(text_config, loaded.dtype, config.page_size)
    plan = plan_kv_cache(
        config.kv_budget,
        bytes_per_block=bytes_per_block,
        free_bytes=free_memory_bytes(device),
        block_size=config.page_size,
        max_num_seqs=config.max_requests_per_batch,
        max_model_len=max_model_len,
    )
    logger.info("KV cache: %s", plan.describe())
    manager = _start_manager(loaded, config, plan, tokenizer.eos_token_ids)
    if (problem := _probe_continuous_batching(manager)) is not None:
        from llmctl_transformers.plain_generate import PlainGenerateEngine

        logger.warning(
            "transformers %s cannot run %s with continuous batching (%s): serving it "
            "through plain generate with dynamic batches instead (slower)",
            transformers.__version__,
            model.architecture,
            problem,
        )
        return PlainGenerateEngine(
            loaded,
            tokenizer,
            model_name=config.served_model_name or model.name,
            max_model_len=max_model_len,
            vocab_size=text_config.vocab_size,
            max_batch=config.max_requests_per_batch,
            seed=config.seed,
        )
    _log_what_transformers_chose(manager, config, model.architecture)
    return TransformersEngine(
        manager,
        tokenizer,
        model_name=config.served_model_name or model.name,
        max_model_len=max_model_len,
        vocab_size=text_config.vocab_size,
        page_size=config.page_size,
        bytes_per_block=bytes_per_block,
    )


def _start_manager(
    loaded: Any, config: TransformersConfig, plan: KVPlan, eos_token_ids: tuple[int, ...]
) -> Any:
    """transformers' continuous-batching manager for ``loaded``, its cache built, running."""
    cb_config = transformers.ContinuousBatchingConfig(
        page_size=config.page_size,
        num_blocks=plan.num_blocks,
        max_batch_tokens=config.max_batch_tokens,
        max_requests_per_batch=config.max_requests_per_batch,
        # transformers checks its whole footprint (cache, batch buffers) against this
        # share of free memory; None: its own default (0.6 on CPU, 0.8-0.9 on GPU).
        max_memory_percent=config.max_memory_percent,
        allow_block_sharing=config.allow_block_sharing,
        use_cuda_graph=config.use_cuda_graph,
        per_request_processors=True,
        seed=config.seed,
    )
    generation_config = transformers.GenerationConfig(
        **ENGINE_SAMPLING, eos_token_id=list(eos_token_ids) or -1
    )
    manager = loaded.init_continuous_batching(
        generation_config=generation_config, continuous_batching_config=cb_config
    )
    try:
        manager.warmup()  # builds the cache here, so a footprint that does not fit fails now
    except MemoryError as exc:
        raise OptionError(
            f"transformers cannot fit its paged cache ({plan.describe()}) and its batch "
            f"buffers for max_prefill_token_num={config.max_batch_tokens}: {exc}. Lower "
            "cache_max_entry_count or max_prefill_token_num"
        ) from None
    manager.start()
    return manager


def _log_what_transformers_chose(manager: Any, config: TransformersConfig, architecture: str):
    """Say what transformers decided that costs memory or speed: attention masks (eager and
    SDPA attention need them), and prefix caching it cannot do for this model."""
    processor = manager.batch_processor
    if masks := getattr(processor.inputs_and_outputs, "attention_mask", None):
        logger.info(
            "attention masks (%s attention; flash attention needs none): %s, "
            "max_prefill_token_num x (cache tokens + max_prefill_token_num)",
            manager.model.config._attn_implementation,
            format_bytes(sum(mask.numel() * mask.element_size() for mask in masks.values())),
        )
    if config.allow_block_sharing and not processor.cache.use_prefix_sharing:
        logger.warning(
            "enable_prefix_caching is on, but transformers shares no KV blocks for %s "
            "(some of its attention layers cannot): prompts are computed in full",
            architecture,
        )


class TransformersEngine(RequestEngine):
    def __init__(
        self,
        manager: Any,  # transformers' ContinuousBatchingManager, started
        tokenizer: Tokenizer,
        *,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        page_size: int,
        bytes_per_block: int,
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.manager = manager
        self._processor = manager.batch_processor  # its scheduler and cache, for stats()
        self.num_blocks = self._processor.cache.num_blocks
        self.block_size = page_size  # transformers' page is llmctl's KV block
        self.vocab_size = vocab_size
        self._bytes_per_block = bytes_per_block
        self._lock = threading.Lock()  # guards _requests and _stopping
        self._requests: dict[str, RequestState] = {}
        self._stopping = False
        self._router = threading.Thread(
            target=self._route, name="llmctl-transformers-router", daemon=True
        )
        self._router.start()

    def is_alive(self) -> bool:
        """transformers' generation thread and the router still run (else /health is 503)."""
        return self.manager.is_running() and self._router.is_alive() and not self._stopping

    def stats(self) -> EngineStats:
        scheduler = self._processor.scheduler
        return EngineStats(
            running=len(scheduler.active_requests),
            waiting=len(scheduler.waiting_requests) + self.manager.input_queue.qsize(),
            kv_blocks_total=self.num_blocks,
            kv_blocks_used=self._blocks_in_use(),
            block_size=self.block_size,
        )

    async def shutdown(self) -> None:
        """Stop transformers' thread and the router; requests in flight end with ``abort``."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            in_flight = list(self._requests)
        for request_id in in_flight:
            self._abort(request_id)
        # Called on this loop, not asyncio.to_thread: the API's finalizer runs this at
        # interpreter exit, when Python's thread pools refuse work (see ``joined``).
        self._stop_threads()

    # -- the caller's side --------------------------------------------------------------

    def _submit(self, state: RequestState) -> None:
        """Register ``state`` and hand its request to transformers."""
        sampling = state.sampling
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine has been shut down")
            if state.request_id in self._requests:
                raise InvalidRequest(f"request id {state.request_id!r} is already in use")
            self._requests[state.request_id] = state
        try:
            accepted = self.manager.add_request(
                state.prompt_token_ids,
                request_id=state.request_id,
                max_new_tokens=sampling.max_tokens,
                streaming=True,
                # transformers stops a request on these, which frees its pages at once;
                # llmctl decides the finish reason from the same tokens.
                eos_token_id=sorted(state.stop_ids),
                **processor_kwargs(sampling, self.vocab_size),
            )
            if accepted is None:  # transformers is stopping and takes no new requests
                raise RuntimeError("the transformers engine is stopping: it takes no requests")
        except BaseException:
            with self._lock:
                self._requests.pop(state.request_id, None)
            raise

    def _abort(self, request_id: str) -> None:
        """End a request here with ``abort`` and cancel it in transformers."""
        with self._lock:
            state = self._requests.pop(request_id, None)
            if state is None:
                return
            self._deliver(state, state.aborted())
        self.manager.cancel_request(request_id)  # frees its pages at transformers' next step

    # -- the router thread ----------------------------------------------------------------

    def _route(self) -> None:
        """Turn transformers' outputs into llmctl's until its generation thread ends."""
        exiting = False
        while True:
            result = self.manager.get_result(timeout=POLL_S)
            if result is not None:
                self._on_result(result)
            elif not self.manager.is_running():
                break
            elif not exiting and not threading.main_thread().is_alive():
                # The program ends without shutdown(): transformers' thread is no daemon
                # and would keep the process alive for ever, so stop it.
                exiting = True
                self.manager.stop(block=False, hard_stop=True)
        for result in _drain(self.manager.output_router.output_queue):
            self._on_result(result)
        why = self.manager.background_thread_status.fatal_error or "it was stopped"
        with self._lock:
            orphans, self._requests = list(self._requests.values()), {}
            for state in orphans:
                self._deliver(state, RuntimeError(f"the transformers engine stopped: {why}"))

    def _on_result(self, result: Any) -> None:
        """One transformers output: a snapshot of a request's generated tokens."""
        with self._lock:
            state = self._requests.get(result.request_id)
            if state is None:  # aborted, or already finished here
                return
            if result.error is not None:
                del self._requests[result.request_id]
                error = RuntimeError(f"transformers failed this request: {result.error}")
                self._deliver(state, error)
                return
            for token_id in result.generated_tokens[state.num_output_tokens :]:
                output = state.advance(token_id)
                self._deliver(state, output)
                if output.finished:
                    del self._requests[result.request_id]
                    break
            else:
                if result.is_finished():  # transformers reached a limit it was given first
                    del self._requests[result.request_id]
                    reason = (
                        "length" if state.num_output_tokens >= state.sampling.max_tokens else "stop"
                    )
                    self._deliver(state, state.ended(reason))
                return
        if not result.is_finished():  # a stop string ended it here: stop transformers too
            self.manager.cancel_request(result.request_id)

    @staticmethod
    def _deliver(state: RequestState, item: GenerationOutput | BaseException) -> None:
        try:
            state.loop.call_soon_threadsafe(state.outputs.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass

    def _stop_threads(self) -> None:
        # At interpreter exit transformers' loop has already ended by itself (it watches
        # the main thread), and stopping it again only logs a warning.
        if self.manager.is_running():
            self.manager.stop(block=True, hard_stop=True)
        self._router.join()
        self.manager.destroy()

    def _blocks_in_use(self) -> int:
        """KV blocks (of page_size tokens for every layer) that requests hold now; blocks
        kept only as prefix cache count as free, as in llmctl's own block manager."""
        held_bytes = 0
        for allocator in self._processor.cache.cache_allocators.values():
            tables = list(allocator.block_table.values())  # one atomic copy: another thread writes
            held = {block for table in tables for block in table}
            held_bytes += len(held) * allocator.bytes_per_block
        return -(-held_bytes // self._bytes_per_block)


def _probe_continuous_batching(manager: Any) -> str | None:
    """Generate one token before serving: some architectures cannot run transformers'
    continuous batching (GPT-NeoX in 5.24). That is found here, never at a user's request;
    the error (``None``: it runs), with the manager stopped."""
    with _quiet(CB_LOGGER):
        manager.add_request([0], request_id=SELF_TEST_ID, max_new_tokens=1, eos_token_id=[])
        while (result := manager.get_result(timeout=POLL_S)) is None:
            if not manager.is_running():
                break
    error = result.error if result is not None else manager.background_thread_status.fatal_error
    if error is None:
        return None
    manager.stop(block=True, hard_stop=True)
    manager.destroy()  # its cache and buffers: the plain generate path needs none of them
    return str(error)


@contextmanager
def _quiet(log: logging.Logger):
    """Silence ``log`` inside the block (its tracebacks would repeat our own error)."""
    level = log.level
    log.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        log.setLevel(level)


def _drain(items: queue.Queue) -> list[Any]:
    drained = []
    while True:
        try:
            drained.append(items.get_nowait())
        except queue.Empty:
            return drained


def _torch_dtype(requested: str, device: torch.device) -> torch.dtype | str:
    """``auto``: float32 on CPU (half precision is slow there), the checkpoint's on GPU."""
    if requested == "auto":
        return torch.float32 if device.type == "cpu" else "auto"
    return getattr(torch, requested)


def _session_len(text_config: Any, requested: int | None) -> int:
    """The longest prompt + output: the model's context, or less if asked."""
    limit = getattr(text_config, "max_position_embeddings", None)
    if requested is None:
        if limit is None:
            raise OptionError(
                "this model's config does not state its context length "
                "(max_position_embeddings): set session_len"
            )
        return limit
    if limit is not None and requested > limit:
        raise OptionError(
            f"session_len {requested} exceeds the model's max_position_embeddings ({limit}); "
            f"use session_len <= {limit}"
        )
    return requested


def _kv_bytes_per_block(text_config: Any, dtype: torch.dtype, page_size: int) -> int:
    """K and V of ``page_size`` tokens for every layer, as transformers sizes its blocks."""
    per_token = 2 * find_num_key_value_heads(text_config) * find_head_dim(text_config)
    return text_config.num_hidden_layers * per_token * dtype.itemsize * page_size
