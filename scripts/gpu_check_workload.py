"""The end-to-end section of ``scripts/gpu_check.py``: the reference throughput workload.

``workload_section(device, dry_run)`` returns ``(passed, markdown)``. It runs
``llmctl bench throughput``'s workload (128 prompts, input 32:512, output 32:256, seed
0, greedy with ignore_eos) on the 723.6M random Llama in bf16 through turbo and torch,
and transformers once (batch 64, beside torch), and reports per engine:

- output tokens/s (the bench's own figure) and the ratio to transformers;
- time per engine step at the full batch (decode steps with at least 90% of the largest
  batch seen), and of that the model call: ``runner.execute``, waited for with a device
  synchronisation (the sampler right after waits for the logits anyway);
- GPU busy share (turbo, in a second, profiled run): the time covered by at least one
  kernel over the wall time, for the whole run and for its steady decode (from the
  first full-batch decode step to the last), from the torch profiler's kernel events on
  the same clock as the steps' ``record_function`` ranges.

Goals (issue 12, H200): turbo >= 12,000 output tokens/s and GPU busy >= 85% in steady
decode. They are reported, not failed on: the section fails only when a run fails.
With ``dry_run`` (no GPU): a tiny model and four prompts on the CPU; numbers mean
nothing.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

from gpu_check_graphs import reference_llama  # scripts/ is on sys.path

WORKLOAD = dict(num_prompts=128, input_len=(32, 512), output_len=(32, 256), seed=0)
DRY_RUN_WORKLOAD = dict(num_prompts=4, input_len=(4, 12), output_len=(4, 8), seed=0)
BASELINE_BATCH = 64
GOAL_TOKENS_PER_S = 12_000
GOAL_BUSY = 0.85
FULL_BATCH = 0.9  # a step counts as "full batch" at this share of the largest batch seen


@dataclass
class StepLog:
    """Per engine step: wall seconds, seconds in the model call, sequences, decode?"""

    steps: list[tuple[float, float, int, bool]] = field(default_factory=list)

    def full_batch_decode(self) -> list[tuple[float, float, int, bool]]:
        decode = [s for s in self.steps if s[3]]
        if not decode:
            return []
        largest = max(s[2] for s in decode)
        return [s for s in decode if s[2] >= FULL_BATCH * largest]


@contextlib.contextmanager
def recording_steps(log: StepLog, device: str, mark_steps: bool = False):
    """Times every ``LLMEngine.step`` and the model call inside it (measurement only: the
    methods are wrapped for the duration of the block). ``mark_steps`` also wraps each
    step in a profiler range named ``llmctl_step:<decode|mixed>:<num_seqs>``."""
    import torch

    from llmctl.engine.llm_engine import LLMEngine

    original_step = LLMEngine.step
    current: dict = {}

    def step(self, before_model=None):
        runner = self.runner
        if "execute" not in vars(runner):  # wrap this engine's runner once
            execute = runner.execute

            def timed_execute(batch):
                started = time.perf_counter()
                logits = execute(batch)
                if device == "cuda":
                    torch.cuda.synchronize()
                current.update(model_s=time.perf_counter() - started, seqs=batch.num_seqs,
                               decode=batch.is_decode)  # fmt: skip
                return logits

            runner.execute = timed_execute
        current.clear()
        started = time.perf_counter()
        if mark_steps:
            with torch.profiler.record_function("llmctl_step"):
                outputs = original_step(self, before_model)
        else:
            outputs = original_step(self, before_model)
        log.steps.append(  # every step, so the log lines up with the profiled ranges
            (time.perf_counter() - started, current.get("model_s", 0.0),
             current.get("seqs", 0), current.get("decode", False))
        )  # fmt: skip
        return outputs

    LLMEngine.step = step
    try:
        yield log
    finally:
        LLMEngine.step = original_step


def run_engine(model_dir, backend: str, device: str, spec, baseline: bool, dtype: str):
    from llmctl.bench.throughput import benchmark_throughput

    flags = {"backend": backend, "device": device, "dtype": dtype}
    log = StepLog()
    with recording_steps(log, device):
        report = benchmark_throughput(
            str(model_dir), flags, spec, baseline_batch_size=BASELINE_BATCH if baseline else None
        )
    return report, log


def busy_share(model_dir, device: str, spec, dtype: str) -> tuple[float, float, float]:
    """(whole run, steady decode, output tokens/s under the profiler) for turbo."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from llmctl.bench.throughput import benchmark_throughput

    log = StepLog()
    flags = {"backend": "turbo", "device": device, "dtype": dtype}
    with recording_steps(log, device, mark_steps=True):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            report = benchmark_throughput(str(model_dir), flags, spec)
    events = prof.events()
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    steps = [e for e in events if e.name == "llmctl_step"]
    if not kernels or not steps:
        return float("nan"), float("nan"), report["engine"]["output_tokens_per_s"]
    # The profiled steps in order, matched to the log's; the steady window spans the
    # full-batch decode steps.
    steps.sort(key=lambda e: e.time_range.start)
    full = {id(s) for s in log.full_batch_decode()}
    steady = [e for e, s in zip(steps, log.steps) if id(s) in full]
    whole = (steps[0].time_range.start, steps[-1].time_range.end)
    window = (steady[0].time_range.start, steady[-1].time_range.end) if steady else whole
    return (
        covered(kernels, *whole) / (whole[1] - whole[0]),
        covered(kernels, *window) / (window[1] - window[0]),
        report["engine"]["output_tokens_per_s"],
    )


