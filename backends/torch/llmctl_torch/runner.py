"""TorchModelRunner: the torch backend's ``ModelRunner`` for the shared engine.

It loads the model, owns the paged KV cache, and runs one scheduler step: the step's
lists become tensors once, the model writes the new tokens' K/V and returns the logits
of each sequence's last new token.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from llmctl.engine.model_config import ModelConfig
from llmctl.engine.runner import IntArray, PagedRunner, StepBatch
from llmctl.engine.transfer import to_device
from llmctl.engine.weights import load_weights
from llmctl_torch.attention import attention_ops
from llmctl_torch.lora import apply_lora_adapters
from llmctl_torch.model import AttentionMetadata, build_model


class TorchModelRunner(PagedRunner):
    """Runs a Llama-family model over a paged KV cache of ``num_blocks`` blocks.

    ``num_blocks`` may be left out and given later through ``allocate_kv_cache`` (the
    engine sizes the cache from the memory free once the weights are loaded).
    """

    def __init__(
        self,
        model_dir: str | Path,
        config: ModelConfig,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        block_size: int = 64,
        num_blocks: int | None = None,
        adapters: Sequence[str | Path] = (),
    ) -> None:
        super().__init__(config, dtype=dtype, device=device, block_size=block_size)
        self.ops = attention_ops(self.device)
        weights = load_weights(model_dir, self.dtype, self.device)
        apply_lora_adapters(weights, adapters)
        self.model = build_model(weights, config, self.device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)

    def _allocate(self, num_blocks: int) -> None:
        """One ``[2, layers, num_blocks, block_size, kv_heads, head_dim]`` tensor, viewed
        as a (K, V) pair per layer. Zeroed, not empty: attention masks unwritten slots
        with a zero weight, and 0 * NaN from uninitialised memory would still be NaN."""
        c = self.config
        cache = torch.zeros(
            (2, c.num_layers, num_blocks, self.block_size, c.num_kv_heads, c.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_caches = [(cache[0, layer], cache[1, layer]) for layer in range(c.num_layers)]

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's K/V and return fp32 logits ``[num_seqs, vocab]`` of the last new
        token of each sequence."""
        self.check_allocated()
        query_start_loc = np.zeros(batch.num_seqs + 1, dtype=np.int64)
        np.cumsum(batch.query_lens, out=query_start_loc[1:])
        to_device = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to_device(batch.slot_mapping, torch.int64),
            block_tables=to_device(batch.block_table_array(), torch.int32),
            context_lens=to_device(batch.context_lens, torch.int32),
            query_start_loc=to_device(query_start_loc, torch.int32),
            is_decode=int(np.max(batch.query_lens)) == 1,
        )
        logits_indices = to_device(query_start_loc[1:] - 1, torch.int64)
        input_ids = to_device(batch.input_ids, torch.int64)
        batch.fill_sampled_tokens(input_ids)
        return self.model(
            input_ids,
            to_device(batch.positions, torch.int64),
            meta,
            self.kv_caches,
            logits_indices,
            self.ops,
        )

    def _to_device(self, values: IntArray, dtype: torch.dtype) -> torch.Tensor:
        return to_device(np.asarray(values), dtype, self.device)
