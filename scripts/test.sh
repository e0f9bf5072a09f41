#!/usr/bin/env bash
# The whole test suite, as CI runs it: install (if needed), lint, then pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow" -x`. Of a
# parametrized test's slow cases a run takes a daily sample (tests/conftest.py);
# `--all-slow` runs every one, `--slow-seed N` draws the sample of a failed run again.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
python -m pytest -q "$@"
