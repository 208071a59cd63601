# Sourced by benchmarks/h200_bench.sh and h200_serve.sh: the GPU machine's setting-up, shared.
# Installs the carried wheels (.whl: gguf, and the server's packages the machine lacks) unless they import
# already, puts src on PYTHONPATH, points REDWOOD_HOME at the carried datasets, and joins the staged GGUF
# chunks (/root/stage/t?? the 1.5B target, d?? the 0.5B draft) into $T and $D once. Sets T, D, R and run().
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import fastapi, uvicorn, gguf" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 REDWOOD_HOME=${REDWOOD_HOME:-$PWD/.stage/home}
T=${TARGET:-/root/t.gguf}
D=${DRAFT:-/root/d.gguf}
if [ ! -f "$T" ] && ls /root/stage/t?? >/dev/null 2>&1; then cat /root/stage/t?? > "$T"; fi
if [ ! -f "$D" ] && ls /root/stage/d?? >/dev/null 2>&1; then cat /root/stage/d?? > "$D"; fi
R="python3 -m redwood.cli"
run() { echo >&2; echo "\$ $*" >&2; "$@"; }
