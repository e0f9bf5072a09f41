"""GGUF files (llama.cpp's format) read through the ``gguf`` library: what a Hugging Face
directory gives, from one file.

- **config**: the metadata (``llama.block_count``, ``llama.rope.freq_base``...) becomes
  the same config.json object a Hugging Face checkpoint has, which ``ModelConfig`` parses
  with its usual checks;
- **tokenizer**: the vocabulary, merges, token types and special ids in the metadata are
  built into a ``tokenizers`` tokenizer (gpt2-style byte-level BPE, or llama's
  SentencePiece BPE with byte fallback), with the chat template of the metadata;
- **tensors**: llama.cpp's names map back to Hugging Face's, the q/k row permutation its
  converter applies for rotary embeddings is undone, and quantized blocks are dequantized
  at load (``gguf.quants``) to the dtype the engine runs.

So every loader that reads a model directory reads a GGUF the same way:
``ModelConfig.from_dir``, ``Tokenizer.from_dir`` and ``weights.iter_weights`` send a
path that ``gguf_file`` recognises here. No torch at import (the model check and
``llmctl models`` use it); torch is imported only to hand tensors out.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmctl.errors import ModelError

if TYPE_CHECKING:
    import torch

SUFFIX = ".gguf"
MAGIC = b"GGUF"
# The versions the gguf library reads (gguf_reader.READER_SUPPORTED_VERSIONS).
VERSIONS = (2, 3)
# general.architecture -> the Hugging Face class llmctl's engines run. llama.cpp writes
# Mistral checkpoints as "llama" (same layers, no sliding window in the metadata).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp permutes q/k rows of these (its rotary embedding pairs adjacent values;
# Hugging Face's pairs the two halves of a head); Qwen's files keep Hugging Face's order.
PERMUTED_ARCHITECTURES = ("llama", "mistral")
# Tensor types dequantized at load; F32/F16/BF16 are converted as they are.
READABLE_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
# general.file_type -> the dtype the model was converted from (quantized: bfloat16, whose
# range is float32's, unless the engine is asked for another).
FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
AGAIN = "download or copy it again"
CONVERT = "convert it again with a current llama.cpp (convert_hf_to_gguf.py)"

# llama.cpp tensor name (per layer, after "blk.N.") -> Hugging Face's.
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file a model path names: the path itself if it ends in ``.gguf``, or the
    one ``.gguf`` file of a directory that has no config.json; else None."""
    path = Path(path)
    if path.suffix == SUFFIX and not path.is_dir():
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*" + SUFFIX))
        if len(files) > 1:
            raise ModelError(
                f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files[:3])}"
                f"{'...' if len(files) > 3 else ''}); name the one to use: llmctl serve "
                f"{path / files[0].name}"
            )
        return files[0] if files else None
    return None


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file, under its Hugging Face name and shape (row-major)."""

    name: str  # Hugging Face's name
    gguf_name: str
    tensor_type: str  # GGML's name: F32, Q4_1, ...
    shape: tuple[int, ...]
    reader_tensor: Any

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    # The model check and ``llmctl models`` treat it like a safetensors header entry.
    @property
    def dtype(self) -> str:
        return self.tensor_type


@dataclass(frozen=True)
class GGUFBlocks:
    """A matrix kept as the file's quantized blocks (``quantization=gguf``)."""

    data: torch.Tensor  # uint8 [out, row bytes]: each row its blocks, as in the file
    tensor_type: str  # GGML's name: Q8_0, Q4_1, ...
    shape: tuple[int, ...]  # (out, in), as the dequantized matrix

    def dequantize(self) -> torch.Tensor:
        """The matrix as float32 (``gguf.quants``), for a kernel that has no blocks."""
        import torch
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as decode

        array = decode(self.data.numpy(), GGMLQuantizationType[self.tensor_type])
        return torch.from_numpy(array.reshape(self.shape))


