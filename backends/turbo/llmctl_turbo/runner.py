"""TurboModelRunner: the turbo backend's ``ModelRunner`` for the shared engine.

At load it reads the checkpoint with the shared loader and prepares the weights the
native step wants (q/k/v and gate/up fused; on the CPU each matrix packed for turbo's
own linear kernels, elsewhere as transposed views). Each ``execute`` turns the step's
lists into int32 tensors (one packed buffer, the shared ``stage_step``) and makes ONE
native call, ``llama_step``, which runs every layer and returns the logits.

On a GPU, decode steps and speculative verification steps (k + 1 tokens a sequence)
replay CUDA graphs of that call, captured per batch-size bucket when the cache is
allocated (``llmctl.engine.runner.DecodeGraphs``): a step then costs one host-to-device
copy and one graph launch instead of a few hundred kernel launches. Steps with a LoRA
adapter (``llmctl_turbo.lora``, batched beside the base weights, never merged) replay
graphs with per-token slots, captured at the first such step; prefill and mixed steps
run eagerly. The adapter slots are allocated when the first adapter is put in one.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from rich.progress import track

from llmctl.engine.calibration import layer_input_moments, self_written_tokens
from llmctl.engine.lora import LoraWeights, read_lora_weights
from llmctl.engine.quant import (
    SCALE_DTYPE,
    QuantizationReport,
    group_block_type,
    is_quantized_kv,
    kv_rotation,
    quantize_weight_groups,
    quantize_weight_int8,
    tensor_bytes,
)
from llmctl.engine.runner import PagedRunner, StepBatch, StepInputs
from llmctl.errors import ModelError
from llmctl.model.config import ModelConfig
from llmctl.model.gguf import GGUFBlocks
from llmctl.model.lora import AdapterSpec
from llmctl.model.weights import load_weights
from llmctl_turbo.build import load_ops
from llmctl_turbo.config import (
    LLAMA_FAMILY,
    gguf_blocks_problem,
    int8_weights_problem,
    mlp_bias_problem,
    quantized_kv_problem,
    weight_groups,
    weight_groups_problem,
)
from llmctl_turbo.gguf_cuda import CudaBlockPlacer, load_cuda_gguf_weights
from llmctl_turbo.gguf_weights import BlockPacker, load_gguf_weights
from llmctl_turbo.lora import TurboLoras
from llmctl_turbo.rope import model_cos_sin_cache

CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def prepare_weights(
    weights: dict[str, torch.Tensor | GGUFBlocks],
    config: ModelConfig,
    pack: bool = False,
    quantization: str = "none",
    group_scheme: tuple[int, int, bool] | None = None,
) -> list[torch.Tensor]:
    """The flat weight list of ``llama_step`` (layout in ``csrc/llama_step.cpp``).

    Fused matrices are concatenated once here. With ``pack`` (turbo's CPU kernels) each
    matrix is packed into the panels those kernels read (``pack_linear_weight`` in
    ``csrc/kernels.h``); the checkpoint's copy is then dropped, so memory does not grow.
    ``quantization="int8"`` quantizes the layers' matrices as the torch backend does
    (``llmctl.engine.quant``) and logs what that saved; packed for the CPU kernels, left
    as int8 ``[out, in]`` matrices with float32 scales ``[out]`` for the CUDA ones. The
    embeddings and the LM head keep the model dtype. ``quantization="gguf"``: ``weights``
    holds a GGUF file's block matrices as ``GGUFBlocks``, packed as blocks for the CPU
    kernels (``llmctl_turbo.gguf_weights``), the LM head included, the embedding table
    the file's rows, dequantized per looked-up token; on CUDA (the device of the other
    weights) kept as the file's rows and the embedding table dequantized
    (``llmctl_turbo.gguf_cuda``).
    ``group_scheme`` (``(bits, group size, zero point)``, ``config.weight_groups``; CPU
    only): the layers' matrices are quantized group-wise into GGUF blocks
    (``quantize_to_blocks``) and packed as the gguf ones.
    """
    if config.architecture not in LLAMA_FAMILY:
        raise ModelError(
            f"turbo runs {', '.join(sorted(LLAMA_FAMILY))}, not {config.architecture}; "
            "use the torch backend"
        )
    if problem := mlp_bias_problem(config):  # Backend.check refuses it before loading
        raise ModelError(problem)
    quantize = quantization == "int8" and group_scheme is None
    if group_scheme:
        weights = quantize_to_blocks(weights, config, *group_scheme)

    def take(name: str) -> torch.Tensor | GGUFBlocks:
        if name not in weights:
            raise ModelError(f"the checkpoint has no tensor {name!r}")
        return weights[name]

    def matrix(tensor: torch.Tensor, groups: int = 1) -> torch.Tensor:
        return load_ops().pack_linear_weight(tensor, groups) if pack else tensor

    final_norm = take("model.norm.weight")
    blocks = None
    if quantization == "gguf" and final_norm.device.type == "cuda":
        blocks = CudaBlockPlacer(final_norm.dtype, final_norm.device)
    elif quantization == "gguf" or group_scheme:
        blocks = BlockPacker(final_norm.dtype)
    embed_weight = take("model.embed_tokens.weight")
    lm_head = embed_weight if config.tie_word_embeddings else take("lm_head.weight")
    embed = blocks.embedding_table(embed_weight) if blocks else embed_weight
    none = final_norm.new_empty(0)  # "no bias", "no scale"
    element_bytes = final_norm.element_size()  # of a float matrix, for the report
    quantized = bytes_before = bytes_after = 0

    def layer_matrix(parts: list, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's matrix (``parts`` fused) as the kernels read it, and its scales
        (``none`` unless int8)."""
        nonlocal quantized, bytes_before, bytes_after
        if blocks:
            packed = blocks.pack(parts, groups)
            if group_scheme and packed.dtype == torch.uint8:
                quantized += 1
                bytes_before += sum(p.shape[0] * p.shape[1] for p in parts) * element_bytes
                bytes_after += tensor_bytes(packed)
            return packed, none
        tensor = torch.cat(parts) if len(parts) > 1 else parts[0]
        if not quantize:
            return matrix(tensor, groups), none
        qweight, scale = pack_int8_linear(tensor, groups) if pack else quantize_weight_int8(tensor)
        quantized += 1
        bytes_before += tensor_bytes(tensor)
        bytes_after += tensor_bytes(qweight, scale)
        return qweight, scale

    layers = range(config.num_layers)
    if quantize or (blocks and not group_scheme):
        what = "packing GGUF blocks" if blocks else "quantizing weights to int8"
        layers = track(layers, description=what, transient=True)
    head = blocks.pack([lm_head]) if blocks else matrix(lm_head)
    prepared = [embed, final_norm, head]
    for layer in layers:
        prefix = f"model.layers.{layer}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        qkv, qkv_scale = layer_matrix([take(f"{attn}{p}_proj.weight") for p in "qkv"])
        qkv_bias = (
            torch.cat([take(f"{attn}{p}_proj.bias") for p in "qkv"]) if config.qkv_bias else none
        )
        o_proj, o_scale = layer_matrix([take(attn + "o_proj.weight")])
        gate_up, gate_up_scale = layer_matrix(
            [take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")], groups=2
        )
        down, down_scale = layer_matrix([take(mlp + "down_proj.weight")])
        prepared += [
            take(prefix + "input_layernorm.weight"),
            qkv,
            qkv_bias,
            o_proj,
            weights.get(attn + "o_proj.bias", none),
            take(prefix + "post_attention_layernorm.weight"),
            gate_up,
            down,
            qkv_scale,
            o_scale,
            gate_up_scale,
            down_scale,
        ]
    if quantize:  # the torch backend's line: its layers are these fused ones too
        QuantizationReport(quantized, bytes_before, bytes_after).log()
    if group_scheme:
        bits, group_size, zero_point = group_scheme
        kind = f"int{bits} ({group_block_type(bits, zero_point)} blocks, group {group_size})"
        QuantizationReport(quantized, bytes_before, bytes_after, kind).log()
        kept = 4 * config.num_layers - quantized
        if kept:
            logging.getLogger("llmctl").info(
                "quantization: %d matrices kept in %s (inputs not a multiple of %d)",
                kept, str(final_norm.dtype).removeprefix("torch."), group_size,
            )  # fmt: skip
    elif blocks:
        blocks.log()
    return prepared


def quantize_to_blocks(
    weights: dict[str, torch.Tensor], config: ModelConfig, bits: int, group_size: int,
    zero_point: bool,
) -> dict[str, torch.Tensor | GGUFBlocks]:  # fmt: skip
    """``weights`` with each layer's linear matrices quantized group-wise into GGUF block
    rows (``quantize_weight_groups``: Q8_0, Q4_0 or Q4_1), so that turbo's block kernels
    run them as they run a GGUF file's. A matrix whose inputs are not a multiple of the
    group (stories260K's down_proj: 172) stays a float matrix. 4-bit matrices are rounded
    by GPTQ, with the moments of their inputs on text the model writes itself
    (``llmctl.engine.calibration``)."""
    kind = group_block_type(bits, zero_point)
    quantized = dict(weights)
    moments: Iterator[dict[str, torch.Tensor] | None] = itertools.repeat(None)
    if bits == 4:
        started = time.perf_counter()
        tokens = self_written_tokens(
            weights,
            config,
            progress=lambda r: track(r, description="writing calibration text", transient=True),
        )
        moments = layer_input_moments(weights, config, tokens)
    description = f"quantizing weights to int{bits}" + (" (GPTQ)" if bits == 4 else "")
    layers = track(range(config.num_layers), description=description, transient=True)
    for layer, hessians in zip(layers, moments):
        for part in LINEAR_PARTS:
            name = f"model.layers.{layer}.{part}.weight"
            weight = weights.get(name)
            if weight is not None and weight.shape[1] % group_size == 0:
                hessian = hessians[name] if hessians else None
                raw = quantize_weight_groups(weight, bits, group_size, zero_point, hessian)
                quantized[name] = GGUFBlocks(raw, kind, tuple(weight.shape))
    if bits == 4:
        logging.getLogger("llmctl").info(
            "quantization: int4 weights rounded by GPTQ over %d tokens the model wrote "
            "itself, in %.1f s", tokens.numel(), time.perf_counter() - started,
        )  # fmt: skip
    return quantized


# A layer's linear matrices (fused into qkv and gate_up when packed).
LINEAR_PARTS = tuple(f"self_attn.{p}_proj" for p in "qkvo") + tuple(
    f"mlp.{p}_proj" for p in ("gate", "up", "down")
)


def pack_int8_linear(weight: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` quantized to int8 per output channel (the torch backend's
    scheme) and packed for turbo's CPU kernels: ``(int8 [panels, in, 16], float32 scales
    [panels * 16])``, the scales packed like the weight's rows."""
    ops = load_ops()
    qweight, scale = quantize_weight_int8(weight)
    return ops.pack_linear_weight(qweight, groups), ops.pack_linear_weight(
        scale[:, None], groups
    ).flatten()


class TurboModelRunner(PagedRunner):
    """Runs a Llama-family model with turbo's native step over a paged KV cache.

    ``num_blocks`` may be given later through ``allocate_kv_cache`` (the engine sizes
    the cache from the memory free once the weights are loaded). ``max_model_len``
    bounds the positions the rotary table covers and, with ``max_num_seqs``, the decode
    steps the CUDA graphs are captured for; ``cuda_graphs=False`` turns them off.
    ``cpu_threads`` sizes the native kernels' thread pool (and torch's) on the CPU.
    ``quantization="int8"`` runs the layers' matrices as int8 in turbo's kernels (CPU:
    packed, float32 or bfloat16 activations; CUDA: any model dtype);
    ``quantization="gguf"`` runs a GGUF file's quantized matrices as their blocks: Q8_0 /
    Q4_0 / Q4_1 in turbo's CPU block kernels (``llmctl_turbo.gguf_weights``), those and
    Q4_K / Q5_K / Q6_K in its CUDA kernel (``llmctl_turbo.gguf_cuda``).
    ``int4``, and ``int8`` with a ``quantization_group_size``, quantize the checkpoint's
    matrices into the CPU blocks at load (``quantize_to_blocks``).
    ``kv_cache_dtype="int8"`` keeps the KV cache as int8 with a float32 scale per token
    and KV head (the torch backend's bytes), read by those kernels too.
    ``max_loras`` LoRA slots of rank ``max_lora_rank`` serve adapters (``LoraRunner``),
    on the CPU and on CUDA.
    """

    serves_lora = True  # turbo's CPU LoRA kernel and its CUDA ones (llmctl_turbo.lora)

    def __init__(
        self,
        model_dir: str | Path,
        config: ModelConfig,
        *,
        num_blocks: int | None = None,
        quantization: str = "none",
        max_loras: int = 4,
        max_lora_rank: int = 16,
        quantization_group_size: int | None = None,
        quantization_zero_point: bool | None = None,
        **paged: Any,
    ) -> None:
        super().__init__(config, **paged)  # PagedRunner's options: dtype, device, block size...
        kv_problem = quantized_kv_problem(self.kv_cache_dtype)
        if kv_problem:
            raise ModelError(kv_problem)
        ops = load_ops()
        # The op's overload itself: calling it skips the overload lookup of every call.
        self._llama_step = ops.llama_step.default
        # turbo's own CPU kernels run fp32 and bf16 (fp16 on a CPU goes through ATen).
        on_cpu_kernels = self.device.type == "cpu" and self.dtype in CPU_KERNEL_DTYPES
        dtype_name = str(self.dtype).removeprefix("torch.")
        group_scheme = weight_groups(quantization, quantization_group_size, quantization_zero_point)
        if group_scheme:
            problem = weight_groups_problem(self.device.type, dtype_name)
            if problem:
                raise ModelError(problem)
        elif quantization == "int8":
            problem = int8_weights_problem(self.device.type, dtype_name)
            if problem:
                raise ModelError(problem)
        if quantization == "gguf":
            problem = gguf_blocks_problem(self.device.type, dtype_name)
            if problem:
                raise ModelError(problem)
        if self.device.type == "cpu":
            ops.set_cpu_threads(self.cpu_threads)
        if quantization == "gguf" and self.device.type == "cuda":
            weights = load_cuda_gguf_weights(model_dir, self.dtype, self.device)
        elif quantization == "gguf":
            weights = load_gguf_weights(model_dir, self.dtype)
        else:
            weights = load_weights(model_dir, self.dtype, self.device)
        self.weights = prepare_weights(
            weights, config, pack=on_cpu_kernels, quantization=quantization,
            group_scheme=group_scheme,
        )  # fmt: skip
        del weights  # the checkpoint's copies of packed matrices
        self.cos_sin_cache = model_cos_sin_cache(config, self.max_model_len).to(self.device)
        self.kv_cache = torch.empty(0, device=self.device)
        self.kv_cache_scale: torch.Tensor | None = None  # an int8 cache's scales
        # The matrix an int8 cache's rows are rotated by, built once (quant.kv_rotation).
        self.kv_rotation = (
            kv_rotation(config.head_dim, self.dtype, self.device)
            if self.kv_dtype == torch.int8
            else None
        )
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.loras: TurboLoras | None = None  # made when the first adapter is loaded
        # This step's adapter inputs (llama_step's lora_rows, lora_tiles, lora_slots): the
        # tiles on the CPU, each token's slot on CUDA; None: no adapter in the step.
        self._lora_step: tuple[torch.Tensor | None, ...] | None = None
        # Where this step's LM head writes each row's argmax (execute_greedy); None: not.
        self._argmax: torch.Tensor | None = None
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)

    def read_lora(self, spec: AdapterSpec) -> LoraWeights:
        return read_lora_weights(spec, torch.float32, pin=self.device.type == "cuda")

    def allocate_lora_slots(self) -> None:
        if self.loras is None:
            self.loras = TurboLoras(self.config, self.max_loras, self.max_lora_rank, self.device)

    def load_lora_slot(self, slot: int, weights: LoraWeights) -> None:
        self.allocate_lora_slots()
        self.loras.load_slot(slot, weights)

    def eager_step(self, batch: StepBatch) -> torch.Tensor:
        if batch.lora_slots is None or self.loras is None:
            return super().eager_step(batch)
        if self.device.type == "cuda":
            slots = self.loras.step_slots(batch.lora_slots, batch.query_lens, self.device)
            self._lora_step = None if slots is None else (None, None, slots)
        else:
            tiles = self.loras.step_tiles(batch.lora_slots, batch.query_lens)
            self._lora_step = None if tiles is None else (*tiles, None)
        try:
            return super().eager_step(batch)
        finally:
            self._lora_step = None

    def execute_greedy(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """On the CPU the LM head finds each row's argmax as it writes the row's logits
        (no graphs there: every step is ``forward``); on CUDA the argmax follows."""
        if self.device.type != "cpu":
            return super().execute_greedy(batch)
        rows = batch.num_seqs if batch.logits_indices is None else len(batch.logits_indices)
        self._argmax = torch.empty(rows, dtype=torch.int64)
        try:
            return self.execute(batch), self._argmax
        finally:
            self._argmax = None

    def graphs_take_lora(self) -> bool:
        # On CUDA the step reads each token's slot on the device: a graph's fixed
        # StepInputs.lora_slots serve as they are (the CPU kernels take host-made tiles).
        return self.device.type == "cuda" and self.loras is not None

    def weight_bytes(self) -> int:
        unique = {t.data_ptr(): t for t in self.weights if t.numel()}  # tied embeddings once
        return tensor_bytes(*unique.values())

    def _allocate(self, num_blocks: int) -> None:
        """One ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` tensor, and for
        an int8 cache its float32 scales ``[layers, 2, num_blocks, block_size, kv_heads]``.
        On the CPU their memory is taken as blocks are first used (``new_cache``)."""
        c = self.config
        rows = (c.num_layers, 2, num_blocks, self.block_size, c.num_kv_heads)
        self.kv_cache = self.new_cache((*rows, c.head_dim), self.kv_dtype)
        if is_quantized_kv(self.kv_dtype):
            self.kv_cache_scale = self.new_cache(rows, SCALE_DTYPE)

    def forward(self, inputs: StepInputs, is_decode: bool) -> torch.Tensor:
        """``llama_step`` over staged inputs: every eager step, and the decode step the
        CUDA graphs capture (padding rows: slot -1 writes nothing, context length 0
        attends to nothing). One native call serves decode and prefill alike; a step
        with adapters passes their slots and its tiles (CPU) or each token's slot (CUDA:
        an eager step's, or a graph's fixed ``inputs.lora_slots``)."""
        lora_rows, lora_tiles, lora_slots = self._lora_step or (None, None, inputs.lora_slots)
        adapted = lora_rows is not None or lora_slots is not None
        return self._llama_step(
            inputs.input_ids,
            inputs.positions,
            inputs.slot_mapping,
            inputs.block_tables,
            inputs.query_start_loc,
            inputs.context_lens,
            self.weights,
            self.kv_cache,
            self.cos_sin_cache,
            self.config.num_heads,
            self.config.rms_norm_eps,
            self.loras.tensors if adapted else [],
            self.kv_cache_scale,
            inputs.logits_indices,  # None: each sequence's last token
            lora_rows,
            lora_tiles,
            lora_slots,
            self.kv_rotation,
            self._argmax,
        )
