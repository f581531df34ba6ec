#!/usr/bin/env bash
# One prepared check of the GPU paths, for a machine with an NVIDIA GPU (everything here is skipped or
# reported "no GPU" elsewhere). Budget: 8 minutes (480 s) in all; each stage has its own timeout, capped by
# what is left of the budget (less 10 s): install 90 s, kernels 150 s, trt-tests 150 s, trt-dir 150 s. The
# three 150 s stages leave 30 s for env and the copy of $DSPARK_ENGINE_DIR, so with nothing to install trt-dir
# gets (nearly) its full 150 s even when the stages before it use all of theirs.
# A failed or timed-out stage is recorded and the script goes on, and a short table is printed last.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default: $OUT if set, else ./gpu_check_out)
#
# Stages:
#   env        nvidia-smi, python, torch + CUDA, triton, tensorrt, polygraphy versions
#   install    pip installs what is missing (triton, polygraphy; torch and tensorrt are never installed
#              here: a CUDA torch wheel is GBs, TensorRT comes from NVIDIA's index or container). Offline
#              machines skip what cannot be installed.
#   kernels    scripts/gpu_kernels.py: both Triton kernels on the GPU (not the interpreter) equal to the numpy
#              reference on the test cases, through the checked wrappers and through the TensorRT plugin's
#              launch order; timed against torch at the default model's sizes; AOT PTX for this GPU assembled
#   trt-tests  (TensorRT importable) the TensorRT tests that skip elsewhere: plugins in an engine vs the
#              reference, and a tiny engine directory built, compared with ONNX Runtime (Polygraphy),
#              profiled and used for greedy generation token-identical to ONNX Runtime. "ok" needs at least
#              one passed test: when pytest exits 0 with every test skipped (e.g. a TensorRT older than
#              10.9), the stage is FAILED with the first skip reason
#   trt-dir    (TensorRT importable, $DSPARK_ENGINE_DIR set, time left) `dspark-export trt build` and
#              `trt compare` on that engine directory (a copy of it, in OUT_DIR); it must be a float32 build
#              (`dspark-export build --weights fp32 --drafter-weights float32`), the int4 default has no
#              TensorRT import
#
# Exit status: 0 every stage that ran passed (and a GPU was present); 1 a stage failed or timed out;
# 2 no NVIDIA GPU (only env ran).
# GPU_CHECK_ASSUME_GPU=1 runs every stage even without a GPU (to exercise this script's own flow: the GPU
# stages then fail and say why); GPU_CHECK_BUDGET_S changes the 480 s budget.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$ROOT/gpu_check_out}}"
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/gpu_check.tsv"
: > "$RESULTS"
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
START_S=$(date +%s)
PY="${PYTHON:-python}"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET || true
cd "$ROOT"