def open_gguf(path: str | Path) -> GGUFModel:
    """The GGUF file at ``path``, read once per process while the file is unchanged (the
    model check, the config, the tokenizer and the weights all read it)."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelError(f"{path} cannot be read: {exc.strerror}") from None
    return _open_cached(path.resolve(), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=4)
def _open_cached(path: Path, size: int, mtime_ns: int) -> GGUFModel:
    return GGUFModel(path)


class GGUFModel:
    """An opened GGUF file: its metadata as config and tokenizer, its tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = _read(path)
        self.arch = str(self.value("general.architecture", ""))
        # Built once per chat template: the model check and the engine both ask.

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (a string, a number, a list), or ``default``."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.value(f"{self.arch}.{key}", default)

    @property
    def version(self) -> int:
        return int(self.value("GGUF.version"))

    @cached_property
    def tensors(self) -> dict[str, GGUFTensor]:
        """Every tensor under its Hugging Face name (those with no place in llmctl's
        models keep their GGUF name, so the check can name them)."""
        tensors = {}
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            # GGUF lists dimensions fastest-first; row-major shapes list them last.
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            tensors[name] = GGUFTensor(name, tensor.name, tensor.tensor_type.name, shape, tensor)
        return tensors

    def tensor_types(self) -> Counter[str]:
        return Counter(t.tensor_type for t in self.tensors.values())

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        """The metadata as a Hugging Face config.json object (``ModelConfig`` parses it)."""
        if self.arch not in ARCHITECTURES:
            raise ModelError(
                f"{self.path}: GGUF architecture {self.arch!r} is not one llmctl runs "
                f"({', '.join(a for a in ARCHITECTURES)}); serve it with llama.cpp, or use a "
                "model of a supported family"
            )
        tensors = self.tensors
        heads = self.arch_value("attention.head_count")
        hidden = self.arch_value("embedding_length")
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "hidden_act": "silu",
            "vocab_size": self.arch_value("vocab_size") or self._token_count(),
            "hidden_size": hidden,
            "intermediate_size": self.arch_value("feed_forward_length"),
            "num_hidden_layers": self.arch_value("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.arch_value("attention.head_count_kv", heads),
            "rms_norm_eps": self.arch_value("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self.arch_value("rope.freq_base", 10000.0),
            "max_position_embeddings": self.arch_value("context_length", 2048),
            "tie_word_embeddings": "lm_head.weight" not in tensors,
            "torch_dtype": FILE_DTYPES.get(self.value("general.file_type"), "bfloat16"),
            "bos_token_id": self.value("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.eos_ids() or None,
        }
        head_dim = self.arch_value("attention.key_length")
        if head_dim is not None:
            config["head_dim"] = head_dim
        rotary = self.arch_value("rope.dimension_count")
        size = head_dim or (hidden // heads if isinstance(hidden, int) and heads else None)
        if rotary is not None and size and rotary != size:
            config["partial_rotary_factor"] = rotary / size
        if self.arch in ("llama", "qwen3") and "model.layers.0.self_attn.q_proj.bias" in tensors:
            config["attention_bias"] = True
        if self.arch == "llama" and "model.layers.0.mlp.up_proj.bias" in tensors:
            config["mlp_bias"] = True
        window = self.arch_value("attention.sliding_window")
        if window:
            config["sliding_window"] = window
        scaling = self.arch_value("rope.scaling.type")
        if scaling not in (None, "none"):
            config["rope_scaling"] = {
                "rope_type": scaling,
                "factor": self.arch_value("rope.scaling.factor"),
                "original_max_position_embeddings": self.arch_value(
                    "rope.scaling.original_context_length"
                ),
            }
        if "rope_freqs.weight" in tensors:
            # llama.cpp stores llama3 rope scaling as per-frequency factors, not parameters.
            raise ModelError(
                f"{self.path}: its rotary frequencies are scaled by a rope_freqs tensor "
                "(llama3 rope scaling as llama.cpp writes it), which llmctl does not read; "
                "serve the model's Hugging Face directory instead"
            )
        return config

    def _token_count(self) -> int | None:
        field = self.reader.fields.get("tokenizer.ggml.tokens")
        return len(field.data) if field is not None else None

    def eos_ids(self) -> list[int]:
        """EOS and the other end-of-generation ids llama.cpp stops at (end of turn...)."""
        ids = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            token_id = self.value(f"tokenizer.ggml.{key}")
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
        return ids

    def iter_weights(
        self,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        keep_types: Collection[str] = (),
    ) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
        """Yield ``(Hugging Face name, tensor)``: dequantized, un-permuted, in ``dtype``.
        Matrices stored as one of ``keep_types`` (``quantization=gguf``: the types a
        backend has block kernels for) come as ``GGUFBlocks`` instead, un-permuted too."""
        import torch

        unreadable = self.unreadable_tensors()
        if unreadable:
            raise ModelError(unreadable_message(self.path, unreadable))
        config = self.hf_config
        for tensor in self.tensors.values():
            keep = tensor.tensor_type in keep_types and len(tensor.shape) == 2
            # A kept matrix's rows are its blocks' bytes: [out, row bytes], permuted alike.
            array = tensor.reader_tensor.data if keep else dequantize(tensor)
            if self.arch in PERMUTED_ARCHITECTURES:
                if tensor.name.endswith(("q_proj.weight", "q_proj.bias")):
                    array = unpermute(array, config["num_attention_heads"])
                elif tensor.name.endswith(("k_proj.weight", "k_proj.bias")):
                    array = unpermute(array, config["num_key_value_heads"])
            if not (array.flags.writeable and array.flags.c_contiguous):
                array = np.array(array)  # F32 tensors are views of the read-only mapping
            weight = torch.from_numpy(array)
            if keep:
                yield tensor.name, GGUFBlocks(weight, tensor.tensor_type, tensor.shape)
                continue
            if dtype is not None:
                weight = weight.to(dtype)
            yield tensor.name, weight.to(device)

    def unreadable_tensors(self) -> dict[str, list[str]]:
        """Tensor type -> the tensors of that type llmctl cannot dequantize."""
        found: dict[str, list[str]] = {}
        for tensor in self.tensors.values():
            if tensor.tensor_type not in READABLE_TYPES:
                found.setdefault(tensor.tensor_type, []).append(tensor.gguf_name)
        return found


def hf_name(gguf_name: str) -> str:
    """llama.cpp's tensor name as Hugging Face's (unknown names stay as they are)."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = LAYER_NAME.match(gguf_name)
    if match and match.group(2) in LAYER_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{LAYER_TENSORS[part]}.{kind}"
    return gguf_name


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's values as float32 (F16 and BF16 exactly; quantized blocks as
    ``gguf.quants`` decodes them), in its row-major shape."""
    from gguf.quants import dequantize as decode

    reader_tensor = tensor.reader_tensor
    return decode(reader_tensor.data, reader_tensor.tensor_type).reshape(tensor.shape)


def unpermute(array: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k rows: within each head it interleaves the two
    halves that Hugging Face's rotary embedding pairs (row i with row i + head_dim/2)."""
    shape = array.shape
    half = shape[0] // heads // 2
    return array.reshape(heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def unreadable_message(path: Path, unreadable: dict[str, list[str]]) -> str:
    count = sum(len(names) for names in unreadable.values())
    first = next(iter(unreadable.values()))[0]
    return (
        f"{path}: {count} tensor(s) are stored as {', '.join(sorted(unreadable))} (e.g. "
        f"{first}), a GGUF tensor type llmctl cannot dequantize; it reads "
        f"{', '.join(READABLE_TYPES)}: use a file quantized as one of those (e.g. Q4_K_M, "
        "Q8_0) or llama.cpp's llama-quantize to make one"
    )


def _read(path: Path) -> Any:
    """A GGUFReader over ``path``, its errors turned into ModelErrors that say what is wrong."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """The library parses each metadata string through a ``np.memmap`` slice, which
        costs ~10 us of subclass bookkeeping each (2.4 s for a 49K-token vocabulary); a
        plain ndarray view of the same mapped bytes reads the same, 4x faster."""

        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._data = value.view(np.ndarray)

    size = path.stat().st_size
    with path.open("rb") as file:
        head = file.read(8)
    if head[:4] != MAGIC:
        raise ModelError(
            f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'"
            + (", it is empty" if size == 0 else "")
            + f"); {AGAIN}, or give a Hugging Face model directory"
        )
    version = int.from_bytes(head[4:8], "little") if len(head) == 8 else None
    if version not in VERSIONS:
        raise ModelError(
            f"{path} is GGUF version {version}; llmctl reads versions "
            f"{' and '.join(map(str, VERSIONS))}: {CONVERT}"
        )
    try:
        reader = Reader(path)
    except ValueError as exc:
        unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(exc))
        if unknown:
            raise ModelError(
                f"{path} holds a tensor of GGML type {unknown.group(1)}, which the gguf "
                f"library does not know; llmctl reads {', '.join(READABLE_TYPES)}: use a file "
                "quantized as one of those, or upgrade gguf (pip install -U gguf)"
            ) from None
        if "cannot reshape" in str(exc):  # a tensor's data runs past the end of the file
            raise ModelError(
                f"{path} is truncated: its {size:,} bytes end before the tensor data its "
                f"header describes (an interrupted download or copy?); {AGAIN}"
            ) from None
        raise _damaged(path, size, exc) from None
    except (IndexError, OverflowError, UnicodeDecodeError, KeyError) as exc:
        raise _damaged(path, size, exc) from None
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise ModelError(
                f"{path} is truncated: it has {size:,} bytes, but tensor {tensor.name!r} "
                f"ends at byte {end:,} (an interrupted download or copy?); {AGAIN}"
            )
    return reader


def _damaged(path: Path, size: int, exc: Exception) -> ModelError:
    return ModelError(
        f"{path} is truncated or damaged ({size:,} bytes; the gguf library stops at: "
        f"{exc}); {AGAIN}"
    )


def transformers_source(path: str | Path) -> tuple[str, dict[str, str]]:
    """What transformers' ``from_pretrained`` takes for this model path: the directory,
    and ``gguf_file=`` naming the file when it is a GGUF (transformers dequantizes it)."""
    gguf = gguf_file(path)
    if gguf is None:
        return str(path), {}
    return str(gguf.parent), {"gguf_file": gguf.name}
