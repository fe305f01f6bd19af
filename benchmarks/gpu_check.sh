#!/usr/bin/env bash
# Device checks on a machine with an NVIDIA GPU. No Ray, no network, no installs: the workers run in plain
# processes (the path the multiprocess tests use). Under 5 minutes; prints one summary table.
#
#   bash benchmarks/gpu_check.sh                 # from anywhere; runs in the repository root
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#
# Needs: torch with CUDA, pytest, pytest-timeout, pyarrow, fsspec, pyyaml (it stops at once, naming what
# is missing). Steps, each with its own timeout; a failed step does not stop the others:
#   1. environment: nvidia-smi, torch and CUDA versions, bf16, GPU count                 (<= 30 s)
#   2. NCCL: a process group and an all-reduce with NCCL_DEBUG=INFO; with 2+ GPUs, the transport NCCL
#      chose between two ranks (P2P/NVLink expected, not SHM or NET)                       (<= 40 s)
#   3. pytest tests/gpu: the NCCL worker, no host sync per step (sync debug mode "error"), a warm restart
#      after a raised error in the same process (checkpoint and peer paths), a resume from a GPU-written
#      checkpoint in a fresh process, SyncBatchNorm (2 ranks: one GPU each, or sharing one over gloo)
#                                                                                          (<= 200 s)
#   4. bf16 step time, the product's worker vs a bare DDP loop, same input pipeline         (<= 100 s)
# Exit status: 0 when every step passed, 1 otherwise, 2 when something it needs is missing.

set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
START=$SECONDS
WORK=$(mktemp -d /tmp/gpuchk.XXXXXX)
OUTDIR=${OUT:-$WORK}   # where the JSON and logs are left (the device tool's $OUT when set)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
trap 'rm -rf "$WORK"' EXIT
PY=${PYTHON:-python3}

missing=$(timeout 60 "$PY" - <<'EOF' 2>&1
import importlib
missing = []
for mod, name in [("torch", "torch"), ("pytest", "pytest"), ("pytest_timeout", "pytest-timeout"),
                  ("pyarrow", "pyarrow"), ("fsspec", "fsspec"), ("yaml", "pyyaml")]:
    try:
        importlib.import_module(mod)
    except Exception:
        missing.append(name)
if "torch" not in missing:
    import torch
    if not torch.cuda.is_available():
        missing.append("a CUDA device visible to torch")
print(" ".join(missing))
EOF
) || { echo "gpu_check: $PY does not run: $missing"; exit 2; }
if [ -n "$missing" ]; then
    echo "gpu_check: missing: $missing (python: $PY; set PYTHON=... to one that has them; nothing is installed here)"
    exit 2
fi

declare -a ROWS=()
FAILED=0
row() {  # row CHECK RC DETAIL
    local status=PASS
    [ "$2" -ne 0 ] && { status="FAIL (exit $2)"; FAILED=1; }
    ROWS+=("$(printf '| %-64s | %-13s | %s |' "$1" "$status" "$3")")
}

# 1. environment -----------------------------------------------------------------------------------
echo "== 1/5 environment"
timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
env_line=$(timeout 30 "$PY" - <<'EOF'
import torch
assert torch.cuda.is_bf16_supported(), "this GPU has no bf16"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
EOF
)
rc=$?
echo "$env_line"
row "environment" "$rc" "$env_line"

# 2. NCCL ------------------------------------------------------------------------------------------
echo "== 2/5 NCCL process group and transport"
cat >"$WORK/nccl_check.py" <<'EOF'   # a file, not stdin: spawned ranks import their function from it
import datetime, os, torch, torch.distributed as dist, torch.multiprocessing as mp

def rank(r, world, port):
    torch.cuda.set_device(r)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=r == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("nccl", store=store, rank=r, world_size=world, device_id=torch.device("cuda", r))
    t = torch.full((1 << 20,), float(r + 1), device="cuda")
    dist.all_reduce(t)
    assert t[0].item() == world * (world + 1) / 2, t[0].item()
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    world = min(2, torch.cuda.device_count())
    assert world >= 1, "no CUDA device"
    mp.start_processes(rank, args=(world, port), nprocs=world, start_method="spawn")
    print(f"all_reduce over NCCL, {world} rank(s): ok")
