"""turbo's CUDA kernels built for the CPU emulator and called, through their C ABI, on CPU
tensors.

``load()`` compiles every ``csrc/cuda/*.cu`` file as C++ with ``cuda_emulator.h``
force-included, links them with ``emulator.cpp`` (and ``fast_divmod_check.cpp``, a direct
check of one helper) into one shared library (cached under
llmctl's cache dir by a hash of the sources), and returns an ``EmulatedKernels`` whose
methods mirror what ``csrc/cuda_ops.cpp`` does around each C function (picking the
decode split count, allocating the workspace). Needs g++ and the CUDA headers (found
beside nvcc); neither a GPU nor a CUDA build of torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from llmctl_turbo.build import CSRC

from llmctl.hardware import find_nvcc
from llmctl.paths import cache_dir

HERE = Path(__file__).resolve().parent
CUDA_DIR = CSRC / "cuda"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
H200_SMS = 132  # the split count is planned for this many SMs unless a test says otherwise


class EmulatorUnavailable(RuntimeError):
    pass


def cuda_include_dir() -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        raise EmulatorUnavailable("nvcc not found: the emulator needs the CUDA toolkit's headers")
    include = Path(nvcc).resolve().parent.parent / "include"
    if not (include / "cuda_bf16.h").is_file():
        raise EmulatorUnavailable(f"no CUDA headers at {include}")
    return include


def _sources() -> list[Path]:
    return sorted(CUDA_DIR.glob("*.cu")) + [HERE / "emulator.cpp", HERE / "fast_divmod_check.cpp"]


def _library_path() -> Path:
    digest = hashlib.sha256()
    # The .cu files include gguf_types.h from CSRC too.
    for path in sorted(CUDA_DIR.iterdir()) + [CSRC / "gguf_types.h"] + sorted(HERE.glob("*.[ch]*")):
        digest.update(path.name.encode() + path.read_bytes())
    return cache_dir() / "turbo-emulator" / digest.hexdigest()[:16] / "libturbo_emulated.so"


def build() -> Path:
    library = _library_path()
    if library.is_file():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    flags = [
        "g++",
        "-std=c++17",
        "-O2",
        "-fPIC",
        "-fno-strict-aliasing",
        "-DTURBO_CUDA_EMULATOR",
        f"-I{cuda_include_dir()}",
        f"-I{HERE}",
        f"-I{CUDA_DIR}",
    ]

    def compile_one(source: Path) -> Path:
        obj = library.parent / f"{source.stem}.o"
        language = ["-include", "cuda_emulator.h", "-x", "c++"] if source.suffix == ".cu" else []
        command = [*flags, *language, "-c", str(source), "-o", str(obj)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"emulator build failed: {' '.join(command)}\n{done.stderr}")
        return obj

    with ThreadPoolExecutor(max_workers=2) as pool:
        objects = list(pool.map(compile_one, _sources()))
    partial = library.with_suffix(".partial")
    subprocess.run(
        ["g++", "-shared", "-o", str(partial), *map(str, objects)], check=True, capture_output=True
    )
    partial.rename(library)
    return library


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


class EmulatedKernels:
    """The C functions of ``csrc/cuda/turbo_cuda.h`` on CPU tensors (outputs preallocated by
    the caller, as the C++ binding does)."""

    def __init__(self, library: Path) -> None:
        self.lib = ctypes.CDLL(str(library))
        i64, i32, f32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        self.lib.turbo_emulator_last_error.restype = ctypes.c_char_p
        self.lib.turbo_emulator_fast_divmod_mismatches.argtypes = [ctypes.c_uint32] * 2
        self.lib.turbo_emulator_fast_divmod_mismatches.restype = i64
        self.lib.turbo_cuda_decode_num_splits.argtypes = [i64, i64, i64, i64, i32]
        self.lib.turbo_cuda_decode_workspace_bytes.argtypes = [i64, i64, i64, i32]
        self.lib.turbo_cuda_decode_workspace_bytes.restype = i64
        self.lib.turbo_cuda_paged_decode_attention.argtypes = (
            [i32, vp, i64, vp, i64, vp, vp, vp, i64, vp] + [i64] * 6 + [f32, i32, vp, i32, vp]
        )
        self.lib.turbo_cuda_paged_prefill_attention.argtypes = (
            [i32, vp, i64, vp, i64, vp, vp, vp, i64, vp, vp] + [i64] * 6 + [f32, vp]
        )
        self.lib.turbo_cuda_paged_attention.argtypes = (
            [i32, vp, i64, vp, i64, vp, vp, vp, i64, vp, vp] + [i64] * 6 + [f32, vp, vp, vp]
        )
        self.lib.turbo_cuda_rotary_write_kv.argtypes = [
            i32, vp, vp, i64, i64, vp, i64, vp, i64, i64, vp, vp, vp, vp, vp, vp, i64, i64, vp
        ]  # fmt: skip
        self.lib.turbo_cuda_write_kv_cache.argtypes = [
            i32, vp, i64, vp, i64, vp, vp, vp, vp, vp, i64, i64, i64, vp
        ]  # fmt: skip
        self.lib.turbo_cuda_rms_norm.argtypes = [
            i32,
            vp,
            i64,
            vp,
            i64,
            vp,
            i64,
            vp,
            i64,
            i64,
            f32,
            vp,
        ]
        self.lib.turbo_cuda_silu_and_mul.argtypes = [i32, vp, i64, vp, i64, i64, i64, vp]
        self.lib.turbo_cuda_int8_linear_vectorized.argtypes = [i32, vp, i64, vp, i64]
        self.lib.turbo_cuda_int8_linear.argtypes = [
            i32, vp, i64, vp, i64, vp, vp, vp, i64, i64, i64, vp
        ]  # fmt: skip
        self.lib.turbo_cuda_gguf_linear_vectorized.argtypes = [i32, vp, i64]
        self.lib.turbo_cuda_gguf_linear.argtypes = [
            i32, i64, vp, i64, vp, i64, vp, vp, i64, i64, i64, vp
        ]  # fmt: skip
        self.lib.turbo_cuda_gguf_dequantize.argtypes = [i32, i64, vp, vp, i64, i64, vp]
        self.lib.turbo_cuda_lora_shrink.argtypes = [
            i32, vp, i64, vp, i64, vp, vp, i64, i64, i64, i64, vp
        ]  # fmt: skip
        self.lib.turbo_cuda_lora_expand.argtypes = [
            i32, vp, i64, vp, i64, vp, vp, i64, i64, i64, i64, vp, vp, vp
        ]  # fmt: skip

    def _check(self, status: int, name: str) -> None:
        if status != 0:
            message = self.lib.turbo_emulator_last_error().decode()
            raise RuntimeError(f"{name} failed (cudaError {status}): {message}")

    def fast_divmod_mismatches(self, divisor: int, dense: int = 1 << 16) -> int:
        return self.lib.turbo_emulator_fast_divmod_mismatches(divisor, dense)

    def decode_num_splits(self, num_seqs, num_heads, num_kv_heads, max_context, sms=H200_SMS):
        return self.lib.turbo_cuda_decode_num_splits(
            num_seqs, num_heads, num_kv_heads, max_context, sms
        )

    def paged_decode_attention(
        self, out, q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None,
        tensor_cores: bool = True,
    ) -> int:  # fmt: skip
        """Returns the number of splits used. ``tensor_cores``: the mma kernel for bf16 and
        fp16 (fp32 always runs the SIMT one), as the binding picks on sm_80+."""
        num_seqs, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        max_context = block_tables.shape[1] * block_size
        splits = num_splits or self.decode_num_splits(
            num_seqs, num_heads, num_kv_heads, max_context
        )
        workspace_bytes = self.lib.turbo_cuda_decode_workspace_bytes(
            num_seqs, num_heads, head_dim, splits
        )
        # NaN-filled: a combine that reads a partial no split wrote shows up.
        workspace = torch.full((math.ceil(workspace_bytes / 4),), float("nan"))
        self._check(
            self.lib.turbo_cuda_paged_decode_attention(
                DTYPE_CODES[q.dtype], _ptr(out), out.stride(0), _ptr(q), q.stride(0),
                _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), block_tables.stride(0),
                _ptr(context_lens), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                max_context, scale, splits, _ptr(workspace), int(tensor_cores), None,
            ),
            "paged_decode_attention",
        )  # fmt: skip
        return splits

    def paged_prefill_attention(
        self, out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
        tensor_cores: bool = True, k_scale=None, v_scale=None,
    ) -> None:  # fmt: skip
        """``tensor_cores``: the mma kernel, else the SIMT one (the only one that reads an
        int8 cache, ``k_scale`` / ``v_scale`` its scales)."""
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        args = (
            DTYPE_CODES[q.dtype], _ptr(out), out.stride(0), _ptr(q), q.stride(0),
            _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), block_tables.stride(0),
            _ptr(query_start_loc), _ptr(context_lens), context_lens.shape[0], q.shape[0],
            q.shape[1], num_kv_heads, q.shape[2], block_size, scale,
        )  # fmt: skip
        if tensor_cores:
            status = self.lib.turbo_cuda_paged_prefill_attention(*args, None)
        else:
            status = self.lib.turbo_cuda_paged_attention(*args, _ptr(k_scale), _ptr(v_scale), None)
        self._check(status, "paged_prefill_attention")

    def rotary_write_kv(
        self, positions, q, k, v, cos_sin, k_cache, v_cache, slots, k_scale=None, v_scale=None
    ) -> None:
        self._check(
            self.lib.turbo_cuda_rotary_write_kv(
                DTYPE_CODES[q.dtype], _ptr(positions), _ptr(q), q.stride(0), q.shape[1],
                _ptr(k), k.stride(0), _ptr(v), v.stride(0), k.shape[1], _ptr(cos_sin),
                _ptr(k_cache), _ptr(v_cache), _ptr(slots), _ptr(k_scale), _ptr(v_scale),
                q.shape[0], q.shape[2], None,
            ),
            "rotary_write_kv",
        )  # fmt: skip

    def write_kv_cache(self, key, value, k_cache, v_cache, slots, k_scale=None, v_scale=None):
        """``key`` / ``value`` ``[T, KVH, D]``; an int8 cache with its scales, or a float one."""
        self._check(
            self.lib.turbo_cuda_write_kv_cache(
                DTYPE_CODES[key.dtype], _ptr(key), key.stride(0), _ptr(value), value.stride(0),
                _ptr(k_cache), _ptr(v_cache), _ptr(slots), _ptr(k_scale), _ptr(v_scale),
                key.shape[0], key.shape[1], key.shape[2], None,
            ),
            "write_kv_cache",
        )  # fmt: skip

    def rms_norm(self, out, x, weight, eps, residual=None) -> None:
        self._check(
            self.lib.turbo_cuda_rms_norm(
                DTYPE_CODES[x.dtype], _ptr(out), out.stride(0), _ptr(x), x.stride(0),
                _ptr(residual), 0 if residual is None else residual.stride(0), _ptr(weight),
                x.shape[0], x.shape[1], eps, None,
            ),
            "rms_norm",
        )  # fmt: skip

    def silu_and_mul(self, out, gate_up) -> None:
        self._check(
            self.lib.turbo_cuda_silu_and_mul(
                DTYPE_CODES[out.dtype], _ptr(out), out.stride(0), _ptr(gate_up),
                gate_up.stride(0), out.shape[0], out.shape[1], None,
            ),
            "silu_and_mul",
        )  # fmt: skip

    def int8_linear(self, out, x, weight, scale, bias=None) -> bool:
        """Returns whether the kernel took its 16-byte weight runs."""
        args = (DTYPE_CODES[x.dtype], _ptr(x), x.stride(0), _ptr(weight), x.shape[1])
        vectorized = bool(self.lib.turbo_cuda_int8_linear_vectorized(*args))
        self._check(
            self.lib.turbo_cuda_int8_linear(
                DTYPE_CODES[x.dtype], _ptr(out), out.stride(0), _ptr(x), x.stride(0),
                _ptr(weight), _ptr(scale), _ptr(bias), x.shape[0], weight.shape[0],
                x.shape[1], None,
            ),
            "int8_linear",
        )  # fmt: skip
        return vectorized

    def gguf_linear(self, out, x, weight, ggml_type: int, bias=None) -> bool:
        """``weight``: a GGUF matrix's rows (uint8 ``[out, row bytes]``) of ``ggml_type``.
        Returns whether the kernel read x 4 elements at a time."""
        dtype = DTYPE_CODES[x.dtype]
        vectorized = bool(self.lib.turbo_cuda_gguf_linear_vectorized(dtype, _ptr(x), x.stride(0)))
        self._check(
            self.lib.turbo_cuda_gguf_linear(
                dtype, ggml_type, _ptr(out), out.stride(0), _ptr(x), x.stride(0), _ptr(weight),
                _ptr(bias), x.shape[0], weight.shape[0], x.shape[1], None,
            ),
            "gguf_linear",
        )  # fmt: skip
        return vectorized

    def gguf_dequantize(self, out, weight, ggml_type: int) -> None:
        """``out``: the contiguous ``[out, in]`` matrix the rows ``weight`` dequantize to."""
        self._check(
            self.lib.turbo_cuda_gguf_dequantize(
                DTYPE_CODES[out.dtype], ggml_type, _ptr(out), _ptr(weight), out.shape[0],
                out.shape[1], None,
            ),
            "gguf_dequantize",
        )  # fmt: skip

    def lora_add(self, out, x, a, bt, out_offsets, sizes, slots) -> None:
        """What the binding's ``lora_add_slots`` does: shrink into a float32 ``h [rows,
        parts x rank]`` (NaN-filled here: an expand that read a row the shrink left out
        shows up), then expand into ``out``'s parts. ``slots`` int32 ``[rows]``."""
        rows, hr = x.shape[0], a.shape[1]
        h = torch.full((rows, hr), float("nan"))
        self._check(
            self.lib.turbo_cuda_lora_shrink(
                DTYPE_CODES[x.dtype], _ptr(h), h.stride(0), _ptr(x), x.stride(0), _ptr(a),
                _ptr(slots), a.shape[0], rows, hr, x.shape[1], None,
            ),
            "lora_shrink",
        )  # fmt: skip
        offsets = (ctypes.c_int64 * len(sizes))(*out_offsets)
        widths = (ctypes.c_int64 * len(sizes))(*sizes)
        self._check(
            self.lib.turbo_cuda_lora_expand(
                DTYPE_CODES[out.dtype], _ptr(out), out.stride(0), _ptr(h), h.stride(0),
                _ptr(bt), _ptr(slots), bt.shape[0], rows, bt.shape[1], len(sizes), offsets,
                widths, None,
            ),
            "lora_expand",
        )  # fmt: skip


def load() -> EmulatedKernels:
    return EmulatedKernels(build())
