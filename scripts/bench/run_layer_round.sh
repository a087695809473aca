#!/bin/bash
# One benchmark round on an offline GPU host (the device machine): optional install of the
# staged wheels (shared/offline-gpu: nvidia-cutlass-dsl), GPU tests of the decode kernels, then
# the per-layer benchmark with its results under $OUT.
#
#   STAGE=.stage/s2/2 TESTS="test_kda_decode test_mla_decode" bash scripts/bench/run_layer_round.sh COMMIT
#
# env: STAGE (last staged part to install, if /root/site is not installed yet), TESTS (tests/gpu
# files without .py; empty string = none), PYTEST_S / PYTEST_K (per-file limit / -k filter),
# GEMV_K (-k filter of tests/gpu/test_gemv.py; unset = skip), NOBENCH, TPS, BATCHES,
# ATTNRES (cute | triton, default cute), SWEEP (set: MoE decode tile sweep first), TOTAL_S.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}; T0=$(date +%s); OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -n "$STAGE" ] && [ ! -f /root/site/env.sh ]; then bash "$(dirname "$STAGE")/../install-staged.sh" "$STAGE" 2>&1 | tail -2; fi
[ -f /root/site/env.sh ] && source /root/site/env.sh
for d in kernels models scripts engine cluster actors; do ln -sfn ../$d raydecode/$d; done
export PYTHONPATH=$PWD:$PYTHONPATH
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
  python3 -c "import cutlass; print('cutlass-dsl', cutlass.__version__)" 2>/dev/null; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
for f in ${TESTS-test_kda_decode test_mla_decode test_fused_triton test_attnres_cute test_layer_bench test_kernels_aot_gpu}; do
  timeout "${PYTEST_S:-120}" python3 -m pytest "tests/gpu/$f.py" -q --maxfail=6 $N ${PYTEST_K:+-k "$PYTEST_K"} \
    -p no:cacheprovider > "$OUT/pytest-$f.log" 2>&1
  echo "pytest $f rc=$? t=$(( $(date +%s) - T0 ))"; tail -2 "$OUT/pytest-$f.log"
  grep -E "^E  |^FAILED|Error:" "$OUT/pytest-$f.log" | cut -c1-300 | head -24
done
if [ -n "$GEMV_K" ]; then
  timeout 150 python3 -m pytest tests/gpu/test_gemv.py -q $N -p no:cacheprovider -k "$GEMV_K" > "$OUT/pytest-gemv.log" 2>&1
  echo "pytest gemv rc=$? t=$(( $(date +%s) - T0 ))"; tail -3 "$OUT/pytest-gemv.log"
fi
[ -n "$NOBENCH" ] && exit 0
LEFT=$(( ${TOTAL_S:-560} - ($(date +%s) - T0) ))
timeout "$LEFT" python3 -m raydecode.scripts.bench.layer --out "$OUT/layer.json" --png "$OUT/layer.png" \
  --md "$OUT/layer.md" --commit "$COMMIT" --tps "${TPS:-16,8}" --batches "${BATCHES:-1,2,8,64}" --profile \
  --attnres "${ATTNRES:-cute}" ${SWEEP:+--moe-decode-sweep --moe-decode-sweep-batches 1} \
  --budget-s $(( LEFT - 60 )) > "$OUT/bench.log" 2>&1
echo "bench rc=$? t=$(( $(date +%s) - T0 ))"; tail -45 "$OUT/bench.log"
