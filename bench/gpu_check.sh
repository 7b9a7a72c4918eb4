#!/usr/bin/env bash
# GPU check: the GPU tests, then the GPU benchmarks, on a machine with an NVIDIA GPU; every result in one
# folder. Needs no network: it uses the first Python that already has CuPy (with a visible device), pytest,
# pytest-benchmark, hypothesis and NumPy; failing that, it installs the wheels of a local folder
# ($KVC_WHEELS, else ./wheels or ./bench/wheels) into a throwaway venv with `pip --no-index`.
#
#   bash bench/gpu_check.sh [RESULTS_DIR]      (or: make gpu-check)
#
# RESULTS_DIR defaults to bench/results/gpu-<UTC time>. It receives env.txt (GPU, driver, versions),
# tests.log + tests.xml (pytest tests/gpu bench/bench_gpu.py -m gpu, benchmarks run once),
# bench.log + gpu.json (the GPU benchmarks, timed), RESULTS-gpu.md/.png (rendered) and summary.txt.
# Each step has a time limit (KVC_TEST_TIMEOUT, KVC_BENCH_TIMEOUT seconds) so the whole run stays under
# 8 minutes; an interrupted step still leaves its partial report. Exit status: 0 when both steps passed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${1:-${KVC_GPU_RESULTS:-bench/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}}"
TEST_TIMEOUT="${KVC_TEST_TIMEOUT:-250}"
BENCH_TIMEOUT="${KVC_BENCH_TIMEOUT:-170}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
START=$SECONDS

say() { printf '[gpu-check %3ds] %s\n' "$((SECONDS - START))" "$*" | tee -a "$OUT/summary.txt"; }

PROBE='
import importlib.util, sys
missing = [m for m in ("numpy", "cupy", "pytest", "pytest_benchmark", "hypothesis")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit("missing: " + " ".join(missing))
import cupy
n = cupy.cuda.runtime.getDeviceCount()
sys.exit(0 if n > 0 else "no CUDA device visible to CuPy")
'

find_python() {
  local candidate
  for candidate in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c "$PROBE" >>"$OUT/env.txt" 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

: >"$OUT/summary.txt"
echo "# python probes" >"$OUT/env.txt"
PY="$(find_python)"
if [ -z "$PY" ]; then
  WHEELS="${KVC_WHEELS:-}"
  for dir in "$WHEELS" "$ROOT/wheels" "$ROOT/bench/wheels"; do
    if [ -n "$dir" ] && compgen -G "$dir/*.whl" >/dev/null; then WHEELS="$dir"; break; fi
  done
  if [ -z "$WHEELS" ] || ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    say "no Python with CuPy + a visible GPU + pytest/pytest-benchmark/hypothesis, and no wheel folder"
    say "(set PYTHON=..., or KVC_WHEELS=<folder of .whl files>); see $OUT/env.txt"
    exit 2
  fi
  VENV="$OUT/.venv"
  say "installing the wheels of $WHEELS into $VENV (no network)"
  python3 -m venv --system-site-packages "$VENV" &&
    "$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELS" "$WHEELS"/*.whl >>"$OUT/env.txt" 2>&1
  if ! "$VENV/bin/python" -c "$PROBE" >>"$OUT/env.txt" 2>&1; then
    say "the wheels did not give a working CuPy + pytest setup; see $OUT/env.txt"
    exit 2
  fi
  PY="$VENV/bin/python"
fi
say "python: $PY"

{
  echo "# date"; date -u
  echo "# git"; git -C "$ROOT" rev-parse HEAD 2>/dev/null; git -C "$ROOT" status --short 2>/dev/null | head -50
  echo "# nvidia-smi"; nvidia-smi 2>&1 || echo "(nvidia-smi not available)"
  echo "# versions"
  "$PY" - <<'EOF'
import platform, numpy, cupy
print("python", platform.python_version(), "numpy", numpy.__version__, "cupy", cupy.__version__)
print("cuda runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion())
props = cupy.cuda.runtime.getDeviceProperties(0)
print("device 0:", props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
      "SMs", props["multiProcessorCount"], "memory GiB", round(props.get("totalGlobalMem", 0) / 2**30, 1))
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
except Exception as exc:
    print("torch: not usable:", exc)
EOF
} >>"$OUT/env.txt" 2>&1
grep -E "^device 0|^cuda runtime" "$OUT/env.txt" | while read -r line; do say "$line"; done

say "step 1/2: pytest tests/gpu bench/bench_gpu.py -m gpu (benchmarks run once; limit ${TEST_TIMEOUT}s)"
timeout -k 10 -s INT "$TEST_TIMEOUT" "$PY" -m pytest tests/gpu bench/bench_gpu.py -m gpu -p no:cacheprovider \
  --benchmark-disable -q -rfEs --durations=15 --junitxml="$OUT/tests.xml" >"$OUT/tests.log" 2>&1
TEST_RC=$?
say "step 1/2 exit $TEST_RC: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/tests.log" | tail -1)"

say "step 2/2: GPU benchmarks -> gpu.json (limit ${BENCH_TIMEOUT}s)"
timeout -k 10 -s INT "$BENCH_TIMEOUT" "$PY" -m pytest bench/bench_gpu.py -m gpu -p no:cacheprovider \
  --benchmark-only --benchmark-json="$OUT/gpu.json" --benchmark-columns=min,median,rounds -q -rfEs \
  >"$OUT/bench.log" 2>&1
BENCH_RC=$?
say "step 2/2 exit $BENCH_RC: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/bench.log" | tail -1)"

if [ -s "$OUT/gpu.json" ]; then
  "$PY" bench/render.py "$OUT/gpu.json" --out "$OUT/RESULTS-gpu.md" >>"$OUT/summary.txt" 2>&1
  say "rendered $OUT/RESULTS-gpu.md"
  sed -n '/^## Targets/,/^## Results/p' "$OUT/RESULTS-gpu.md" | sed '$d'
else
  say "no gpu.json was written; see $OUT/bench.log"
fi
case $TEST_RC in 124|137) say "step 1 hit its time limit: tests.log / tests.xml are partial" ;; esac
case $BENCH_RC in 124|137) say "step 2 hit its time limit: gpu.json holds the rows finished in time" ;; esac
say "done in $((SECONDS - START))s; results in $OUT"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
