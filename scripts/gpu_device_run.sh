#!/bin/bash
# On the GPU machine (see scripts/gpu_prepare.sh): install the carried wheels, put
# stories260K where the tests look (../shared), run scripts/gpu_check.py into $OUT.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 MAX_JOBS=16
ln -sfn "$PWD/.gpu/shared" ../shared || echo "could not link ../shared: stories260K parts fail"
{ nvidia-smi; nvcc --version | tail -2; nproc; } >"$OUT/env.txt" 2>&1
# turbo's build (nvcc and g++, ~a minute on 16 cores) overlaps parts 1 and 2;
# gpu_check's turbo part waits on the build's lock.
python3 -c "from llmctl_turbo.build import load_ops; load_ops()" >"$OUT/turbo_build_bg.txt" 2>&1 &
# The report is rewritten after every part, so a run cut off still brings one back.
timeout "${GPU_CHECK_TIMEOUT:-530}" python3 scripts/gpu_check.py --output "$OUT/gpu_check.md" \
    --time-limit "${GPU_CHECK_LIMIT:-400}" 2>&1 | tee "$OUT/log.txt"
rc=$?
cp "$(python3 -c "from llmctl_turbo.build import build_spec; print(build_spec().log)")" \
    "$OUT/turbo_build.log" 2>/dev/null
exit $rc
