"""LoRA adapters in the shared engine: registered by name, resident in slots, one per request.

An adapter is registered under a name (the API's model id) with its checked spec
(``llmctl.model.lora``) and its weights in host memory, as the runner read them. A
runner that serves adapters has ``max_loras`` slots on its device; ``LoraSlots`` decides
which adapter sits in which: an adapter is put in a slot when a sequence using it starts
running (admission), and stays there while any running sequence uses it. A free slot
is taken first, else the one whose adapter went unused longest (least recently used);
the runner copies the weights in (``load_lora_slot``). So at most ``max_loras``
adapters run at once: the scheduler admits a sequence only when its adapter is resident
or a slot can be had (``can_run``), and the others wait.

Each step row carries its sequence's slot (``StepBatch.lora_slots``, -1 for the base
model); the prefix cache keys a sequence's blocks from its adapter's ``cache_salt``, so
KV computed under one adapter is never reused under another. The block size has nothing
to do with any of this.

Unloading retires the name at once (new requests get "unknown model"); the requests
already using the adapter finish with it, then its slot and memory are freed and the
callbacks passed to ``retire`` run (the server answers the unload then).

Every backend that applies adapters shares the pieces at the end: the fused module and
part each HF module maps to (``FUSED_PARTS``), how an adapter is read into host memory
(``read_lora_weights``) and how a step's tokens are grouped by slot into tiles
(``slot_tiles``, the segments of punica's SGMV).

Everything here runs on the engine thread, except ``names`` (a copy, read anywhere).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from llmctl.errors import InvalidRequest, ModelError
from llmctl.model.lora import AdapterSpec, LoraNameError, read_adapter

if TYPE_CHECKING:
    import torch

    from llmctl.engine.sequence import Sequence

NO_SLOT = -1  # a row without an adapter: the base model alone
_ids = itertools.count(1)  # one per registration, so a name loaded again keys afresh


class LoraRunner(Protocol):
    """What a runner that serves adapters (``serves_lora`` true) offers the engine."""

    serves_lora: bool
    max_loras: int
    max_lora_rank: int
    base_config: Any  # the ModelConfig an adapter must fit: the whole model's, not a shard's

    def read_lora(self, spec: AdapterSpec) -> Any:
        """The adapter's weights in host memory, ready to copy into a slot (may run on
        any thread: it only reads files)."""
        ...

    def allocate_lora_slots(self) -> None:
        """Allocate the ``max_loras`` slots of rank ``max_lora_rank`` (once; later calls do
        nothing). The engine calls it before it sizes the KV cache when adapters are
        served from the start, so the cache leaves them their memory; else the first
        ``load_lora_slot`` does."""
        ...

    def load_lora_slot(self, slot: int, weights: Any) -> None:
        """Put ``weights`` (from ``read_lora``) in ``slot``, replacing what was there. The
        copy is ordered after the steps already launched (they may still read the old)."""
        ...


class LoraAdapter:
    """One registered adapter and how it is used right now."""

    __slots__ = ("name", "spec", "weights", "id", "num_requests", "num_running", "slot")

    def __init__(self, name: str, spec: AdapterSpec, weights: Any) -> None:
        self.name = name
        self.spec = spec
        self.weights = weights  # the runner's, in host memory
        self.id = next(_ids)
        self.num_requests = 0  # in flight (waiting or running)
        self.num_running = 0  # admitted: they need the adapter in a slot
        self.slot: int | None = None

    @property
    def cache_salt(self) -> bytes:
        """The start of the prefix-cache key chain of this adapter's sequences."""
        return b"lora:%d" % self.id


def read_lora(runner: LoraRunner, path: str, config: Any) -> tuple[AdapterSpec, Any]:
    """Check the adapter at ``path`` against the base model ``config`` (a ``ModelConfig``)
    and the runner's largest rank, and read its weights (off the engine thread)."""
    spec = read_adapter(path, config, runner.max_lora_rank)
    return spec, runner.read_lora(spec)


