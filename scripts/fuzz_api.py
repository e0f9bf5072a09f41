"""Fuzz the server's published API contract with schemathesis, every check on.

    python scripts/fuzz_api.py                      # starts llmctl serve on stories260K
    python scripts/fuzz_api.py --max-examples 400   # a longer run (>= 2,000 cases)
    python scripts/fuzz_api.py --url http://127.0.0.1:8000 --api-key KEY

schemathesis reads /openapi.json, generates valid and invalid requests from it (its
coverage and fuzzing phases) and checks every answer: no 5xx, statuses, headers,
content types and bodies as documented, invalid data refused, valid data accepted,
auth enforced, 405 with ``Allow``. The exit status is schemathesis's (0: no failure).

One rule a JSON schema cannot state: whether a prompt fits the session length depends
on its tokenization, and some fields must agree with each other (``min_tokens`` <=
``max_tokens``). So valid data may get a 400, but only with the codes that say so; the
check below (loaded by schemathesis through ``SCHEMATHESIS_HOOKS``) enforces that.
Without ``--url`` the server runs with a session of 64 tokens, so each case is cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import schemathesis

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO.parent / "shared" / "models" / "stories260K"
# 400 codes for data the schema cannot tell from valid (see the module docstring).
# A regex or grammar that does not compile, or a schema keyword structured output cannot
# enforce, is as unstateable in OpenAPI as a prompt's token count; so is a LoRA adapter
# path that holds no valid adapter, or a name another adapter already has.
UNSTATEABLE_RULES = {
    "context_length_exceeded",
    "invalid_combination",
    "invalid_grammar",
    "unsupported_grammar",
    "invalid_lora_adapter",
    "invalid_lora_name",
}
CONFIG = """
[checks.positive_data_acceptance]
# A 400 is checked by refusals_of_valid_data_name_an_unstateable_rule instead.
expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429", "5xx"]

# The LoRA routes take adapter directories on the server and names loaded earlier, which
# no generator can know: their 400s and 404s are the normal answers to generated data.
[[operations]]
include-path-regex = "_lora_adapter$"
warnings = false
"""


@schemathesis.check
def refusals_of_valid_data_name_an_unstateable_rule(ctx, response, case):  # noqa: ANN001
    """Schema-valid data refused with 400 must be refused for a rule the schema cannot
    state, and say which."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    error = response.json()["error"]
    if error.get("code") not in UNSTATEABLE_RULES:
        raise AssertionError(f"schema-valid request refused: {error}")
    return None


def run_schemathesis(
    url: str, api_key: str | None, max_examples: int, seed: int, workers: int = 1
) -> subprocess.CompletedProcess[str]:
    """``schemathesis run`` against ``url`` with every check; output captured."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "schemathesis.toml"
        config.write_text(CONFIG)
        command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config)]
        command += ["--no-color", "run", f"{url}/openapi.json", "--checks", "all"]
        command += ["--max-examples", str(max_examples), "--seed", str(seed)]
        command += ["--workers", str(workers), "--continue-on-failure"]
        command += ["--report-dir", str(Path(tmp) / "report")]
        if api_key:
            command += ["--header", f"Authorization: Bearer {api_key}"]
        env = {
            **os.environ,
            "SCHEMATHESIS_HOOKS": Path(__file__).stem,
            "PYTHONPATH": str(Path(__file__).parent),
        }
        return subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True)


@contextlib.contextmanager
def stories_server(model: Path) -> object:
    """``llmctl serve`` on ``model`` with a 64-token session and an API key."""
    from llmctl.bench.server_process import llmctl_server

    key = secrets.token_hex(8)
    flags = {"backend": "torch", "session_len": 64, "api_keys": [key]}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with llmctl_server(str(model), flags) as url:
        yield url, key


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="A running server (else one is started on --model).")
    parser.add_argument("--api-key", help="The running server's API key.")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--max-examples", type=int, default=100, help="Per operation.")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url, key = args.url, args.api_key
        if url is None:
            url, key = stack.enter_context(stories_server(args.model))
        result = run_schemathesis(url, key, args.max_examples, args.seed, args.workers)
    print(result.stdout, result.stderr, sep="\n")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
