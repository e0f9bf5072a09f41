"""Check turbo's and the torch backend's GPU paths on an NVIDIA GPU; write a markdown report.

    python scripts/gpu_check.py             # on a CUDA machine, under 9 minutes
    python scripts/gpu_check.py --dry-run   # anywhere: tiny shapes, Triton interpreter

The parts, each recorded in ``docs/benchmarks/gpu_check_<date>.md``:

1. kernel tests: pytest on the Triton kernel and end-to-end tests, compiled natively;
2. end to end: stories260K's greedy tokens through the torch backend (``llmctl.LLM``,
   Triton attention) against transformers' (its ``reference_greedy.json``);
3. turbo (``gpu_check_turbo.py``): build, its CUDA kernel and CUDA-graph tests,
   stories260K end to end, its decode step eager vs graph;
   then the torch backend's decode as CUDA graphs, with verification steps of n-gram
   speculation and batches mixing LoRA adapters, graphs on vs off (``gpu_check_graphs.py``);
4. the reference throughput workload end to end for turbo, torch and transformers:
   tokens/s, step time, GPU busy share (``gpu_check_workload.py``);
5. decode bandwidth: paged decode attention, turbo's CUDA kernel beside the Triton
   kernel on the same inputs (bf16, head_dim 128, 32 query / 8 KV heads) over block
   sizes, batches and context lengths, as achieved GB/s of the bytes it must move
   (K/V, queries, outputs, block tables) and as a fraction of the device's measured
   copy bandwidth (``copy_bandwidth``). Goals: Triton >= 70% of copy bandwidth and
   turbo >= 3,500 GB/s at batch 64, context 4096, block size 64; turbo no slower than
   Triton in any cell. This part runs last and stops at ``--time-limit``.

Between 3 and 4, quantization: the int8 weight GEMM and int8 / fp8 KV-cache attention
(``gpu_check_quant.py``).

Exits non-zero when there is no CUDA GPU (unless ``--dry-run``) or when a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from gpu_check_graphs import graphs_section  # scripts/ is on sys.path when run as a script
from gpu_check_quant import quant_section, seconds_per_call
from gpu_check_turbo import turbo_section
from gpu_check_workload import workload_section

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260K"
KERNEL_TESTS = "tests/backends/torch/test_triton_kernels.py"
E2E_TESTS = "tests/backends/torch/test_triton_e2e.py"

GOAL = dict(block_size=64, batch=64, context=4096, fraction=0.70)
TURBO_GOAL_GBS = 3500.0  # turbo's decode at the GOAL point
PYTEST_WORKERS = 4  # with pytest-xdist installed (the GPU machine's image has it)
# turbo "no slower than Triton": ratios within this of 1 are timing noise.
NOISE = 0.03


@dataclass(frozen=True)
class BenchGrid:
    block_sizes: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    copy_bytes: int


GPU_GRID = BenchGrid(
    block_sizes=(32, 64, 128, 256),  # turbo on CUDA takes multiples of 32
    batches=(1, 16, 64, 256),
    contexts=(512, 2048, 4096, 8192),
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    copy_bytes=4 << 30,
)
DRY_RUN_GRID = BenchGrid(
    block_sizes=(32,),
    batches=(1, 2),
    contexts=(64, 128),
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    copy_bytes=64 << 20,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run every part on tiny shapes, on the CPU through the Triton interpreter "
        "when there is no GPU (checks the script, not the kernels' speed)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="report path (default docs/benchmarks/gpu_check_<date>.md; a temporary "
        "file with --dry-run)",
    )
    parser.add_argument(
        "--stories",
        type=Path,
        default=STORIES,
        help="the stories260K model directory with reference_greedy.json (default: %(default)s)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=480.0,
        help="seconds for the whole run; the bandwidth sweep (last) stops early to stay "
        "inside, after its goal point",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    start = time.monotonic()
    import torch

    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.dry_run:
        print(
            "gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False). Run it "
            "on a machine with an NVIDIA GPU, or use --dry-run to exercise the script here.",
            file=sys.stderr,
        )
        return 2
    if has_cuda:  # compiled kernels, even if the shell asked for the interpreter
        os.environ.pop("TRITON_INTERPRET", None)
    output = args.output or default_output(args.dry_run)
    sections = [header(torch, args.dry_run)]
    ok = True

    device = "cuda" if has_cuda else "cpu"
    grid = DRY_RUN_GRID if args.dry_run else GPU_GRID
    parts = [
        ("1. Kernel tests", run_kernel_tests, (args.dry_run,)),
        ("2. End to end", run_end_to_end, (args.stories, args.dry_run, device)),
        ("3. Turbo native kernels", turbo_section, (device, args.dry_run, run_pytest)),
        ("CUDA graphs (torch decode)", graphs_section, (device, args.dry_run, run_pytest)),
        ("3b. Quantization", quant_section, (device, args.dry_run, child_env())),
        ("4. Throughput workload", workload_section, (device, args.dry_run)),
        # Last: the sweep stops at the deadline, whatever is left.
        ("5. Decode attention bandwidth", run_bandwidth,
         (grid, device, start + args.time_limit, args.dry_run)),
    ]  # fmt: skip
    for name, part, part_args in parts:
        print(f"[{name}] ...", flush=True)
        try:
            passed, text = part(*part_args)
        except Exception:  # keep going: the report should say what broke
            passed = False
            text = f"## {name}\n\n**ERROR**\n\n```\n{traceback.format_exc()[-4000:]}\n```\n"
        ok &= passed
        sections.append(text)
        # After every part: a run cut off by its lease's limit still leaves its report.
        write_report(output, sections, "(report so far: the run is still going)\n")

    write_report(output, sections, f"Total time: {time.monotonic() - start:.0f} s.\n")
    print(f"report written to {output}")
    print("all checks passed" if ok else "SOME CHECKS FAILED (see the report)")
    return 0 if ok else 1


def write_report(output: Path, sections: list[str], footer: str) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join([*sections, footer]))


def default_output(dry_run: bool) -> Path:
    if dry_run:
        return Path(tempfile.gettempdir()) / "gpu_check_dry_run.md"
    today = datetime.date.today().isoformat()
    return REPO / "docs" / "benchmarks" / f"gpu_check_{today}.md"


def header(torch, dry_run: bool) -> str:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = (
            f"{props.name}, compute capability {props.major}.{props.minor}, "
            f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
        )
    else:
        device = f"CPU only ({platform.processor() or platform.machine()}): Triton interpreter"
    lines = [
        f"# GPU check {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
        + (" (dry run: tiny shapes, numbers mean nothing)" if dry_run else ""),
        "",
        f"- device: {device}",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, triton {version('triton')}, "
        f"python {platform.python_version()}",
        f"- command: `python scripts/gpu_check.py {' '.join(sys.argv[1:])}`",
        "",
    ]
    return "\n".join(lines)


def child_env() -> dict[str, str]:
    """The environment for child runs: compiled kernels wherever CUDA is present."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["LLMCTL_TORCH_ATTENTION"] = "triton"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_kernel_tests(dry_run: bool) -> tuple[bool, str]:
    if dry_run:  # the interpreter is slow: a few quick tests show the plumbing works
        selection = [KERNEL_TESTS, "-k", "write_kv or bad_inputs or splits_fill"]
    else:
        # everything but the wide kernel grid, whose many shapes would each compile
        selection = [KERNEL_TESTS, E2E_TESTS, "-m", "slow or not slow", "-k", "not wider_grid"]
    return run_pytest("## 1. Kernel tests", selection)


