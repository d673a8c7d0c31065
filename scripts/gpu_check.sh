#!/usr/bin/env bash
# The GPU checks in one call, for a machine with a CUDA GPU and PyTorch but no Horovod (the lent
# GPU machine of docs/benchmarks.md, "The torch device path"): build the C++ extensions in place,
# run the tests that take a `cuda` device (the torch device path's byte identity with the core,
# the DDP hook and DiLoCo on CUDA parameters, over gloo and one NCCL rank), then `deepreduce
# bench-step --device cuda` on ResNet-50's shapes (per layer, as one tensor, in 25 MiB buckets) and
# on ResNet-20's real gradients (every shipped config). Every step has its own time limit, so a slow or failing step
# still leaves the others' logs in $OUT (default build/gpu_check); the tables print last.
#
#   ONLY="build bench" bash scripts/gpu_check.sh   # a subset of: build tests bench profile
#   bash scripts/gpu_check.sh            # wheels of missing packages, if any, in .whl/ are installed first
set -uo pipefail
OUT=${OUT:-build/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=${PY:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_site .whl/*.whl \
        && export PYTHONPATH=/tmp/gpu_site${PYTHONPATH:+:$PYTHONPATH}
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    "$PY" -c "import sys, numpy, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name(0))"
    nproc
} 2>&1 | tee "$OUT/env.txt"

step() {   # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, report the exit status
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "[gpu_check] $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    return $rc
}

ONLY=${ONLY:-build tests bench}   # which of the three to run
[[ " $ONLY " == *" build "* ]] && step build 100 "$PY" setup.py -q build_ext --inplace
[[ " $ONLY " == *" tests "* ]] && step tests 120 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_torch_device.py tests/test_torch_ddp_device.py
# `deepreduce bench-step` through the command's own parser (no need to install the harness's entry points)
BENCH_STEP=("$PY" -c 'import argparse, sys
from experiments.cli import bench_step
parser = argparse.ArgumentParser(prog="deepreduce bench-step")
bench_step.register(parser.add_subparsers())
args = parser.parse_args(["bench-step", *sys.argv[1:]])
sys.exit(args.func(args))')
CONFIGS=(configs/topk_raw.yaml configs/bf_p0.yaml configs/bf_p2.yaml configs/bfp0_qsgd.yaml)
[[ " $ONLY " == *" bench "* ]] && step bench_resnet50 120 "${BENCH_STEP[@]}" --sets resnet50 --steps 5 --warmup 2 --device cuda "${CONFIGS[@]}"
[[ " $ONLY " == *" bench "* ]] && step bench_resnet50_flat 90 "${BENCH_STEP[@]}" --sets resnet50_flat --steps 5 --warmup 2 --device cuda "${CONFIGS[@]}"
[[ " $ONLY " == *" bench "* ]] && step bench_resnet50_buckets 120 "${BENCH_STEP[@]}" --sets resnet50 --steps 5 --warmup 2 --device cuda --bucket-mb 25 configs/topk_raw.yaml configs/bf_p0.yaml
[[ " $ONLY " == *" bench "* ]] && step bench_resnet20 90 "${BENCH_STEP[@]}" --sets resnet20 --steps 5 --warmup 2 --device cuda
# where a step's time goes (torch.profiler and cProfile tables; not in the default set)
[[ " $ONLY " == *" profile "* ]] && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} step profile 120 "$PY" scripts/gpu_profile.py \
    --device cuda --sets resnet50_flat configs/topk_raw.yaml configs/bf_p0.yaml

for name in tests bench_resnet50 bench_resnet50_flat bench_resnet50_buckets bench_resnet20 profile; do
    [[ -f "$OUT/$name.log" ]] && { echo "=== $name"; tail -n 25 "$OUT/$name.log"; }
done
cat "$OUT/summary.txt"
