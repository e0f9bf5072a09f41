"""TorchModelRunner: the torch backend's ``ModelRunner`` for the shared engine.

It loads the model, owns the paged KV cache, and runs one scheduler step: the step's
lists become one tensor, copied to the device once (``stage_step``); the model writes
the new tokens' K/V and returns the logits of each sequence's last new token (or, in a
speculative step, of the tokens ``logits_indices`` names).

On a GPU, decode steps replay CUDA graphs captured when the cache is allocated (see
``llmctl.engine.cuda_graphs``); prefill and mixed prefill/decode steps run eagerly, and
so does any step with a LoRA adapter in it (``llmctl_torch.lora``: batched, never
merged; the slots are allocated when the first adapter is put in one).
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmctl.engine.lora import LoraWeights, read_lora_weights
from llmctl.engine.quant import SCALE_DTYPE, is_quantized_kv
from llmctl.engine.runner import PagedRunner
from llmctl.engine.step import StepBatch, StepInputs
from llmctl.model.config import ModelConfig
from llmctl.model.lora import AdapterSpec
from llmctl.model.weights import load_weights
from llmctl_torch.attention import LayerCache, attention_ops
from llmctl_torch.linear import quantize_linears
from llmctl_torch.lora import ModelLoras
from llmctl_torch.model import AttentionMetadata, LlamaForCausalLM, build_model


class TorchModelRunner(PagedRunner):
    """Runs a Llama-family model over a paged KV cache of ``num_blocks`` blocks.

    ``num_blocks`` may be left out and given later through ``allocate_kv_cache`` (the
    engine sizes the cache from the memory free once the weights are loaded).
    ``max_num_seqs`` and ``max_model_len`` (default: the model's context) bound the
    decode steps the CUDA graphs are captured for; ``cuda_graphs=False`` turns them off.
    ``quantization`` (``none`` or ``int8``) converts the linear layers' weights once
    loaded; ``kv_cache_dtype`` (``auto``, ``int8``, ``fp8``) is the cache's element type.
    ``max_loras`` LoRA slots of rank ``max_lora_rank`` serve adapters (``LoraRunner``).
    """

    serves_lora = True  # a tensor-parallel runner does not (yet)

    def __init__(
        self,
        model_dir: str | Path,
        config: ModelConfig,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        block_size: int = 64,
        num_blocks: int | None = None,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        max_num_seqs: int = 128,
        max_model_len: int | None = None,
        cuda_graphs: bool = True,
        quantization: str = "none",
        kv_cache_dtype: str = "auto",
        cpu_threads: int | None = None,
    ) -> None:
        super().__init__(
            config,
            dtype=dtype,
            device=device,
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            cpu_threads=cpu_threads,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            cuda_graphs=cuda_graphs,
        )
        self.ops = attention_ops(self.device, self.kv_dtype)
        self.model = self._load_model(model_dir)
        quantize_linears(self.model, quantization)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.loras: ModelLoras | None = None  # made when the first adapter is loaded
        self.kv_caches: list[LayerCache] = []
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)

    def _load_model(self, model_dir: str | Path) -> LlamaForCausalLM:
        """The model with its weights on ``self.device`` (a tensor-parallel rank overrides
        this to load its shard)."""
        weights = load_weights(model_dir, self.dtype, self.device)
        return build_model(weights, self.config, self.device)

    def read_lora(self, spec: AdapterSpec) -> LoraWeights:
        return read_lora_weights(spec, self.dtype, pin=self.device.type == "cuda")

    def load_lora_slot(self, slot: int, weights: LoraWeights) -> None:
        if self.loras is None:
            kernel = "triton" if self.device.type == "cuda" else "torch"
            self.loras = ModelLoras(
                self.model, self.max_loras, self.max_lora_rank, self.dtype, kernel
            )
        self.loras.load_slot(slot, weights)

    def execute(self, batch: StepBatch) -> torch.Tensor:
        if batch.lora_slots is None:
            return super().execute(batch)
        context = self.loras.context
        context.prepare(batch.lora_slots, batch.query_lens)
        try:
            return super().execute(batch)
        finally:
            context.clear()

    def _allocate(self, num_blocks: int) -> None:
        """One ``[2, layers, num_blocks, block_size, kv_heads, head_dim]`` tensor, viewed
        as a (K, V) pair per layer and handed to that layer's attention (``bind``); an
        int8 / fp8 cache has a float32 scale per token and KV head beside it, ``[2,
        layers, num_blocks, block_size, kv_heads]``. Zeroed, not
        empty: attention masks unwritten slots with a zero weight, and 0 * NaN from
        uninitialised memory would still be NaN. On the CPU its memory is taken as blocks
        are first used (``new_cache``)."""
        c = self.config
        shape = (2, c.num_layers, num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        cache = self.new_cache(shape, self.kv_dtype)
        scales = None
        if is_quantized_kv(self.kv_dtype):
            scales = self.new_cache(shape[:-1], SCALE_DTYPE)
        self.kv_caches = [
            LayerCache(
                cache[0, layer],
                cache[1, layer],
                None if scales is None else (scales[0, layer], scales[1, layer]),
            )
            for layer in range(c.num_layers)
        ]
        for layer, layer_cache in zip(self.model.model.layers, self.kv_caches):
            layer.self_attn.bind(layer_cache, self.ops)

    def weight_bytes(self) -> int:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def captures_graphs(self) -> bool:
        # The plain-torch kernels (LLMCTL_TORCH_ATTENTION=torch, for debugging) cannot
        # skip the padding rows a graph bucket adds: they decode eagerly.
        return self.cuda_graphs and self.ops.name == "triton"

    def forward(self, inputs: StepInputs, is_decode: bool) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=inputs.slot_mapping.long(),  # index_copy_ (plain torch) wants int64
            block_tables=inputs.block_tables,
            context_lens=inputs.context_lens,
            query_start_loc=inputs.query_start_loc,
            is_decode=is_decode,
        )
        return self.model(
            inputs.input_ids,
            inputs.positions,
            meta,
            inputs.logits_rows(),  # each sequence's last token, or a speculative step's
        )
