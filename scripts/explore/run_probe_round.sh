#!/bin/bash
# Kernel-level round on an offline GPU host (needs Triton only, no CuTe DSL): GPU tests of the
# Triton decode kernels, then scripts/explore/probe_kernels.py (MoE decode configs, router
# selection algorithms, MLA KV split counts). All output under $OUT: tests.log, probe.jsonl.
#
#   STAGE=.stage/s2/1 TESTS="test_fused_triton test_kda_decode" bash scripts/explore/run_probe_round.sh
#
# env: STAGE (a staged wheel part to hand to install-staged.sh first, optional), TESTS (tests/gpu
# files without .py), PYTEST_S (per-file limit), MOE_CONFIGS (extra DecodeConfig JSONs, one per
# line), MLA_SPLITS (default 8,16,24,32), PROBE_ARGS (extra probe_kernels.py args).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s); OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -n "$STAGE" ]; then bash "$(dirname "$STAGE")/../install-staged.sh" "$STAGE" 2>&1 | tail -1; fi
for d in kernels models scripts engine cluster actors; do ln -sfn ../$d raydecode/$d; done
export PYTHONPATH=$PWD:$PYTHONPATH
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
for f in ${TESTS-test_fused_triton test_kda_decode test_mla_decode}; do
  timeout "${PYTEST_S:-100}" python3 -m pytest "tests/gpu/$f.py" -q --maxfail=6 $N \
    -p no:cacheprovider >> "$OUT/tests.log" 2>&1
  echo "pytest $f rc=$? t=$(( $(date +%s) - T0 ))"; tail -1 "$OUT/tests.log"
done
grep -E "^E  |^FAILED|Error:" "$OUT/tests.log" | cut -c1-300 | head -30
P="python3 -m raydecode.scripts.explore.probe_kernels"
CFG=(); while IFS= read -r c; do [ -n "$c" ] && CFG+=(--config "$c"); done <<< "$MOE_CONFIGS"
for b in 1 4; do
  timeout 120 $P --tp 16 --batch $b "${CFG[@]}" $PROBE_ARGS 2>&1 | grep '^{' >> "$OUT/probe.jsonl"
done
for b in 1 2; do
  timeout 90 $P --batch $b --mla-splits "${MLA_SPLITS:-8,16,24,32}" 2>&1 | grep '^{' >> "$OUT/probe.jsonl"
done
echo "probe done t=$(( $(date +%s) - T0 ))"; cat "$OUT/probe.jsonl" | cut -c1-400
