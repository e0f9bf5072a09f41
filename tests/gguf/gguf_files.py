"""GGUF files written in the tests from Hugging Face checkpoints, the way llama.cpp's
``convert_hf_to_gguf.py`` and ``llama-quantize`` write them, with ``gguf.GGUFWriter``.

``write_gguf(model_dir, path, tensor_type)``: llama.cpp's metadata keys and tensor names,
q/k rows permuted for the llama architecture (Mistral is written as ``llama``, as
llama.cpp does), 2-D weights quantized with ``gguf.quants`` (1-D ones stay F32, and a
matrix whose rows do not split into the type's blocks stays F32, as llama-quantize
leaves them), and the checkpoint's SentencePiece tokenizer.json as a ``llama``
vocabulary with merges and token types.

``file_matrices(model_dir, tensor_type)``: the checkpoint's tensors after the same
quantization round trip, computed here (not by llmctl's reader): what a reader must
give back. K-quants (which gguf.quants cannot quantize) get random blocks instead of
the checkpoint's matrices; transformers' own dequantizer is their reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from tests.gguf.k_quants import quantize_k

ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
BLOCK_SIZE = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32}
# K-quants gguf.quants cannot quantize: their matrices are random blocks (any bytes are
# a valid block once its float16 scales are set). Value: (bytes, offsets of the f16 scales).
K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}
K_ROW = 256


def gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".")
    return f"blk.{parts[2]}.{LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py)."""
    shape = weights.shape
    return (
        weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def stored_type(array: np.ndarray, tensor_type: str) -> str:
    """The type a tensor is stored as: 1-D tensors and matrices whose rows do not split
    into whole blocks stay F32."""
    if tensor_type in ("F32", "F16") or array.ndim == 1:
        return tensor_type if array.ndim > 1 else "F32"
    block = K_ROW if tensor_type in K_BLOCKS else BLOCK_SIZE[tensor_type]
    return tensor_type if array.shape[-1] % block == 0 else "F32"


def random_k_blocks(shape: tuple[int, int], tensor_type: str, rng: np.random.Generator):
    """Random ``tensor_type`` blocks for a ``shape`` matrix, scales small and finite."""
    size, scales = K_BLOCKS[tensor_type]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // K_ROW, size), dtype=np.uint8)
    for offset in scales:
        scale = rng.uniform(0.002, 0.01, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(shape[0], -1)


def round_trip(array: np.ndarray, tensor_type: str) -> np.ndarray:
    """The values a reader gets back after ``array`` is stored as ``tensor_type``."""
    kind = GGMLQuantizationType[stored_type(array, tensor_type)]
    return dequantize(quantize(array.astype(np.float32), kind), kind).reshape(array.shape)


def file_matrices(model_dir: Path, tensor_type: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as the GGUF holds them (quantized and back), HF names."""
    return {
        name: torch.from_numpy(round_trip(t.float().numpy(), tensor_type))
        for name, t in load_file(str(Path(model_dir) / "model.safetensors")).items()
    }


def write_gguf(
    model_dir: Path,
    path: Path,
    tensor_type: str = "F32",
    *,
    arch: str | None = None,
    config_changes: dict | None = None,
    quantized_k_blocks: bool = False,
) -> Path:
    """Write the checkpoint in ``model_dir`` as a GGUF file at ``path`` (``arch`` and
    ``config_changes`` make a file whose metadata lies, for the model check's tests).
    K-quant matrices are random blocks, or with ``quantized_k_blocks`` the checkpoint's
    own weights quantized by ``tests.gguf.k_quants``."""
    config = {**json.loads((model_dir / "config.json").read_text()), **(config_changes or {})}
    arch = arch or ARCH[config["architectures"][0]]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(model_dir.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if head_dim != config["hidden_size"] // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type({"F32": 0, "F16": 1}.get(tensor_type, 7))
    _add_tokenizer(writer, model_dir)
    rng = np.random.default_rng(0)
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        array = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = permute(array, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = permute(array, kv_heads)
        kind = stored_type(array, tensor_type)
        if kind == "F16":
            writer.add_tensor(gguf_name(name), array.astype(np.float16))
        elif kind == "F32":
            writer.add_tensor(gguf_name(name), array)
        elif kind in K_BLOCKS:
            if quantized_k_blocks:
                blocks = quantize_k(array, kind)
            else:
                blocks = random_k_blocks(array.shape, kind, rng)
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=GGMLQuantizationType[kind])
        else:
            qtype = GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name(name), quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: GGUFWriter, model_dir: Path) -> None:
    """A SentencePiece BPE tokenizer.json (stories260K's) as llama.cpp's ``llama`` vocabulary."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}

    def kind(token: str) -> int:
        if token == tokenizer["model"].get("unk_token"):
            return TokenType.UNKNOWN
        if token in special:
            return TokenType.CONTROL
        if token.startswith("<0x") and token.endswith(">") and len(token) == 6:
            return TokenType.BYTE
        return TokenType.NORMAL

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types([kind(t) for t in tokens])
    writer.add_token_merges([" ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_unk_token_id(vocab["<unk>"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


def hf_gguf_model(path: Path):
    """transformers' own model loaded from the GGUF file (its own dequantizer), float32."""
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
