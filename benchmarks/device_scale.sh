#!/usr/bin/env bash
# bench_scale where ranks have cores of their own: the lent device machine (16 cores; its GPU unused), on CPU.
#
# That machine has torch but no Ray and no network. Ray travels as wheels in .whl/ (ignored by git; the
# Ray wheel without its Java jars, to fit the 64 MiB a call carries). To make them, here:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl ray==2.60.0 jsonschema jsonschema-specifications \
#       referencing rpds-py pydantic pydantic_core annotated-types typing-inspection colorful \
#       typing_extensions tensorboardX          (the versions of .venv's: pip list)
#   then unzip the Ray wheel, delete ray/jars and the dashboard's *.map, drop them from its RECORD, zip it again.
#   run(command="bash benchmarks/device_scale.sh", carry=[".whl"], timeout_s=600)
# Ray's dashboard extras are not carried; bench_ddp's RayHead then starts the head without a dashboard.
set -o pipefail
OUT=${OUT:-/tmp/device_scale_out}
mkdir -p "$OUT"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
python3 -c "import ray, ray.train.torch, torch, os; print('ray', ray.__version__, 'torch', torch.__version__, 'cpus', os.cpu_count())" \
    || { echo "import failed"; exit 1; }
cores=$(nproc)
if [ -r /sys/fs/cgroup/cpu.max ] && read -r quota period < /sys/fs/cgroup/cpu.max && [ "$quota" != max ]; then
    (( quota / period < cores )) && cores=$(( quota / period ))  # a cgroup quota below the visible CPUs
fi
echo "== bench_scale on $cores cores ($(( $(date +%s) - t0 )) s in)"
timeout "${BENCH_TIMEOUT:-540}" python3 -m benchmarks.bench_scale --ranks ${RANKS:-16 4 8} --ray-cluster \
    --arms "${ARMS:-product,raytrain,bare}" \
    --cores "$cores" --timeout 150 --json "$OUT/scale_device.json" --png "$OUT/scale_device.png" 2>&1 \
    | grep -v -i "warning\|warn(" | tee "$OUT/log"
rc=$?
echo "== done in $(( $(date +%s) - t0 )) s, rc $rc"
