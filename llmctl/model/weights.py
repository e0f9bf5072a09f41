"""A model's safetensors weights: which files hold them, what their headers say, and loading.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name →
dtype, shape, byte offsets) and the raw data. ``read_header`` parses that header by hand,
so a checkpoint can be described and checked against config.json without torch and
before anything is allocated (``llmctl.model.check`` does, for ``serve`` and ``backends
check``). Loading reads tensors through ``safe_open`` (memory-mapped), one at a time,
converted to the dtype asked for.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmctl.errors import ModelError

if TYPE_CHECKING:
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Show a progress bar only when loading takes long enough to be worth watching.
PROGRESS_MIN_TENSORS = 200
# The safetensors library refuses larger headers; so do we, before reading one.
MAX_HEADER_BYTES = 100_000_000
# Bits per element of every dtype in the safetensors format.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4,
    "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}  # fmt: skip
AGAIN = "download or copy it again"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header describes it."""

    dtype: str  # safetensors' name: F32, BF16, I8, ...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of ``model_dir``, in shard order."""
    from llmctl.model.demo import ensure_demo_materialized

    model_dir = Path(model_dir)
    ensure_demo_materialized(model_dir)
    weight_map = read_index(model_dir)
    if weight_map is not None:
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [_missing_file(f) for f in files if not f.is_file()]
        if missing:
            raise ModelError(
                f"{model_dir}: {len(missing)} of the {len(files)} shards listed in "
                f"{INDEX_FILE} are missing: {', '.join(missing)}. Download the whole "
                "checkpoint again (every shard the index lists)"
            )
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    links = sorted(p for p in model_dir.glob("*.safetensors") if not p.exists())
    if links:
        raise ModelError(
            f"{links[0]} is a link to a missing file (an interrupted download?); {AGAIN}"
        )
    others = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if others:
        return others
    found = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
        p.name for p in model_dir.glob("*.pt*")
    )
    hint = (
        f" It has {', '.join(found[:3])}: convert it to safetensors first (e.g. load it with "
        "transformers and call save_pretrained(dir, safe_serialization=True))."
        if found
        else ""
    )
    raise ModelError(f"{model_dir} has no safetensors weights (*.safetensors).{hint}")


def read_index(model_dir: Path) -> dict[str, str] | None:
    """The ``weight_map`` (tensor name → shard file) of a sharded checkpoint; None if the
    checkpoint is not sharded."""
    index = model_dir / INDEX_FILE
    if not index.is_file():
        return None
    try:
        content = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{index} is not valid JSON ({exc}); {AGAIN}") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and isinstance(shard, str) and shard
        for name, shard in weight_map.items()
    ):
        raise ModelError(
            f"{index} is not a valid safetensors index: it needs a 'weight_map' object "
            f"mapping each tensor name to its shard file; {AGAIN}"
        )
    if not weight_map:
        raise ModelError(f"{index} lists no tensors (its 'weight_map' is empty); {AGAIN}")
    return weight_map


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file holds, checked the way the safetensors library checks
    them (plus a readable message): a ModelError names the file and what is wrong."""
    size = path.stat().st_size
    if size == 0:
        raise ModelError(f"{path} is empty (0 bytes); {AGAIN}")
    with path.open("rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise ModelError(
                f"{path} has only {size} bytes, too few for a safetensors file (which starts "
                f"with an 8-byte header length); {AGAIN}"
            )
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > size - 8 or header_bytes > MAX_HEADER_BYTES:
            raise ModelError(
                f"{path} is truncated or not a safetensors file: it announces a "
                f"{header_bytes:,}-byte header, but the whole file has {_bytes(size)}; {AGAIN}"
            )
        raw = file.read(header_bytes)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(
            f"{path} is damaged or not a safetensors file: its header is not valid JSON "
            f"({exc}); {AGAIN}"
        ) from None
    if not isinstance(header, dict):
        raise ModelError(
            f"{path} is damaged or not a safetensors file: its header is not a JSON object; {AGAIN}"
        )
    tensors: dict[str, TensorEntry] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name], span = _parse_entry(path, name, entry)
        spans.append((*span, name))
    data_end = _check_spans(path, sorted(spans))
    expected = 8 + header_bytes + data_end
    if size < expected:
        raise ModelError(
            f"{path} is truncated: it has {_bytes(size)}, but its header describes "
            f"{_bytes(expected)} (an interrupted download or copy?); {AGAIN}"
        )
    if size > expected:
        raise ModelError(
            f"{path} is damaged: it has {_bytes(size)}, {size - expected:,} more than the "
            f"{_bytes(expected)} its header describes; {AGAIN}"
        )
    return tensors


def _parse_entry(path: Path, name: str, entry: Any) -> tuple[TensorEntry, tuple[int, int]]:
    def damaged(what: str) -> ModelError:
        return ModelError(f"{path} is damaged: the header entry of {name!r} {what}; {AGAIN}")

    if not isinstance(entry, dict):
        raise damaged("is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise damaged(f"has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise damaged(f"has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise damaged(f"has invalid data_offsets {offsets!r}")
    tensor = TensorEntry(dtype, tuple(shape))
    bits = tensor.numel * DTYPE_BITS[dtype]
    if bits != 8 * (offsets[1] - offsets[0]):
        raise damaged(
            f"says {dtype} {list(shape)} ({bits / 8:,.0f} bytes) but spans "
            f"{offsets[1] - offsets[0]:,} bytes"
        )
    return tensor, (offsets[0], offsets[1])


def _check_spans(path: Path, spans: list[tuple[int, int, str]]) -> int:
    """Tensors must tile the data section without gaps or overlaps; returns its length."""
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise ModelError(
                f"{path} is damaged: the data of {name!r} starts at byte {begin:,} of the data "
                f"section, where {end:,} was expected (overlapping or missing data); {AGAIN}"
            )
        end = stop
    return end


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bytes(count: int) -> str:
    return f"{count:,} bytes"


def _missing_file(path: Path) -> str:
    if path.is_symlink():  # a Hugging Face cache link whose blob never arrived
        return f"{path.name} (a link to a missing file: an interrupted download?)"
    return path.name


def iter_weights(
    model_dir: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor, converted to ``dtype`` (floating tensors
    only) and placed on ``device``. A rich progress bar shows for large checkpoints.

    A GGUF file (or a directory holding one) yields the same Hugging Face names, its
    quantized blocks dequantized (``llmctl.model.gguf``)."""
    from llmctl.model.gguf import gguf_file, open_gguf

    if (gguf := gguf_file(model_dir)) is not None:
        yield from open_gguf(gguf).iter_weights(dtype, device)
        return
    files = safetensors_files(model_dir)
    handles = [_open(f) for f in files]
    names = [(handle, name) for handle in handles for name in handle.keys()]
    progress = _progress(len(files), len(names))
    task = progress.add_task(f"loading {len(files)} weight file(s)", total=len(names))
    with progress:
        for handle, name in names:
            tensor = handle.get_tensor(name)
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            yield name, tensor.to(device)
            progress.advance(task)


