"""Every CUDA source of turbo compiles with nvcc for Ampere (sm_80) and Hopper (sm_90).

The .cu files include only CUDA headers, so this needs the CUDA toolkit but neither a
GPU nor a CUDA build of torch. Skipped, with the reason, where nvcc is absent.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from llmctl_turbo.build import CSRC

from llmctl.hardware import find_nvcc

CUDA_SOURCES = sorted((CSRC / "cuda").glob("*.cu"))


def test_cuda_sources_are_found():
    assert {p.name for p in CUDA_SOURCES} >= {"attention.cu", "elementwise.cu"}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_cu_file_compiles(source: Path, arch: str, tmp_path: Path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (install the CUDA toolkit or set CUDA_HOME)")
    result = subprocess.run(
        [
            nvcc,
            "-c",
            f"-arch={arch}",
            "-O3",
            "-Werror",
            "all-warnings",
            str(source),
            "-o",
            str(tmp_path / f"{source.stem}.o"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / f"{source.stem}.o").stat().st_size > 0