elapsed() { echo $(( $(date +%s) - START_S )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }

# record STAGE STATUS SECONDS DETAIL
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$RESULTS"; }

# run_stage NAME TIMEOUT_S DETAIL_ON_SUCCESS CMD...: runs CMD with a timeout (capped by the time left),
# logs to OUT_DIR/NAME.log, records ok / FAILED (rc) / TIMEOUT; never stops the script. With REQUIRE_LOG set
# (an extended regex), exit status 0 counts as ok only when the log matches it (else FAILED).
run_stage() {
  local name="$1" limit="$2" detail="$3"; shift 3
  local remaining; remaining=$(left)
  if (( remaining < 20 )); then record "$name" "skipped" 0 "budget spent"; return 0; fi
  (( limit > remaining - 10 )) && limit=$(( remaining - 10 ))
  local t0 rc=0; t0=$(date +%s)
  echo "== $name (timeout ${limit}s)" >&2
  timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1 || rc=$?
  local dt=$(( $(date +%s) - t0 ))
  tail -n 5 "$OUT_DIR/$name.log" >&2 || true
  if (( rc == 0 )) && [[ -n "${REQUIRE_LOG:-}" ]] && ! grep -q -E "$REQUIRE_LOG" "$OUT_DIR/$name.log"; then
    local skip; skip=$(grep -m1 -E '^SKIPPED' "$OUT_DIR/$name.log" || tail -n1 "$OUT_DIR/$name.log" || true)
    record "$name" "FAILED" "$dt" "exit 0 but nothing passed (all skipped?), see $name.log: ${skip:0:90}"
  elif (( rc == 0 )); then record "$name" "ok" "$dt" "$detail"
  elif (( rc == 124 || rc == 137 )); then record "$name" "TIMEOUT" "$dt" "after ${limit}s, see $name.log"
  else
    local why; why=$(grep -m1 -E 'Error|FAIL|error|no GPU run' "$OUT_DIR/$name.log" || tail -n1 "$OUT_DIR/$name.log" || true)
    record "$name" "FAILED" "$dt" "rc $rc, see $name.log: ${why:0:90}"
  fi
  return 0
}

print_table() {
  echo
  echo "gpu_check: $(elapsed)s of ${BUDGET_S}s; logs and JSON in $OUT_DIR"
  printf '%-10s %-8s %6s  %s\n' "stage" "status" "sec" "detail"
  while IFS=$'\t' read -r stage status secs detail; do
    printf '%-10s %-8s %6s  %s\n' "$stage" "$status" "$secs" "$detail"
  done < "$RESULTS"
}

# -- env -------------------------------------------------------------------------------------------------
have_gpu=0
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > "$OUT_DIR/nvidia-smi.txt" 2>&1; then
  have_gpu=1
  record env ok 0 "$(head -n1 "$OUT_DIR/nvidia-smi.txt" | cut -c1-70)"
else
  record env "no GPU" 0 "nvidia-smi missing or sees no GPU"
fi
"$PY" - > "$OUT_DIR/versions.json" 2>/dev/null <<'EOF' || true
import importlib, json, sys
out = {"python": sys.version.split()[0]}
for name in ("torch", "triton", "tensorrt", "polygraphy", "onnxruntime", "onnx"):
    try:
        out[name] = importlib.import_module(name).__version__
    except Exception as e:
        out[name] = f"missing ({type(e).__name__})"
try:
    import torch
    out["cuda_available"] = torch.cuda.is_available()
    out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
except Exception:
    out["cuda_available"] = False
print(json.dumps(out))
EOF
record versions info 0 "$(tr -d '{}"' < "$OUT_DIR/versions.json" | cut -c1-150)"

if (( have_gpu == 0 )) && [[ "${GPU_CHECK_ASSUME_GPU:-0}" == 1 ]]; then
  record env assumed 0 "GPU_CHECK_ASSUME_GPU=1: running the GPU stages anyway"
elif (( have_gpu == 0 )); then
  for stage in install kernels trt-tests trt-dir; do record "$stage" "no GPU" 0 "needs an NVIDIA GPU"; done
  print_table
  exit 2
fi

# -- install (only what is missing; offline machines just record it) --------------------------------------
missing=()
"$PY" -c "import triton" 2> /dev/null || missing+=("triton==3.7.1")
"$PY" -c "import polygraphy" 2> /dev/null || missing+=("polygraphy>=0.49")
"$PY" -c "import pytest" 2> /dev/null || missing+=("pytest>=8")
if (( ${#missing[@]} )); then
  run_stage install 90 "installed ${missing[*]}" "$PY" -m pip install -q "${missing[@]}"
else
  record install ok 0 "nothing missing"
fi

# -- kernels on the GPU ---------------------------------------------------------------------------------
run_stage kernels 150 "reference-equal, timed, AOT assembled (gpu_kernels.json)" \
  "$PY" scripts/gpu_kernels.py --out "$OUT_DIR" --repeats 50

# -- TensorRT -------------------------------------------------------------------------------------------
if "$PY" -c "import tensorrt" > /dev/null 2>&1; then
  REQUIRE_LOG='[0-9]+ passed' run_stage trt-tests 150 "plugins in engines, tiny dir built/compared/profiled/generated" \
    "$PY" -m pytest -q -rs -p no:cacheprovider \
      tests/plugins/test_tensorrt_plugins.py::test_plugin_engine_matches_reference \
      tests/engines/test_trt_backend.py::test_build_compare_and_generate_with_tensorrt
  if [[ -n "${DSPARK_ENGINE_DIR:-}" && -d "${DSPARK_ENGINE_DIR}" ]]; then
    work="$OUT_DIR/engine_dir"
    rm -rf "$work" && cp -r "$DSPARK_ENGINE_DIR" "$work" && chmod -R u+w "$work"
    run_stage trt-dir 150 "built, compared, profiled $(basename "$DSPARK_ENGINE_DIR")" \
      bash -c "'$PY' -m dspark_export.cli trt build --engine-dir '$work' --repeats 5 \
               && '$PY' -m dspark_export.cli trt compare --engine-dir '$work' > '$OUT_DIR/compare.json'"
  else
    record trt-dir skipped 0 "set DSPARK_ENGINE_DIR to build a real engine directory"
  fi
else
  record trt-tests skipped 0 "tensorrt does not import: $("$PY" -c 'import tensorrt' 2>&1 | tail -n1 | cut -c1-80)"
  record trt-dir skipped 0 "tensorrt does not import"
fi

print_table
if grep -q -P '\t(FAILED|TIMEOUT)\t' "$RESULTS"; then exit 1; fi
exit 0