class LoraSlots:
    """The registered adapters and the runner's slots (see the module doc)."""

    def __init__(self, runner: LoraRunner) -> None:
        self.runner = runner
        self._adapters: dict[str, LoraAdapter] = {}
        self._slots: list[LoraAdapter | None] = [None] * runner.max_loras
        # Slots no running sequence needs, the first to be taken first: empty ones, then
        # by how long ago their adapter was last used.
        self._idle: OrderedDict[int, None] = OrderedDict.fromkeys(range(runner.max_loras))
        self._retired: dict[int, tuple[LoraAdapter, list[Callable[[], None]]]] = {}
        self.names: tuple[str, ...] = ()  # registered names, for any thread to read
        self.num_loads = 0  # slot loads (swaps in) since the start

    # --- registration -----------------------------------------------------------------

    def register(self, name: str, spec: AdapterSpec, weights: Any) -> LoraAdapter:
        if name in self._adapters:
            raise LoraNameError(
                f"LoRA adapter name {name!r} is already loaded: unload it first, or choose "
                "another name"
            )
        adapter = self._adapters[name] = LoraAdapter(name, spec, weights)
        self.names = tuple(self._adapters)
        return adapter

    def retire(self, name: str, on_freed: Callable[[], None]) -> None:
        """Unload ``name``: no new request gets it; ``on_freed`` runs once the requests
        using it have finished and its memory is freed (at once if none uses it)."""
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise KeyError(name)
        self.names = tuple(self._adapters)
        self._retired[adapter.id] = (adapter, [on_freed])
        self._free_if_done(adapter)

    def get(self, name: str) -> LoraAdapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            raise InvalidRequest(
                f"the LoRA adapter {name!r} is not loaded here (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return adapter

    # --- requests -----------------------------------------------------------------------

    def add_request(self, adapter: LoraAdapter) -> None:
        adapter.num_requests += 1

    def finish_request(self, adapter: LoraAdapter) -> None:
        adapter.num_requests -= 1
        self._free_if_done(adapter)

    def can_run(self, adapter: LoraAdapter) -> bool:
        """Whether a sequence of ``adapter`` could start running now."""
        return adapter.slot is not None or bool(self._idle)

    def start(self, seq: Sequence) -> None:
        """``seq`` starts running: its adapter in a slot (swapped in if need be)."""
        adapter = seq.lora
        if adapter.slot is None:
            slot, _ = self._idle.popitem(last=False)
            evicted = self._slots[slot]
            if evicted is not None:
                evicted.slot = None
            self.runner.load_lora_slot(slot, adapter.weights)
            self.num_loads += 1
            self._slots[slot] = adapter
            adapter.slot = slot
        elif adapter.num_running == 0:
            del self._idle[adapter.slot]
        adapter.num_running += 1
        seq.lora_slot = adapter.slot

    def stop(self, seq: Sequence) -> None:
        """``seq`` stops running (finished or preempted)."""
        adapter = seq.lora
        adapter.num_running -= 1
        seq.lora_slot = NO_SLOT
        if adapter.num_running == 0:
            self._idle[adapter.slot] = None  # the most recently used of the idle slots

    def _free_if_done(self, adapter: LoraAdapter) -> None:
        retired = self._retired.get(adapter.id)
        if retired is None or adapter.num_requests:
            return
        del self._retired[adapter.id]
        if adapter.slot is not None:  # empty now: taken before any other idle slot
            self._slots[adapter.slot] = None
            self._idle.move_to_end(adapter.slot, last=False)
            adapter.slot = None
        adapter.weights = None
        for callback in retired[1]:
            callback()


# --- shared by the backends' kernels -----------------------------------------------------

# HF module (within a decoder layer) -> (the fused module the backends run, its part):
# q/k/v are one matrix, gate/up another, so one layer holds several adapted parts.
FUSED_PARTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
}

# An adapter in host memory: HF module name -> (A [r, in], B * scale [out, r]).
LoraWeights = dict[str, tuple["torch.Tensor", "torch.Tensor"]]


def read_lora_weights(spec: AdapterSpec, dtype: torch.dtype, pin: bool) -> LoraWeights:
    """The adapter's A and scaled B per module, in ``dtype`` (scaled in fp32 first);
    ``pin``: in pinned memory, so a copy into a CUDA slot is asynchronous."""
    from safetensors import safe_open

    weights: LoraWeights = {}
    try:
        with safe_open(str(spec.weights_file), framework="pt") as file:
            for module, (a_name, b_name) in spec.modules.items():
                a = file.get_tensor(a_name).to(dtype)
                b = (file.get_tensor(b_name).float() * spec.scale).to(dtype)
                if pin:
                    a, b = a.pin_memory(), b.pin_memory()
                weights[module] = (a, b)
    except (OSError, RuntimeError, ValueError) as exc:  # safetensors' own errors
        raise ModelError(
            f"LoRA adapter {spec.path}: cannot read {spec.weights_file}: {exc}"
        ) from None
    return weights


def slot_tiles(
    lora_slots: np.ndarray, query_lens: np.ndarray, tile_rows: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """The step's tokens with an adapter, sorted by slot (``order``: token indices), and
    ``tiles [3, n]``: each tile's slot and its range ``[start, end)`` of ``order``, at
    most ``tile_rows`` tokens of one slot, so a kernel reads a slot's A and B once per
    tile. ``lora_slots`` is per sequence (-1: none). ``None`` when no token has one."""
    token_slots = np.repeat(np.asarray(lora_slots, dtype=np.int64), query_lens)
    adapted = np.flatnonzero(token_slots != NO_SLOT)
    if len(adapted) == 0:
        return None
    order = adapted[np.argsort(token_slots[adapted], kind="stable")]
    slots = token_slots[order]
    starts = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]])
    ends = np.r_[starts[1:], len(order)]
    counts = -(-(ends - starts) // tile_rows)
    first = np.repeat(starts, counts)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    tile_start = first + within * tile_rows
    tiles = np.stack([np.repeat(slots[starts], counts), tile_start, np.repeat(ends, counts)])
    tiles[2] = np.minimum(tiles[2], tile_start + tile_rows)
    return order, tiles
