"""One request as the engine tracks it: its tokens, its KV blocks and where it stands."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from llmctl.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from llmctl.engine.detokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request's token stream and bookkeeping.

    ``token_ids`` is prompt + generated tokens. ``num_computed_tokens`` of them have
    their K/V in the cache; the rest are fed to the model by the next steps (a prefill
    chunk, or the one token sampled last). ``block_table[i]`` is the physical block
    holding tokens ``i * block_size .. (i + 1) * block_size - 1``. ``block_hashes`` are
    the prefix-cache keys of the leading full, computed blocks.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        detokenizer: IncrementalDetokenizer | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.finish_reason: str | None = None
        self.detokenizer = detokenizer
        # A seeded request's own random stream, created by the sampler on first use.
        self.generator: torch.Generator | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
