#!/usr/bin/env bash
# The wheels the GPU machine lacks, downloaded here into .whl/ (git-ignored through .git/info/exclude) for a
# device call to carry: gguf (loading the staged GGUFs) and the server's packages (h200_serve.sh: redwood serve +
# bench serve; fastapi needs opentelemetry-api, uvicorn h11 and click). h200_env.sh installs them there into /tmp/site unless they import already. The versions are this
# checkout's environment's (.venv), so both machines run the same server code; ~3 MB in all.
#     benchmarks/gpu_wheels.sh            # then carry: [".whl", ...]
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
PY=${PY:-.venv/bin/python}
pins=$("$PY" -m pip list --format=freeze 2>/dev/null | grep -i -E '^(gguf|fastapi|uvicorn|starlette|pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|opentelemetry[-_]api|h11|click)==')
[ -n "$pins" ] || { echo "gpu_wheels.sh: no pinned versions found in $PY's environment (run scripts/setup.sh first)" >&2; exit 1; }
for pin in $pins; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pin"
done
ls .whl
du -sh .whl
