"""The cpu_threads option end to end: `--cpu-threads 1` runs each CPU backend with one
thread, and turbo's greedy tokens do not depend on how many threads share a step."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl import LLM, SamplingParams
from tests.helpers.cli import run_llmctl
from tests.helpers.tiny_models import hf_greedy, load_hf_model


@pytest.mark.parametrize("backend", ["turbo", "torch", "transformers"])
def test_cpu_threads_flag_reaches_the_engine(turbo_ops, stories_dir, tmp_path, backend):
    report_path = tmp_path / "report.json"
    result = run_llmctl(
        "bench", "throughput", str(stories_dir), "--backend", backend, "--device", "cpu",
        "--cpu-threads", "1", "--num-prompts", "3", "--input-len", "8:20", "--output-len",
        "6", "--output", str(report_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    assert report["settings"]["cpu_threads"] == 1
    assert report["machine"]["torch_threads"] == 1
    assert report["engine"]["output_tokens"] == 18


def test_backends_lists_the_thread_count_and_its_source(turbo_ops):
    result = run_llmctl("backends", env={"LLMCTL_CPU_THREADS": "3"})
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith(("│ turbo", "│ torch"))]
    assert len(rows) == 2 and all("3 (env" in row for row in rows)


def test_greedy_tokens_do_not_depend_on_the_thread_count(turbo_ops, tiny_model_dir):
    """More threads than cores: workers are descheduled mid-step and others take their
    share; the tokens must still be transformers' own."""
    model_dir = tiny_model_dir("llama3-rope")
    prompts = [[5 + (7 * i + 3 * j) % 500 for j in range(n)] for i, n in enumerate((3, 40, 17))]
    expected = hf_greedy(load_hf_model(model_dir), prompts, 16)
    params = SamplingParams(max_tokens=16, temperature=0)
    before = turbo_ops.cpu_threads(), torch.get_num_threads()  # cpu_threads sets both
    try:
        for threads in (1, 3):
            with LLM(
                str(model_dir), backend="turbo", device="cpu", dtype="float32",
                cpu_threads=threads,
            ) as llm:  # fmt: skip
                assert turbo_ops.cpu_threads() == threads
                assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        turbo_ops.set_cpu_threads(before[0])
        torch.set_num_threads(before[1])
