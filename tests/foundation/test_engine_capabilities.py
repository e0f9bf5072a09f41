"""Engine capabilities: declared once as class attributes, read through ``capabilities``."""

from __future__ import annotations

import pytest

from llmctl.backend import Engine, EngineCapabilities, EngineStats, capabilities


class ProtocolOnlyEngine:
    """A third-party engine written to the ``Engine`` protocol alone."""

    model_name = "plain"
    max_model_len = 0

    async def generate(self, request):
        yield None

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats:
        return EngineStats()

    async def shutdown(self) -> None: ...


def test_an_engine_written_to_the_protocol_offers_nothing_beyond_it():
    engine = ProtocolOnlyEngine()
    assert isinstance(engine, Engine)
    offers = capabilities(engine)
    assert not offers.can_generate_all and not offers.has_step_loop
    assert offers.is_alive() and offers.has_chat_template
    assert offers.vocab_size == 0 and offers.failure is None
    with pytest.raises(NotImplementedError, match="can_generate_all"):
        offers.generate_all([])


def test_the_local_engines_declare_what_they_offer():
    from llmctl_transformers.engine import TransformersEngine

    from llmctl.engine.async_engine import AsyncEngine

    assert AsyncEngine.can_generate_all and AsyncEngine.has_step_loop
    assert issubclass(TransformersEngine, EngineCapabilities)
    assert not TransformersEngine.can_generate_all
