"""Build turbo's native ops on first use and load them into this process.

The C++ sources in ``csrc/`` are compiled with ``torch.utils.cpp_extension.load`` into
``cache_dir()/turbo/<key>/``, where the key hashes everything the binary depends on:
the sources, torch and Python versions, the compiler and the flags. The binary is not
tied to this CPU: the CPU kernels are compiled for AVX-512, AVX2 and portable code and
pick one at run time (``csrc/cpu/isa.h``). The compile runs in a child process whose
whole output goes to ``build.log`` beside the library, under a file lock so that
concurrent processes build once. A failed build is remembered for its key, so later checks answer at once;
``prepare`` (``llmctl backends build turbo``) tries again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from llmctl.errors import BackendError
from llmctl.hardware import Hardware, find_cxx_compiler, find_nvcc
from llmctl.paths import cache_dir

LIBRARY_NAME = "llmctl_turbo_ops"
CSRC = Path(__file__).resolve().parent / "csrc"
CPU_SOURCES = (
    "kernels.cpp",
    "cpu_kernels.cpp",
    "cpu/isa.cpp",
    "cpu/thread_pool.cpp",
    "checks.cpp",
    "llama_step.cpp",
    "ops.cpp",
)
CUDA_SOURCES = (
    "cuda_ops.cpp",
    "cuda/decode_attention.cu",
    "cuda/prefill_attention.cu",
    "cuda/simt_attention.cu",
    "cuda/elementwise.cu",
    "cuda/int8_linear.cu",
    "cuda/gguf_linear.cu",
    "cuda/lora.cu",
)
# -fno-trapping-math lets loops with a clamp or a max vectorise; results are unchanged.
# -ffp-contract=fast lets a multiply and an add become one FMA (the ISO modes forbid it).
# No -march: wider instruction sets are enabled per function (csrc/cpu_kernels.cpp).
CXX_FLAGS = ("-O3", "-fno-trapping-math", "-ffp-contract=fast")
CUDA_FLAGS = ("-O3",)
BUILD_LOG = "build.log"
FAILED_MARKER = "FAILED"  # holds the reason of a failed build
BUILT_MARKER = "BUILT"  # written last: a build killed half-way never counts as done
SPINNER_TEXT = "building turbo native ops (first use, ~30 s)…"

_loaded_library: Path | None = None


@dataclass(frozen=True)
class BuildSpec:
    """Everything a build depends on; its hash names the build directory."""

    sources_sha256: str
    torch_version: str
    python_version: str
    compiler: str
    cxx_flags: tuple[str, ...]
    cuda_version: str | None  # None: a CPU-only build

    @property
    def with_cuda(self) -> bool:
        return self.cuda_version is not None

    @property
    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def directory(self) -> Path:
        return cache_dir() / "turbo" / self.key

    @property
    def library(self) -> Path:
        return self.directory / f"{LIBRARY_NAME}.so"

    @property
    def log(self) -> Path:
        return self.directory / BUILD_LOG

    @property
    def is_built(self) -> bool:
        return (self.directory / BUILT_MARKER).is_file()

    def sources(self) -> list[Path]:
        names = CPU_SOURCES + (CUDA_SOURCES if self.with_cuda else ())
        return [CSRC / name for name in names]

    def cxx_flags_with_defines(self) -> list[str]:
        return list(self.cxx_flags) + (["-DLLMCTL_TURBO_CUDA"] if self.with_cuda else [])


def build_spec(hardware: Hardware | None = None) -> BuildSpec:
    """The build for this machine. CUDA kernels are built in only where they can run:
    a GPU is present, nvcc is installed and torch itself is a CUDA build."""
    hardware = hardware or Hardware.probe()
    cuda_version = None
    if hardware.cuda_available and (hardware.nvcc or find_nvcc()):
        import torch

        cuda_version = torch.version.cuda
    return BuildSpec(
        sources_sha256=_hash_sources(),
        torch_version=importlib.metadata.version("torch"),
        python_version=platform.python_version(),
        compiler=hardware.cxx_compiler or find_cxx_compiler() or "none",
        cxx_flags=CXX_FLAGS,
        cuda_version=cuda_version,
    )


def build_problem(hardware: Hardware) -> str | None:
    """None when the native ops are built (building them now if needed), else why not."""
    spec = build_spec(hardware)
    return _ensure_built(spec, force=False)


def prepare(hardware: Hardware) -> str:
    """Build ahead of time, retrying a build that failed before; a one-line summary.

    Raises ``BackendError`` with the reason (and the build log's path) if the build fails.
    """
    spec = build_spec(hardware)
    if spec.is_built:
        return f"turbo native ops already built: {spec.library}"
    started = time.monotonic()
    problem = _ensure_built(spec, force=True)
    if problem:
        raise BackendError(problem)
    return f"built turbo native ops in {time.monotonic() - started:.0f} s: {spec.library}"


def load_ops(hardware: Hardware | None = None):
    """Build if needed, load the library once per process, return ``torch.ops.llmctl_turbo``."""
    global _loaded_library
    import torch

    if _loaded_library is None:
        spec = build_spec(hardware)
        problem = _ensure_built(spec, force=False)
        if problem:
            raise BackendError(problem)
        # A namespace can be registered once per process: the first library loaded wins.
        torch.ops.load_library(str(spec.library))
        _loaded_library = spec.library
    return torch.ops.llmctl_turbo


def _ensure_built(spec: BuildSpec, force: bool) -> str | None:
    failed = spec.directory / FAILED_MARKER
    if spec.is_built:
        return None
    if failed.exists() and not force:
        return failed.read_text()
    spec.directory.mkdir(parents=True, exist_ok=True)
    with _file_lock(spec.directory.with_suffix(".lock")):
        # Another process may have finished (or failed) while we waited for the lock.
        if spec.is_built:
            return None
        if failed.exists() and not force:
            return failed.read_text()
        failed.unlink(missing_ok=True)
        reason = _compile_in_child(spec)
        if reason:
            failed.write_text(reason)
        return reason


def _compile_in_child(spec: BuildSpec) -> str | None:
    """Compile in a child process, its output into the build log; the failure reason."""
    from rich.console import Console

    request = {
        "name": LIBRARY_NAME,
        "sources": [str(p) for p in spec.sources()],
        "extra_cflags": spec.cxx_flags_with_defines(),
        "extra_cuda_cflags": list(CUDA_FLAGS),
        "build_directory": str(spec.directory),
        "with_cuda": spec.with_cuda,
    }
    command = [sys.executable, "-m", "llmctl_turbo.build", json.dumps(request)]
    started = time.monotonic()
    with spec.log.open("w") as log, Console(stderr=True).status(SPINNER_TEXT):
        log.write(f"build key {spec.key}: {json.dumps(asdict(spec), indent=2)}\n")
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
        log.write(f"\nexit status {result.returncode} after {time.monotonic() - started:.1f} s\n")
    if result.returncode == 0 and spec.library.is_file():
        (spec.directory / BUILT_MARKER).touch()
        return None
    return (
        f"building turbo's native ops failed (exit status {result.returncode}); "
        f"see the build log {spec.log}; retry with `llmctl backends build turbo`"
    )


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _hash_sources() -> str:
    digest = hashlib.sha256()
    for path in sorted(CSRC.rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(CSRC)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _child_main(request_json: str) -> None:
    """Entry point of the build child: compile, printing everything to stdout."""
    from torch.utils.cpp_extension import load

    request = json.loads(request_json)
    os.makedirs(request["build_directory"], exist_ok=True)
    load(**request, is_python_module=False, verbose=True)


if __name__ == "__main__":
    _child_main(sys.argv[1])