EOF
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM,NET timeout 40 "$PY" "$WORK/nccl_check.py" >"$WORK/nccl.log" 2>&1
rc=$?
grep -E "NCCL version|via (P2P|SHM|NET|NVLS|CollNet)|all_reduce over NCCL|Error|error" "$WORK/nccl.log" | head -20
cp "$WORK/nccl.log" "$OUTDIR/nccl.log" 2>/dev/null
transport=$(grep -oE "via (P2P|SHM|NET)[^ ]*" "$WORK/nccl.log" | sort | uniq -c | tr -s ' ' | paste -sd ';' -)
if [ -z "$transport" ]; then
    if [ "$rc" -eq 0 ]; then transport="one GPU: no transport between ranks to show"; else transport="see nccl.log"; fi
elif echo "$transport" | grep -qE "SHM|NET"; then
    transport="$transport (expected P2P/NVLink)"; rc=1
fi
row "NCCL all-reduce; transport" "$rc" "$transport"

# 3. GPU tests ---------------------------------------------------------------------------------------
echo "== 3/5 pytest tests/gpu"
timeout 200 "$PY" -m pytest -q -rA -p no:cacheprovider --junitxml="$WORK/gpu.xml" tests/gpu 2>&1 | tee "$WORK/pytest.log"
rc=${PIPESTATUS[0]}
cp "$WORK/pytest.log" "$OUTDIR/pytest.log" 2>/dev/null
if [ -f "$WORK/gpu.xml" ]; then
    while IFS=$'\t' read -r name result detail; do
        [ "$result" = "passed" ] && r=0 || r=1
        [ "$result" = "skipped" ] && { ROWS+=("$(printf '| %-64s | %-13s | %s |' "$name" "skipped" "$detail")"); continue; }
        row "$name" "$r" "$detail"
    done < <("$PY" - "$WORK/gpu.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
for case in ET.parse(sys.argv[1]).iter("testcase"):
    name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
    name = name if len(name) <= 64 else name[:40] + "..." + name[-21:]
    result, detail = "passed", f"{float(case.get('time', 0)):.1f} s"
    for tag in ("failure", "error", "skipped"):
        el = case.find(tag)
        if el is not None:
            result = "skipped" if tag == "skipped" else "failed"
            detail = (el.get("message") or "").splitlines()[0][:90] if el.get("message") else tag
    print(f"{name}\t{result}\t{detail}")
EOF
)
else
    row "pytest tests/gpu" "$rc" "no report (see the log above)"
fi
[ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && FAILED=1

# 4. step time ----------------------------------------------------------------------------------------
echo "== 4/5 bf16 step time: product worker vs bare DDP loop"
timeout 100 "$PY" -m benchmarks.bench_gpu_step --epochs 4 --repeats 1 --timeout 45 --json "$OUTDIR/gpu_step.json"
rc=$?
detail=$("$PY" - "$OUTDIR/gpu_step.json" <<'EOF' 2>/dev/null
import json, sys
r = json.load(open(sys.argv[1]))
if "ratio_product_over_bare" in r:
    ok = r["ratio_product_over_bare"] <= r["target"]
    print(f"{r['ratio_product_over_bare']:.3f}x ({r['product_step_ms']:.1f} vs {r['bare_step_ms']:.1f} ms/step; "
          f"target <= {r['target']}x: {'met' if ok else 'missed'})")
else:
    print("no ratio: " + ", ".join(r.get("failed", [])))
EOF
)
row "bf16 step, product/bare DDP" "$rc" "${detail:-no result}"

# 5. replica guard on the device ----------------------------------------------------------------------
echo "== 5/5 replica guard: one on-device digest + gather vs a step"
timeout 90 "$PY" -m benchmarks.bench_replica --device cuda --steps 100 --checks 100 --rounds 2 --json "$OUTDIR/replica_gpu.json"
rc=$?
detail=$("$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print({k: r[k] for k in list(r)[:6]})' \
    "$OUTDIR/replica_gpu.json" 2>/dev/null)
row "replica check cost (cuda)" "$rc" "${detail:-no result}"

echo
echo "== summary ($((SECONDS - START)) s)"
printf '| %-64s | %-13s | %s |\n' "check" "result" "detail"
printf '|%s|%s|%s|\n' "$(printf -- '-%.0s' {1..66})" "$(printf -- '-%.0s' {1..15})" "--------"
for line in "${ROWS[@]}"; do echo "$line"; done
exit "$FAILED"
