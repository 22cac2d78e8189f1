#!/usr/bin/env bash
# Every GPU check and GPU benchmark in one run, under 8 minutes on one H200; a short table last.
#
#   bash bench/gpu_check.sh        (from anywhere: it runs in the repo root)
#
# Full logs go to $OUT when it is set (the device tool brings that folder back; at most a few
# files, so steps share logs), else to a fresh temp folder. Env: PYTHON (default python3),
# GPU_CHECK_BUDGET_S (default 450: no step starts after that, each is cut to what is left).
#
# The GPU machine has Python 3.12, CuPy, numba, numpy, safetensors, tokenizers, jinja2 and pytest
# but no PyPI. starlette and hypercorn come from bench/wheels/ when present (made here by
# bench/make_wheelhouse.sh; that folder is git-ignored, so name it in the device tool's carry);
# without them the server tests are skipped, which the table says.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-$(mktemp -d)}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
TMP=$(mktemp -d)
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-$TMP/numba_cache} PYTHONUNBUFFERED=1
mkdir -p "$LOGS"
ROWS=()

# One benchmark per line: "name|timeout seconds|command". Others add theirs here.
KERNEL="$PY -m freetoken kernel"
BENCHES=(
  "rms_norm decode|60|$KERNEL rms_norm --check --bench --iters 1000"
  "rms_norm prefill|60|$KERNEL rms_norm --check --bench --shape R=4096,H=4096 --iters 200"
  "rms_norm per-head f32|60|$KERNEL rms_norm --check --bench --shape R=4096,H=128 --dtype f32 --iters 500"
  "add_rms_norm prefill|60|$KERNEL add_rms_norm --check --bench --shape R=4096,H=4096 --iters 200"
  "embedding|60|$KERNEL embedding --check --bench --shape T=4096,H=4096,V=32768 --iters 200"
  "rope prefill|60|$KERNEL rope --check --bench --shape T=4096 --iters 200"
  "kv_write bf16|60|$KERNEL kv_write --check --bench --shape T=4096,N=65536 --iters 200"
  "router decode|60|$KERNEL router --check --bench --iters 1000"
  "router prefill|60|$KERNEL router --check --bench --shape T=4096,E=512,k=10 --iters 100"
  "sampling 64x152k|90|$KERNEL sampling --check --bench --shape B=64 --iters 10"
  "linear|60|$KERNEL linear --check --bench --iters 200"
  "attention decode|60|$KERNEL attention --check --bench --iters 200"
  "experts decode|60|$KERNEL experts --check --bench --iters 200"
  "gpu decode kernels|150|$PY bench/kernels/gpu_decode_kernels.py --out $LOGS/gpu_decode_kernels.json"
  "gpu decode e2e|240|$PY bench/gpu_decode.py --out $LOGS/gpu_decode.json"
  "moe backends (gpu_moe)|200|$PY bench/gpu_moe.py --out $LOGS/gpu_moe.json"
)

elapsed() { echo $((SECONDS - START)); }

# run_step NAME TIMEOUT LOG NOTE_PATTERN CMD...: run, append output to LOG, add a table row
run_step() {
  local name=$1 limit=$2 log=$3 pattern=$4; shift 4
  local left=$((BUDGET - $(elapsed)))
  if ((left < 15)); then
    ROWS+=("$(printf '%-24s %-8s %5s  %s' "$name" SKIP - "time budget spent")"); return
  fi
  ((limit > left)) && limit=$left
  local out=$TMP/step.out t0=$SECONDS rc status note
  timeout --kill-after=10 "$limit" "$@" >"$out" 2>&1
  rc=$?
  { echo "=== $name (rc $rc, $((SECONDS - t0)) s): $*"; cat "$out"; echo; } >>"$log"
  case $rc in
    0) status=PASS ;; 124 | 137) status=TIMEOUT ;; *) status="FAIL($rc)" ;;
  esac
  note=""   # the first line matching the pattern, else the last line printed
  [[ -n $pattern ]] && note=$(grep -E "$pattern" "$out" | head -n 1 | sed 's/^ *//' | cut -c1-90)
  [[ -z $note ]] && note=$(grep -v '^\s*$' "$out" | tail -n 1 | sed 's/^ *//' | cut -c1-90)
  ROWS+=("$(printf '%-24s %-8s %5s  %s' "$name" "$status" "$((SECONDS - t0))" "$note")")
}

server_deps() { "$PY" -c "import starlette, hypercorn, jinja2" >/dev/null 2>&1; }

# Install starlette/hypercorn from the wheelhouse: into the environment, else into a folder on
# PYTHONPATH (when the environment is read-only).
install_wheels() {
  server_deps && return 0
  ls bench/wheels/*.whl >/dev/null 2>&1 || return 1
  "$PY" -m pip install -q --no-index --find-links bench/wheels starlette hypercorn jinja2 && return 0
  "$PY" -m pip install -q --no-index --find-links bench/wheels --target "$TMP/site" \
    starlette hypercorn jinja2 || return 1
  export PYTHONPATH=$TMP/site${PYTHONPATH:+:$PYTHONPATH}
}

START=$SECONDS
{
  echo "host $(hostname), $(date -u)"; nvidia-smi -L 2>&1
  "$PY" -c "import sys, numpy, cupy; print(sys.version); print('numpy', numpy.__version__, 'cupy', cupy.__version__)" 2>&1
  install_wheels 2>&1
} >"$LOGS/setup.log" 2>&1
PYTEST_ARGS=(-m gpu -rfE --continue-on-collection-errors -p no:cacheprovider)  # -q comes from pyproject
if server_deps; then
  ROWS+=("$(printf '%-24s %-8s %5s  %s' "server deps" OK - "starlette/hypercorn importable")")
else
  PYTEST_ARGS+=(--ignore=tests/server)
  ROWS+=("$(printf '%-24s %-8s %5s  %s' "server deps" SKIP - "no starlette/hypercorn, no bench/wheels: tests/server skipped")")
fi

run_step "pytest -m gpu" 300 "$LOGS/gpu_tests.log" "" \
  "$PY" -m pytest "${PYTEST_ARGS[@]}" --junitxml="$LOGS/gpu_tests.xml"

for line in "${BENCHES[@]}"; do
  IFS='|' read -r name limit cmd <<<"$line"
  run_step "$name" "$limit" "$LOGS/benchmarks.log" "(FAIL|GB/s|has no)" bash -c "$cmd"
done

{
  echo
  echo "gpu_check: $(elapsed) s in all; full logs in $LOGS"
  printf '%-24s %-8s %5s  %s\n' STEP STATUS SEC NOTE
  printf '%s\n' "${ROWS[@]}"
} | tee "$LOGS/summary.txt"
rm -rf "$TMP"
! grep -qE ' (FAIL|TIMEOUT)' "$LOGS/summary.txt"
