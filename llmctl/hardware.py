"""Facts about this machine that backends check against (GPU, compiler, CPU, memory)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """What a backend may need to know to decide whether it can run here.

    Tests build these by hand to inject any machine; ``probe()`` reads the real one.
    """

    cuda_available: bool = False
    gpu_name: str | None = None
    compute_capability: tuple[int, int] | None = None
    gpu_memory_bytes: int | None = None
    torch_cuda_version: str | None = None
    cxx_compiler: str | None = None
    nvcc: str | None = None
    cpu_count: int = 1
    memory_bytes: int = 0

    @classmethod
    def probe(cls) -> Hardware:
        """Read this machine. Imports torch (if installed) to ask about CUDA."""
        cuda = False
        name = capability = gpu_memory = cuda_version = None
        try:
            import torch

            cuda_version = torch.version.cuda
            cuda = torch.cuda.is_available()
            if cuda:
                props = torch.cuda.get_device_properties(0)
                name = props.name
                capability = (props.major, props.minor)
                gpu_memory = props.total_memory
        except ImportError:
            pass
        return cls(
            cuda_available=cuda,
            gpu_name=name,
            compute_capability=capability,
            gpu_memory_bytes=gpu_memory,
            torch_cuda_version=cuda_version,
            cxx_compiler=find_cxx_compiler(),
            nvcc=find_nvcc(),
            cpu_count=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1,
            memory_bytes=total_memory_bytes(),
        )

    def device_for(self, requested: str) -> str:
        """The device the ``device`` option names here: ``auto`` is CUDA when available."""
        if requested == "auto":
            return "cuda" if self.cuda_available else "cpu"
        return requested

    def describe(self) -> str:
        gpu = (
            f"{self.gpu_name} (compute capability {self.compute_capability[0]}."
            f"{self.compute_capability[1]})"
            if self.cuda_available and self.compute_capability
            else "no CUDA GPU"
        )
        return (
            f"{gpu}; {self.cpu_count} CPU cores; {self.memory_bytes / 2**30:.1f} GiB RAM; "
            f"C++ compiler: {self.cxx_compiler or 'none'}; nvcc: {self.nvcc or 'none'}"
        )


def find_cxx_compiler() -> str | None:
    """The C++ compiler torch's extension builder would use ($CXX, else c++/g++/clang++)."""
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and (path := shutil.which(candidate)):
            return path
    return None


def find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory_bytes() -> int:
    """Memory the OS could give us now (MemAvailable), falling back to total memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return total_memory_bytes()