def load_weights(
    model_dir: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """All tensors of ``model_dir`` as a name → tensor dict (see ``iter_weights``)."""
    return dict(iter_weights(model_dir, dtype, device))


# (dim, start, stop): the part of a tensor a rank holds; None: the whole tensor.
SliceOf = Callable[[str, tuple[int, ...]], tuple[int, int, int] | None]


def load_weight_slices(
    model_dir: str | Path,
    slice_of: SliceOf,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Like ``load_weights``, but a tensor for which ``slice_of(name, shape)`` gives
    ``(dim, start, stop)`` is read only in that range along ``dim``: a tensor-parallel
    rank reads just its shard's bytes from the memory-mapped files, never the whole.
    A GGUF file is dequantized whole, tensor by tensor, and then sliced."""
    from llmctl.model.gguf import gguf_file, open_gguf

    if (gguf := gguf_file(model_dir)) is not None:
        weights = {}
        for name, tensor in open_gguf(gguf).iter_weights(dtype, "cpu"):
            where = slice_of(name, tuple(tensor.shape))
            if where is not None:
                dim, start, stop = where
                tensor = tensor.narrow(dim, start, stop - start).contiguous()
            weights[name] = tensor.to(device)
        return weights
    files = safetensors_files(model_dir)
    handles = [_open(f) for f in files]
    names = [(handle, name) for handle in handles for name in handle.keys()]
    weights = {}
    progress = _progress(len(files), len(names))
    task = progress.add_task(f"loading a shard of {len(files)} weight file(s)", total=len(names))
    with progress:
        for handle, name in names:
            part = handle.get_slice(name)
            where = slice_of(name, tuple(part.get_shape()))
            if where is None:
                tensor = handle.get_tensor(name)
            else:
                dim, start, stop = where
                tensor = part[(slice(None),) * dim + (slice(start, stop),)].contiguous()
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            weights[name] = tensor.to(device)
            progress.advance(task)
    return weights


def _open(path: Path) -> Any:
    """``safe_open`` with a damaged file reported by name (``read_header`` says how)."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own untyped errors
        read_header(path)  # raises the readable ModelError when it can tell what is wrong
        raise ModelError(f"{path} cannot be read by safetensors: {exc}; {AGAIN}") from None


def _progress(num_files: int, num_tensors: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        transient=True,
        disable=num_files < 2 and num_tensors < PROGRESS_MIN_TENSORS,
    )
