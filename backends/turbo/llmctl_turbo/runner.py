"""TurboModelRunner: the turbo backend's ``ModelRunner`` for the shared engine.

At load it reads the checkpoint with the shared loader and prepares the weights the
native step wants (q/k/v and gate/up fused, matrices as transposed views). Each
``execute`` turns the step's lists into int32 tensors and makes ONE native call,
``llama_step``, which runs every layer and returns the logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from llmctl.engine.model_config import ModelConfig
from llmctl.engine.runner import PagedRunner, StepBatch
from llmctl.engine.weights import load_weights
from llmctl.errors import ModelError
from llmctl_turbo.build import load_ops
from llmctl_turbo.config import LLAMA_FAMILY
from llmctl_turbo.rope import model_cos_sin_cache


def prepare_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> list[torch.Tensor]:
    """The flat weight list of ``llama_step`` (layout in ``csrc/llama_step.h``).

    Matrices become transposed ``[in, out]`` views, so the step's matmuls need no
    per-call view; fused matrices are concatenated once here.
    """
    if config.architecture not in LLAMA_FAMILY:
        raise ModelError(
            f"turbo runs {', '.join(sorted(LLAMA_FAMILY))}, not {config.architecture}; "
            "use the torch backend"
        )
    if config.mlp_bias:
        raise ModelError(
            "turbo does not support MLP biases (mlp_bias: true); use the torch backend"
        )

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise ModelError(f"the checkpoint has no tensor {name!r}")
        return weights[name]

    embed = take("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else take("lm_head.weight")
    none = embed.new_empty(0)  # "no bias"
    prepared = [embed, take("model.norm.weight"), lm_head.t()]
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        qkv = torch.cat([take(f"{attn}{p}_proj.weight") for p in "qkv"])
        qkv_bias = (
            torch.cat([take(f"{attn}{p}_proj.bias") for p in "qkv"]) if config.qkv_bias else none
        )
        gate_up = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])
        prepared += [
            take(prefix + "input_layernorm.weight"),
            qkv.t(),
            qkv_bias,
            take(attn + "o_proj.weight").t(),
            weights.get(attn + "o_proj.bias", none),
            take(prefix + "post_attention_layernorm.weight"),
            gate_up.t(),
            take(mlp + "down_proj.weight").t(),
        ]
    return prepared


class TurboModelRunner(PagedRunner):
    """Runs a Llama-family model with turbo's native step over a paged KV cache.

    ``num_blocks`` may be given later through ``allocate_kv_cache`` (the engine sizes
    the cache from the memory free once the weights are loaded). ``max_model_len``
    bounds the positions the rotary table covers.
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
        max_model_len: int | None = None,
    ) -> None:
        super().__init__(config, dtype=dtype, device=device, block_size=block_size)
        # The op's overload itself: calling it skips the overload lookup of every call.
        self._llama_step = load_ops().llama_step.default
        weights = load_weights(model_dir, self.dtype, self.device)
        self.weights = prepare_weights(weights, config)
        max_positions = max_model_len or config.session_len()
        self.cos_sin_cache = model_cos_sin_cache(config, max_positions).to(self.device)
        self.kv_cache = torch.empty(0, device=self.device)
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)

    def _allocate(self, num_blocks: int) -> None:
        """One ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` tensor. The
        kernels read only slots that were written, so it need not be zeroed."""
        c = self.config
        self.kv_cache = torch.empty(
            (c.num_layers, 2, num_blocks, self.block_size, c.num_kv_heads, c.head_dim),
            dtype=self.dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's K/V and return fp32 logits ``[num_seqs, vocab]`` of the last new
        token of each sequence."""
        self.check_allocated()
        input_ids, positions, slots, block_tables, query_start_loc, context_lens = (
            self._batch_tensors(batch)
        )
        return self._llama_step(
            input_ids,
            positions,
            slots,
            block_tables,
            query_start_loc,
            context_lens,
            self.weights,
            self.kv_cache,
            self.cos_sin_cache,
            self.config.num_heads,
            self.config.rms_norm_eps,
        )

    def _batch_tensors(self, batch: StepBatch) -> tuple[torch.Tensor, ...]:
        """The step's int32 tensors, made from ONE array (one allocation, one copy to the
        device): at a few hundred microseconds per step, each tensor made counts."""
        num_tokens, num_seqs = len(batch.input_ids), batch.num_seqs
        tables = batch.block_table_array()
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(batch.query_lens, out=query_start_loc[1:])
        flat = np.concatenate(
            [
                np.asarray(part, dtype=np.int32)
                for part in (batch.input_ids, batch.positions, batch.slot_mapping)
            ]
            + [query_start_loc, np.asarray(batch.context_lens, dtype=np.int32), tables.ravel()]
        )
        packed = torch.from_numpy(flat)
        if self.device.type == "cuda":
            packed = packed.pin_memory().to(self.device, non_blocking=True)
        ids, positions, slots, query_start_loc, context_lens, tables = packed.split(
            [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, tables.size]
        )
        batch.fill_sampled_tokens(ids)
        return ids, positions, slots, tables.view(num_seqs, -1), query_start_loc, context_lens