def run_pytest(title: str, selection: list[str], tail_lines: int = 25) -> tuple[bool, str]:
    """pytest on ``selection`` in a child process (compiled kernels, see ``child_env``):
    whether it passed, and a report section with the command and the log's tail."""
    # --all-slow: the GPU runs every case of a sampled parametrized test
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--all-slow"]
    command += selection
    if importlib.util.find_spec("xdist"):  # Triton's compiles are CPU work: spread them
        command[3:3] = ["-n", str(PYTEST_WORKERS)]
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300
        )
        passed, log = done.returncode == 0, done.stdout + done.stderr
    except subprocess.TimeoutExpired as timeout:  # its output comes back as bytes
        partial = (timeout.stdout or b"").decode(errors="replace")
        passed, log = False, f"timed out after {timeout.timeout} s\n{partial}"
    tail = "\n".join(log.strip().splitlines()[-tail_lines:])
    return passed, (
        f"{title}\n\n"
        f"`python {shlex.join(command[1:])}`: **{'passed' if passed else 'FAILED'}** "
        f"in {time.monotonic() - started:.0f} s\n\n```\n{tail}\n```\n"
    )


def run_end_to_end(model_dir: Path, dry_run: bool, device: str) -> tuple[bool, str]:
    """Greedy decoding through the whole torch backend against transformers' tokens."""
    import json

    title = "## 2. End to end: stories260K, torch backend, Triton attention\n\n"
    if not (model_dir / "reference_greedy.json").is_file():
        print(f"  stories260K not found at {model_dir}: skipped (see --stories)")
        return True, title + f"**SKIPPED**: no stories260K at {model_dir} (see `--stories`).\n"
    reference = json.loads((model_dir / "reference_greedy.json").read_text())
    bos = json.loads((model_dir / "config.json").read_text())["bos_token_id"]
    cases = [([bos], reference["from_bos_only"]["new_token_ids"])]
    cases += [(r["prompt_ids"], r["new_token_ids"]) for r in reference["results"]]
    if dry_run:
        cases = [(prompt, want[:2]) for prompt, want in cases[:2]]

    os.environ["LLMCTL_TORCH_ATTENTION"] = "triton"
    from llmctl import LLM, SamplingParams

    started = time.monotonic()
    with LLM(
        str(model_dir),
        backend="torch",
        device=device,
        dtype="float32",
        cache_block_seq_len=16,
        cache_max_entry_count=256,
    ) as llm:
        outputs = llm.generate(
            [prompt for prompt, _ in cases],
            [SamplingParams(max_tokens=len(want), temperature=0.0) for _, want in cases],
        )
    rows, passed = [], True
    for (prompt, want), out in zip(cases, outputs):
        same = list(out.token_ids) == list(want)
        passed &= same
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(out.token_ids, want)) if a != b),
            None if len(out.token_ids) == len(want) else min(len(out.token_ids), len(want)),
        )
        rows.append(
            f"| {prompt} | {len(want)} | {'yes' if same else 'NO'} | {'' if same else first_diff} |"
        )
    text = (
        title
        + f"float32, block size 16, {device}; {time.monotonic() - started:.1f} s. "
        + f"**{'All tokens match' if passed else 'MISMATCH'}.**\n\n"
        + "| prompt ids | new tokens | identical | first difference |\n|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )
    return passed, text


class Timer:
    """Seconds per call: CUDA events around a replayed CUDA graph on a GPU (no launch
    overhead in the number), the wall clock on the CPU."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __call__(self, fn, iterations: int) -> tuple[float, str]:
        import torch

        fn()  # warm up: compiles and autotunes
        if self.device != "cuda":
            started = time.perf_counter()
            for _ in range(iterations):
                fn()
            return (time.perf_counter() - started) / iterations, "wall clock"
        torch.cuda.synchronize()
        how = "CUDA graph"
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        except RuntimeError:  # capture refused: time plain launches instead
            run, how = fn, "launches"
        run()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iterations, how


def copy_bandwidth(num_bytes: int, device: str) -> tuple[float, str]:
    """The device's copy bandwidth (bytes read + written per second) and how it was found.

    A large buffer is copied back to back, timed with CUDA events around many launches
    (so neither one launch's latency nor a single copy's ramp-up counts): once with
    ``Tensor.copy_`` (cudaMemcpy, device to device) and once with an elementwise kernel
    (``torch.mul(src, 1, out=dst)`` on fp32, a read and a write per element, as a
    memory-bound kernel does). The reference is the faster of the two. (The first version
    of this check replayed one copy captured in a CUDA graph and got 2,770 GB/s on an
    H200 that copies at about 4,300.)
    """
    import torch

    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    iterations = 20 if device == "cuda" else 2

    def per_second(fn) -> float:
        return 2 * num_bytes / seconds_per_call(fn, device, iterations)

    memcpy = per_second(lambda: dst.copy_(src))
    kernel = per_second(lambda: torch.mul(src, 1.0, out=dst))
    how = (
        f"{num_bytes >> 20} MiB, {iterations} back-to-back launches timed with "
        f"{'CUDA events' if device == 'cuda' else 'the wall clock'}: "
        f"`copy_` (cudaMemcpy) {memcpy / 1e9:,.0f} GB/s, elementwise kernel "
        f"{kernel / 1e9:,.0f} GB/s; the faster is the reference"
    )
    return max(memcpy, kernel), how


def turbo_decode():
    """turbo's paged decode op where it is built with CUDA kernels (without a GPU, for
    --dry-run, its CPU op stands in); else ``None``, and the table shows Triton alone."""
    try:
        from llmctl_turbo.build import build_spec, load_ops

        ops = load_ops()
    except Exception:  # turbo's own section reports why it did not build
        return None
    import torch

    return (
        ops.paged_decode_attention
        if build_spec().with_cuda or not torch.cuda.is_available()
        else None
    )


def run_bandwidth(grid: BenchGrid, device: str, deadline: float, dry_run: bool) -> tuple[bool, str]:
    import torch
    from llmctl_torch.triton_attention import paged_decode_attention, plan_splits

    timer = Timer(device)
    copy_bw, copy_how = copy_bandwidth(grid.copy_bytes, device)
    turbo = turbo_decode()
    dtype = torch.bfloat16
    max_tokens = max(grid.batches) * max(grid.contexts)
    gen = torch.Generator(device=device).manual_seed(0)
    # One pool of K/V tokens, viewed as blocks of each size in turn.
    kv_shape = (max_tokens, grid.num_kv_heads, grid.head_dim)
    k_pool = torch.empty(kv_shape, dtype=dtype, device=device).normal_(generator=gen)
    v_pool = torch.empty(kv_shape, dtype=dtype, device=device).normal_(generator=gen)
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 0

    points = [
        (bs, b, ctx) for bs in grid.block_sizes for b in grid.batches for ctx in grid.contexts
    ]
    goal = (GOAL["block_size"], GOAL["batch"], GOAL["context"])
    if goal in points:  # measured first, deadline or not, so it is always in the report
        points.remove(goal)
        points.insert(0, goal)
    results: dict[tuple[int, int, int], dict] = {}
    skipped = 0
    for block_size, batch, context in points:
        if results and time.monotonic() > deadline:
            skipped += 1
            continue
        blocks_per_seq = context // block_size
        k_cache = k_pool.view(-1, block_size, grid.num_kv_heads, grid.head_dim)
        v_cache = v_pool.view(-1, block_size, grid.num_kv_heads, grid.head_dim)
        order = torch.randperm(k_cache.shape[0], device=device, generator=gen)
        tables = order[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, grid.num_heads, grid.head_dim, dtype=dtype, device=device)
        args = (q, k_cache, v_cache, tables, lens, grid.head_dim**-0.5)
        iterations = 20 if not dry_run else 2
        kv_bytes = 2 * batch * context * grid.num_kv_heads * grid.head_dim * dtype.itemsize
        moved = kv_bytes + 2 * q.numel() * dtype.itemsize + tables.numel() * 4
        seconds, how = timer(functools.partial(paged_decode_attention, *args), iterations)
        splits, _ = plan_splits(batch * grid.num_kv_heads, context, torch.device(device))
        cell = dict(triton=moved / seconds, splits=splits, how=how, turbo=None)
        if turbo is not None:
            out = torch.empty_like(q)
            turbo_seconds, _ = timer(functools.partial(turbo, out, *args), iterations)
            cell["turbo"] = moved / turbo_seconds
        results[(block_size, batch, context)] = cell
        del tables, order
    del k_pool, v_pool
    return summarize_bandwidth(grid, results, copy_bw, copy_how, l2_bytes, skipped, dry_run)


def summarize_bandwidth(
    grid, results, copy_bw, copy_how, l2_bytes, skipped, dry_run
) -> tuple[bool, str]:
    lines = [
        "## 5. Decode attention bandwidth: turbo CUDA beside Triton\n",
        f"bf16, head_dim {grid.head_dim}, {grid.num_heads} query heads over "
        f"{grid.num_kv_heads} KV heads, every sequence at the full context, blocks "
        "shuffled across the cache, both kernels on the same inputs. Bytes = K/V read + "
        "queries + outputs + block tables. Copy bandwidth (the reference): "
        f"**{copy_bw / 1e9:,.0f} GB/s** ({copy_how}).",
        "",
    ]
    goal_key = (GOAL["block_size"], GOAL["batch"], GOAL["context"])
    passed = True
    goal_text = f"batch {GOAL['batch']}, context {GOAL['context']}, block size {GOAL['block_size']}"
    if goal_key in results and not dry_run:
        cell = results[goal_key]
        achieved = cell["triton"] / copy_bw
        passed = achieved >= GOAL["fraction"]
        lines.append(
            f"**Goal, Triton** ({goal_text}): {cell['triton'] / 1e9:,.0f} GB/s = "
            f"**{achieved:.0%}** of copy bandwidth (target {GOAL['fraction']:.0%}): "
            f"**{'met' if passed else 'NOT MET'}**.\n"
        )
        if cell["turbo"] is not None:
            met = cell["turbo"] >= TURBO_GOAL_GBS * 1e9
            lines.append(
                f"**Goal, turbo** ({goal_text}): **{cell['turbo'] / 1e9:,.0f} GB/s** = "
                f"{cell['turbo'] / copy_bw:.0%} of copy bandwidth (target "
                f"{TURBO_GOAL_GBS:,.0f} GB/s): **{'met' if met else 'NOT MET'}**.\n"
            )
    compared = [c for c in results.values() if c["turbo"] is not None]
    if compared:
        slower = [
            key for key, c in results.items()
            if c["turbo"] is not None and c["turbo"] < (1 - NOISE) * c["triton"]
        ]  # fmt: skip
        worst = min(c["turbo"] / c["triton"] for c in compared)
        lines.append(
            f"**Goal, turbo no slower than Triton in any cell**: "
            f"**{'met' if not slower else 'NOT MET'}** (lowest turbo/Triton "
            f"{worst:.2f}; cells more than {NOISE:.0%} slower: "
            f"{', '.join(f'block {b} batch {n} context {c}' for b, n, c in slower) or 'none'}"
            ").\n"
        )
    hows = sorted({c["how"] for c in results.values()})
    lines.append(
        f"Timed by: {', '.join(hows)}. Cells: turbo GB/s / Triton GB/s (turbo / Triton; "
        "turbo as a fraction of copy bandwidth). The turbo and Triton goals are reported; "
        "only Triton's counts toward this part passing."
    )
    if l2_bytes:
        lines.append(
            f"Cells marked * read less than twice the {l2_bytes >> 20} MiB L2 cache, which "
            "may serve repeated runs: their numbers can exceed memory bandwidth."
        )
    lines.append("")
    for block_size in grid.block_sizes:
        lines.append(f"### block size {block_size}\n")
        lines.append("| batch \\ context | " + " | ".join(str(c) for c in grid.contexts) + " |")
        lines.append("|---" * (len(grid.contexts) + 1) + "|")
        for batch in grid.batches:
            cells = []
            for context in grid.contexts:
                cell = results.get((block_size, batch, context))
                if cell is None:
                    cells.append("skipped")
                    continue
                kv = 2 * batch * context * grid.num_kv_heads * grid.head_dim * 2
                mark = "*" if kv < 2 * l2_bytes else ""
                triton = f"{cell['triton'] / 1e9:,.0f}"
                if cell["turbo"] is None:
                    cells.append(f"- / {triton}{mark} s={cell['splits']}")
                else:
                    cells.append(
                        f"{cell['turbo'] / 1e9:,.0f} / {triton}{mark} "
                        f"({cell['turbo'] / cell['triton']:.2f}; "
                        f"{cell['turbo'] / copy_bw:.0%}) s={cell['splits']}"
                    )
            lines.append(f"| {batch} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("`s=` is the number of split-K splits of the Triton kernel.\n")
    lines.append(tuned_configs())
    if skipped:
        lines.append(f"\n{skipped} points skipped to stay inside the time limit.")
    return passed, "\n".join(lines) + "\n"


def tuned_configs() -> str:
    """The tile sizes and launch settings the autotuner picked for each decode shape."""
    from llmctl_torch.triton_attention import _decode_kernel

    cache = getattr(_decode_kernel, "cache", {})
    if not cache:
        return "Autotuning: a single configuration (interpreter).\n"
    lines = [
        "Decode configs picked by the autotuner (key: group pad, head_dim pad, block size, "
        "split, tokens per split, dtypes):",
        "",
    ]
    lines += [f"- `{key}`: {config}" for key, config in sorted(cache.items(), key=str)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
