"""Load a model's safetensors weights: one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Tensors are read through ``safe_open`` (memory-mapped),
one at a time, converted to the dtype asked for.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from llmctl.errors import ModelError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Show a progress bar only when loading takes long enough to be worth watching.
PROGRESS_MIN_TENSORS = 200


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of ``model_dir``, in shard order."""
    from llmctl.engine.demo import ensure_demo_materialized

    model_dir = Path(model_dir)
    ensure_demo_materialized(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelError(f"{index} is not a valid safetensors index ({exc})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelError(
                f"{model_dir}: shards listed in {INDEX_FILE} are missing: {', '.join(missing)}"
            )
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    others = sorted(model_dir.glob("*.safetensors"))
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


def iter_weights(
    model_dir: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor, converted to ``dtype`` (floating tensors
    only) and placed on ``device``. A rich progress bar shows for large checkpoints."""
    files = safetensors_files(model_dir)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
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
    rank reads just its shard's bytes from the memory-mapped files, never the whole."""
    files = safetensors_files(model_dir)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
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


def _progress(num_files: int, num_tensors: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        transient=True,
        disable=num_files < 2 and num_tensors < PROGRESS_MIN_TENSORS,
    )
