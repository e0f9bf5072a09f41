#!/bin/bash
# Prepare this checkout for one `device` run of scripts/gpu_check.py (see docs/architecture.md):
#   bash scripts/gpu_prepare.sh        # here, once: wheels in .whl/, stories260K in .gpu/
#   device run: command "bash scripts/gpu_device_run.sh", carry [".whl", ".gpu"], timeout_s 600
# The GPU image has torch, triton, transformers, peft, pytest(-xdist), not the packages
# below; they travel as Python 3.12 wheels of the versions installed here. Both folders
# are ignored through .git/info/exclude, so nothing from ../shared is ever committed.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=.git/info/exclude
mkdir -p "$(dirname "$exclude")"
for folder in /.whl/ /.gpu/; do
    grep -qxF "$folder" "$exclude" 2>/dev/null || echo "$folder" >>"$exclude"
done
rm -rf .whl .gpu && mkdir -p .whl .gpu/shared/models
pins=$(python - <<'PY'
from importlib.metadata import version
names = ["pydantic", "pydantic_core", "annotated-types", "typing-inspection", "platformdirs",
         "gguf", "fastapi", "starlette", "uvicorn", "fastapi-offline", "typing_extensions"]
print(" ".join(f"{name}=={version(name)}" for name in names))
PY
)
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $pins
python -m pip wheel -q --no-deps --no-build-isolation -w .whl . backends/torch backends/turbo
cp -r ../shared/models/stories260K .gpu/shared/models/
du -sh .whl .gpu
