"""TorchModelRunner: the torch backend's ``ModelRunner`` for the shared engine.

It loads the model, owns the paged KV cache, and runs one scheduler step: the step's
lists become tensors once, the model writes the new tokens' K/V and returns the logits
of each sequence's last new token.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path

import torch

from llmctl.engine.model_config import ModelConfig
from llmctl.engine.quant import SCALE_DTYPE, is_quantized_kv
from llmctl.engine.runner import PagedRunner, StepBatch
from llmctl.engine.weights import load_weights
from llmctl_torch.attention import LayerCache, attention_ops
from llmctl_torch.linear import quantize_linears
from llmctl_torch.lora import apply_lora_adapters
from llmctl_torch.model import AttentionMetadata, build_model


class TorchModelRunner(PagedRunner):
    """Runs a Llama-family model over a paged KV cache of ``num_blocks`` blocks.

    ``num_blocks`` may be left out and given later through ``allocate_kv_cache`` (the
    engine sizes the cache from the memory free once the weights are loaded).
    ``quantization`` (``none`` or ``int8``) converts the linear layers' weights once
    loaded; ``kv_cache_dtype`` (``auto``, ``int8``, ``fp8``) is the cache's element type.
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
        quantization: str = "none",
        kv_cache_dtype: str = "auto",
    ) -> None:
        super().__init__(
            config,
            dtype=dtype,
            device=device,
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.ops = attention_ops(self.device)
        weights = load_weights(model_dir, self.dtype, self.device)
        apply_lora_adapters(weights, adapters)
        self.model = build_model(weights, config, self.device)
        quantize_linears(self.model, quantization)
        self.kv_caches: list[LayerCache] = []
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)

    def _allocate(self, num_blocks: int) -> None:
        """One ``[2, layers, num_blocks, block_size, kv_heads, head_dim]`` tensor, viewed
        as a (K, V) pair per layer; an int8 / fp8 cache has a float32 scale per token and
        KV head beside it, ``[2, layers, num_blocks, block_size, kv_heads]``. Zeroed, not
        empty: attention masks unwritten slots with a zero weight, and 0 * NaN from
        uninitialised memory would still be NaN."""
        c = self.config
        shape = (2, c.num_layers, num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        scales = None
        if is_quantized_kv(self.kv_dtype):
            scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=self.device)
        self.kv_caches = [
            LayerCache(
                cache[0, layer],
                cache[1, layer],
                None if scales is None else (scales[0, layer], scales[1, layer]),
            )
            for layer in range(c.num_layers)
        ]

    def weight_bytes(self) -> int:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's K/V and return fp32 logits ``[num_seqs, vocab]`` of the last new
        token of each sequence."""
        self.check_allocated()
        query_start_loc = list(accumulate(batch.query_lens, initial=0))
        max_blocks = max(len(table) for table in batch.block_tables)
        block_tables = [table + [0] * (max_blocks - len(table)) for table in batch.block_tables]
        to_device = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to_device(batch.slot_mapping, torch.int64),
            block_tables=to_device(block_tables, torch.int32),
            context_lens=to_device(batch.context_lens, torch.int32),
            query_start_loc=to_device(query_start_loc, torch.int32),
            is_decode=max(batch.query_lens) == 1,
        )
        logits_indices = to_device([end - 1 for end in query_start_loc[1:]], torch.int64)
        return self.model(
            to_device(batch.input_ids, torch.int64),
            to_device(batch.positions, torch.int64),
            meta,
            self.kv_caches,
            logits_indices,
            self.ops,
        )

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)
