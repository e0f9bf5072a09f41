"""A corpus of broken GGUF files, each made from a tiny checkpoint by one ordinary kind of
damage, with the words its error message must contain.

``CASES`` maps a case id to (make, fragments). ``make(checkpoint_dir, tmp_dir)`` writes
the broken file and returns its path. Fragments are matched with whitespace collapsed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFReader

from tests.gguf.gguf_files import write_gguf

Make = Callable[[Path, Path], Path]


def written(tensor_type: str = "F32", **changes) -> Make:
    def make(checkpoint: Path, directory: Path) -> Path:
        return write_gguf(checkpoint, directory / "model.gguf", tensor_type, **changes)

    return make


def patched(offset: int, content: bytes, tensor_type: str = "F32") -> Make:
    """A good file with ``content`` written over its bytes at ``offset``."""

    def make(checkpoint: Path, directory: Path) -> Path:
        path = written(tensor_type)(checkpoint, directory)
        with path.open("r+b") as file:
            file.seek(offset)
            file.write(content)
        return path

    return make


def truncated(fraction: float) -> Make:
    def make(checkpoint: Path, directory: Path) -> Path:
        path = written()(checkpoint, directory)
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * fraction)])
        return path

    return make


def tensor_type_set_to(raw_type: int, tensor_type: str = "Q8_0") -> Make:
    """A good file whose last matrix says it is stored as GGML type ``raw_type``."""

    def make(checkpoint: Path, directory: Path) -> Path:
        path = written(tensor_type)(checkpoint, directory)
        tensor = [t for t in GGUFReader(path).tensors if len(t.shape) == 2][-1]
        parts = tensor.field.parts  # name length, name, n_dims, dims, type, data offset
        offset = tensor.field.offset + sum(part.nbytes for part in parts[:4])
        with path.open("r+b") as file:
            file.seek(offset)
            file.write(raw_type.to_bytes(4, "little"))
        return path

    return make


CASES: dict[str, tuple[Make, tuple[str, ...]]] = {
    "truncated": (truncated(0.6), ("is truncated", "download or copy it again")),
    "truncated-in-metadata": (truncated(0.002), ("is truncated or damaged",)),
    "bad-magic": (patched(0, b"GGML"), ("is not a GGUF file", "'GGUF'")),
    "unknown-version": (
        patched(4, (7).to_bytes(4, "little")),
        ("GGUF version 7", "convert it again"),
    ),
    "unknown-tensor-type": (tensor_type_set_to(99), ("GGML type 99", "does not know")),
    "unreadable-tensor-type": (
        tensor_type_set_to(GGMLQuantizationType.IQ4_NL.value),
        ("stored as IQ4_NL", "cannot dequantize", "Q4_K_M"),
    ),
    "unknown-architecture": (
        written(arch="falcon"),
        ("GGUF architecture 'falcon' is not one llmctl runs", "llama.cpp"),
    ),
    "shapes-disagree": (
        written(config_changes={"intermediate_size": 128}),
        ("the tensors do not match the metadata", "llama.feed_forward_length", "[128, 64]"),
    ),
}
