#!/usr/bin/env bash
# Device checks for a machine with one NVIDIA GPU (not runnable on the 2-core CPU dev machines).
# Whole script < 8 minutes: every step has its own timeout and a step that fails does not stop the others.
#
#   bash benchmarks/gpu_check.sh            # from anywhere; runs in the repository root
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#
# Python: $PYTHON if set; else the first of .venv/bin/python, python3 whose torch sees CUDA; else a fresh
# venv in $GPU_VENV (default /tmp/cluster-gpu-venv) with the pinned CUDA wheels (needs the network; the
# CPU-only .venv of the dev machines cannot drive a GPU; that install is outside the 8-minute budget).
# Steps:
#   1. environment: nvidia-smi, torch.cuda, bf16 support                                   (<= 30 s)
#   2. pytest -m gpu tests/                                                                 (<= 100 s)
#   3. the tiny job on the GPU with bf16 autocast, embedded Ray, 1 worker                   (<= 100 s)
#   4. bf16 step time, product vs a bare single-GPU loop (benchmarks/bench_gpu_step.py)     (<= 160 s)
# Exit status: 0 when every step passed, 1 otherwise, 2 when no usable Python/GPU was found.

set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
START=$SECONDS
WORK=$(mktemp -d /tmp/gpuchk.XXXXXX)   # short path: Ray's socket paths live under it
export RAY_AUTH_MODE=disabled RAY_TMPDIR="$WORK/r" RAY_USAGE_STATS_ENABLED=0
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset RAY_ADDRESS   # always an embedded Ray of our own
mkdir -p "$RAY_TMPDIR"
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT

declare -a RESULTS=()
FAILED=0
record() {  # record NAME RC [NOTE]
    local name=$1 rc=$2 note=${3:-}
    if [ "$rc" -eq 0 ]; then RESULTS+=("PASS  $name $note"); else RESULTS+=("FAIL  $name (exit $rc) $note"); FAILED=1; fi
}

has_cuda() { timeout 30 "$1" -c 'import torch, ray, pyarrow, fsspec, yaml, pytest; assert torch.cuda.is_available()' >/dev/null 2>&1; }

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    for cand in "$ROOT/.venv/bin/python" "$(command -v python3 || true)"; do
        if [ -n "$cand" ] && [ -x "$cand" ] && has_cuda "$cand"; then PY=$cand; break; fi
    done
fi
if [ -z "$PY" ]; then
    VENV=${GPU_VENV:-/tmp/cluster-gpu-venv}
    echo "== no Python with CUDA torch found; creating $VENV (pinned torch/ray; needs the network)"
    if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV" || { echo "cannot create a venv"; exit 2; }; fi
    timeout 300 "$VENV/bin/pip" install -q 'torch==2.13.0' 'ray[default,train]==2.60.0' pyarrow fsspec pyyaml \
        pytest pytest-timeout || { echo "pip install failed (offline?); set PYTHON=... to a CUDA-enabled python"; exit 2; }
    PY="$VENV/bin/python"
    has_cuda "$PY" || { echo "torch in $VENV does not see a GPU"; exit 2; }
fi
echo "== python: $PY"

# 1. environment -------------------------------------------------------------------------------
echo "== 1/4 environment"
timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rc_smi=$?
timeout 30 "$PY" - <<'EOF'
import torch, ray
print(f"torch {torch.__version__} cuda {torch.version.cuda} ray {ray.__version__}")
print(f"device {torch.cuda.get_device_name(0)}, bf16 supported: {torch.cuda.is_bf16_supported()}")
assert torch.cuda.is_bf16_supported(), "this GPU has no bf16"
EOF
rc=$?
[ "$rc_smi" -ne 0 ] && rc=$rc_smi
record environment "$rc"

# 2. GPU tests ---------------------------------------------------------------------------------
echo "== 2/4 pytest -m gpu"
timeout 100 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/
rc=$?
if [ "$rc" -eq 5 ]; then record "pytest -m gpu" 1 "(no tests marked gpu were collected)"; else record "pytest -m gpu" "$rc"; fi

# 3. the tiny job on the GPU, bf16 -------------------------------------------------------------
echo "== 3/4 tiny job: scaling.use_gpu=true workers=1 training.amp=bf16"
timeout 100 "$PY" -m jobs.train --config jobs/configs/tiny_cpu.yaml \
    --set scaling.use_gpu=true --set workers=1 --set training.amp=bf16 \
    --set storage="$WORK/runs" --set name=gpu-tiny --result-json "$WORK/tiny.json"
rc=$?
if [ "$rc" -eq 0 ]; then
    "$PY" - "$WORK/tiny.json" <<'EOF' || rc=1
import json, sys
r = json.load(open(sys.argv[1]))
print(f"tiny job: status={r['status']} steps={r['global_step']} loss={r['metrics'].get('loss')} world={r['world_size']}")
assert r["status"] == "finished" and r["global_step"] > 0, r
EOF
fi
record "tiny job on GPU (bf16)" "$rc"

# 4. bf16 step time: product vs bare -----------------------------------------------------------
echo "== 4/4 bf16 step time, product vs bare single-GPU loop"
timeout 160 "$PY" -m benchmarks.bench_gpu_step --timeout 70 --json "$WORK/gpu_step.json"
rc=$?
if [ "$rc" -eq 0 ]; then
    "$PY" - "$WORK/gpu_step.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"RATIO product/bare bf16 step time: {r['ratio_product_over_bare_step']:.3f}x "
      f"(product {r['product']['step_interval_ms_median']:.2f} ms, bare {r['bare']['step_interval_ms_median']:.2f} ms)")
EOF
fi
record "bf16 step time product vs bare" "$rc"

echo
echo "== summary ($((SECONDS - START)) s)"
for line in "${RESULTS[@]}"; do echo "  $line"; done
exit "$FAILED"
