"""``LoraSlots``: which adapter sits in which of the runner's slots, least recently used
out first, and what unloading an adapter in use waits for."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.engine.lora import NO_SLOT, LoraSlots
from llmctl.engine.sampling_params import SamplingParams
from llmctl.engine.sequence import Sequence
from llmctl.errors import InvalidRequest
from llmctl.model.lora import AdapterSpec, LoraNameError


class SlotRecorder:
    """A runner's slots as a list: what ``load_lora_slot`` put where."""

    serves_lora = True

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = 8
        self.slots: list[str | None] = [None] * max_loras

    def read_lora(self, spec: AdapterSpec) -> str:
        return spec.path.name

    def load_lora_slot(self, slot: int, weights: str) -> None:
        self.slots[slot] = weights


def registered(names: list[str], max_loras: int) -> tuple[LoraSlots, SlotRecorder]:
    runner = SlotRecorder(max_loras)
    loras = LoraSlots(runner)
    for name in names:
        spec = AdapterSpec(Path(name), 4, 8.0, False, {})
        loras.register(name, spec, runner.read_lora(spec))
    return loras, runner


def sequence(loras: LoraSlots, name: str) -> Sequence:
    seq = Sequence(name, [1, 2], SamplingParams())
    seq.lora = loras.get(name)
    loras.add_request(seq.lora)
    return seq


def test_least_recently_used_adapter_leaves_its_slot_first():
    loras, runner = registered(["a", "b", "c"], max_loras=2)
    a, b = sequence(loras, "a"), sequence(loras, "b")
    loras.start(a)
    loras.start(b)
    assert runner.slots == ["a", "b"] and (a.lora_slot, b.lora_slot) == (0, 1)
    c = sequence(loras, "c")
    assert not loras.can_run(c.lora)  # both slots hold running adapters
    loras.stop(b)
    loras.stop(a)  # a used last: b goes first
    loras.start(c)
    assert runner.slots == ["a", "c"] and c.lora_slot == 1 and b.lora.slot is None
    again = sequence(loras, "a")
    loras.start(again)  # resident: no load
    assert loras.num_loads == 3 and again.lora_slot == 0
    loras.stop(c)
    loras.stop(again)
    assert a.lora_slot == NO_SLOT


def test_unloading_waits_for_the_adapters_requests():
    loras, runner = registered(["a"], max_loras=1)
    seq = sequence(loras, "a")
    loras.start(seq)
    freed = []
    loras.retire("a", on_freed=lambda: freed.append(True))
    assert loras.names == () and not freed  # retired at once, freed later
    with pytest.raises(InvalidRequest, match="'a' is not loaded"):
        loras.get("a")
    loras.stop(seq)
    loras.finish_request(seq.lora)
    assert freed == [True] and seq.lora.weights is None
    with pytest.raises(KeyError):
        loras.retire("a", on_freed=lambda: None)
    with pytest.raises(LoraNameError, match="already loaded"):
        registered(["a", "a"], max_loras=1)