def covered(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of [start, end] covered by at least one of the (sorted) intervals."""
    total, reach = 0.0, start
    for lo, hi in intervals:
        lo, hi = max(lo, reach), min(hi, end)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total


def workload_section(device: str, dry_run: bool) -> tuple[bool, str]:
    from llmctl.bench.throughput import WorkloadSpec
    from llmctl.bench.workload import LengthRange

    shape = DRY_RUN_WORKLOAD if dry_run else WORKLOAD
    spec = WorkloadSpec(
        shape["num_prompts"], LengthRange(*shape["input_len"]), LengthRange(*shape["output_len"]),
        shape["seed"],
    )  # fmt: skip
    dtype = "float32" if dry_run else "bfloat16"
    started = time.monotonic()
    model_dir = reference_llama(tiny=dry_run)
    rows, baseline = [], None
    results = {}
    for backend in ("turbo", "torch"):
        report, log = run_engine(model_dir, backend, device, spec, backend == "torch", dtype)
        results[backend] = report["engine"]["output_tokens_per_s"]
        baseline = report["baseline"] or baseline
        full = log.full_batch_decode()
        step_ms = statistics.median(s[0] for s in full) * 1e3 if full else float("nan")
        model_ms = statistics.median(s[1] for s in full) * 1e3 if full else float("nan")
        batch = max((s[2] for s in full), default=0)
        rows.append(
            f"| {backend} | {results[backend]:,.0f} | {report['engine']['duration_s']:.1f} | "
            f"{len(log.steps)} | {batch} | {step_ms:.2f} | {model_ms:.2f} |"
        )
    whole, steady, profiled_rate = busy_share(model_dir, device, spec, dtype)
    if baseline is not None:
        rows.append(
            f"| transformers (batch {BASELINE_BATCH}) | {baseline['output_tokens_per_s']:,.0f} | "
            f"{baseline['duration_s']:.1f} | | | | |"
        )
    turbo_rate = results["turbo"]
    ratio = (
        f" = {turbo_rate / baseline['output_tokens_per_s']:.1f}x transformers" if baseline else ""
    )
    goals = (
        f"- turbo: **{turbo_rate:,.0f}** output tokens/s{ratio}, "
        f"{turbo_rate / results['torch']:.2f}x torch (goal >= {GOAL_TOKENS_PER_S:,}: "
        f"**{'met' if turbo_rate >= GOAL_TOKENS_PER_S else 'NOT MET'}**)\n"
        f"- turbo GPU busy (profiled run, {profiled_rate:,.0f} tokens/s under the profiler): "
        f"whole run {whole:.0%}, steady decode **{steady:.0%}** (goal >= {GOAL_BUSY:.0%}: "
        f"**{'met' if steady >= GOAL_BUSY else 'NOT MET'}**)\n"
    )
    text = (
        "## 4. End to end: the reference throughput workload\n\n"
        f"`{model_dir.name}` ({dtype}), {shape['num_prompts']} prompts, input "
        f"{shape['input_len'][0]}:{shape['input_len'][1]}, output "
        f"{shape['output_len'][0]}:{shape['output_len'][1]}, seed {shape['seed']} (as "
        f"`llmctl bench throughput`); {time.monotonic() - started:.0f} s in all. Step times "
        f"are medians over decode steps with >= {FULL_BATCH:.0%} of the largest batch; "
        "the model call is `runner.execute` waited for.\n\n"
        + goals
        + "\n| engine | output tokens/s | run s | steps | full batch | ms/step | "
        "ms in model call |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    return True, text
