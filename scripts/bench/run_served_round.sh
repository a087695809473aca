#!/bin/bash
# The served-path round on an offline GPU host (the device machine): install the staged wheels
# (scripts/offline_wheels.py: Ray + Serve + openai + CuTe DSL), then the GPU tests and the
# benchmarks named in STEPS, each under its own time limit, logs and JSON under $OUT.
#
#   PART=.stage/1 bash scripts/bench/run_served_round.sh          # parts 1..N-1: stash only
#   PART=.stage/4 STEPS="tests cp serve" bash scripts/bench/run_served_round.sh COMMIT
#   STEPS="step" STEP_REF=.ref bash scripts/bench/run_served_round.sh COMMIT   # warm machine
#
# STEPS: tests (tests/gpu files in TESTS), cp (control-plane bench, CPU ranks, 1-16),
# serve (the whole served stack vs the graphed step), prefix (two agent turns over the prefix
# cache on and off; PREFIX_ARGS), prefill (TTFT of 1k-128k prompts chunked at the budget,
# mixed steps, first-run vs steady over random token counts, stock kernels per layer:
# scripts/bench/prefill.py, JSON + PNG named prefill$PREFILL_TAG; PREFILL_ARGS, e.g. "--layers 8
# --tps 16,8"), spec (DSpark draft / verify / accept vs the graphed step at synthetic acceptance:
# scripts/bench/spec.py; SPEC_ARGS, e.g. "--layers 93 --ks 3,5,7 --batches 1"), kverify (the KDA
# verify kernels vs the decode kernel per position: scripts/bench/kda_verify.py; KVERIFY_ARGS),
# explore (scripts/explore modules in EXPLORE, each NAME or NAME:ARGS with '@' for spaces,
# JSON as $OUT/NAME.json), ncu (Nsight Compute on kernels matching NCU_KERNELS, a regex, in
# one run of the explore module NCU_MODULE with NCU_ARGS ('@' for spaces): --clock-control
# none (the GPU's clocks are left alone), NCU_SECTIONS (default the warp-state, scheduler,
# compute and memory sections), NCU_COUNT launches; the report as $OUT/ncu.ncu-rep, its
# details page as ncu.csv), step (the
# graphed step bench; with STEP_REF=DIR, a checkout of another commit, both interleaved in this
# lease: A/B). EXTRA_WHEELS: wheel files (repository paths, carried in .stage) installed into
# /root/site after the parts: the `ogs` set's triton_kernels, which has no PyPI wheel
# (scripts/offline_wheels.py `build-triton-kernels`). CLOCKS=0: no gpu-clocks.csv (by default
# nvidia-smi samples SM / memory clocks, power, temperature and throttle reasons every
# CLOCKS_MS = 250 ms for the whole round, to line up with the prefill rows' `wall` times).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}; T0=$(date +%s); FINAL=${OUT:-/tmp/out}; PREFILL_TAG=${PREFILL_TAG:-}
OUT=$FINAL/w; mkdir -p "$OUT"      # at the end: JSON/PNG up to $FINAL, every log in logs.tgz
finish() { [ -n "${CLK:-}" ] && kill "$CLK" 2>/dev/null
  mv "$OUT"/*.json "$OUT"/*.png "$OUT"/*.csv "$FINAL"/ 2>/dev/null; tar czf "$FINAL/logs.tgz" -C "$OUT" . ; rm -rf "$OUT"; }
trap finish EXIT
if [ "${CLOCKS:-1}" != 0 ] && command -v nvidia-smi > /dev/null; then   # read only: clocks,
  Q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu      # power, throttling, for
  for r in clocks_event_reasons.active clocks_throttle_reasons.active; do   # the whole round
    nvidia-smi --query-gpu=$Q,$r --format=csv -c 1 > /dev/null 2>&1 && { Q=$Q,$r; break; }
  done                                 # the throttle field under either driver's name, or none
  nvidia-smi --query-gpu=$Q --format=csv,nounits -lms "${CLOCKS_MS:-250}" \
    > "$OUT/gpu-clocks.csv" 2> /dev/null &
  CLK=$!
fi
if [ -n "${PART:-}" ]; then
  python3 scripts/offline_wheels.py install "$PART" 2>&1 | tail -2
  [ -f /root/site/env.sh ] || exit 0          # not the last part yet
fi
[ -f /root/site/env.sh ] && source /root/site/env.sh
for w in ${EXTRA_WHEELS:-}; do      # wheels built here (e.g. triton_kernels), carried in .stage
  python3 -m pip install -q --no-deps --target /root/site "$w" 2>&1 | tail -1
done
for d in kernels models scripts engine cluster actors; do ln -sfn ../$d raydecode/$d; done
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export RAYDECODE_KERNEL_CACHE=${RAYDECODE_KERNEL_CACHE:-/tmp/raydecode-kcache}
left() { echo $(( ${TOTAL_S:-570} - ($(date +%s) - T0) )); }
lim() { local want=$1 l; l=$(left); echo $(( want < l - 5 ? want : l - 5 )); }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import cutlass; print('cutlass-dsl', cutlass.__version__)" 2>&1 | tail -1
  python3 -c "import ray, fastapi, openai, pydantic; print('ray', ray.__version__, 'openai', openai.__version__, 'pydantic', pydantic.__version__)" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for s in ${STEPS:-}; do
  case $s in
  tests)
    for t in ${TESTS:-test_served_path_gpu test_step_graph_gpu}; do   # FILE or FILE:K_EXPR
      f=${t%%:*}; k=""; [ "$f" != "$t" ] && k=${t#*:}
      timeout "$(lim ${TEST_S:-150})" python3 -m pytest "tests/gpu/$f.py" -q -p no:cacheprovider \
        --maxfail=4 ${k:+-k "$k"} > "$OUT/pytest-$f.log" 2>&1
      echo "pytest $f rc=$? t=$(( $(date +%s) - T0 ))"; tail -2 "$OUT/pytest-$f.log"
      grep -E "^E  |^FAILED|Error:" "$OUT/pytest-$f.log" | cut -c1-300 | head -12
    done ;;
  cp)
    timeout "$(lim ${CP_S:-200})" python3 -m raydecode.scripts.bench.control_plane \
      --ranks "${CP_RANKS:-1,4,8,16}" --steps "${CP_STEPS:-2000}" --commit "$COMMIT" \
      --out "$OUT/control-plane.json" > "$OUT/control-plane.log" 2>&1
    echo "control-plane rc=$? t=$(( $(date +%s) - T0 ))"; grep "control-plane\]" "$OUT/control-plane.log" | tail -40 ;;
  serve)
    timeout "$(lim ${SERVE_S:-420})" python3 -m raydecode.scripts.bench.serve --commit "$COMMIT" \
      --levels "${LEVELS:-1,4,16,64}" --output-tokens "${NTOK:-96}" \
      --control-plane "${CP_JSON:-$OUT/control-plane.json}" --out "$OUT/serve.json" \
      --png "$OUT/serve.png" ${SERVE_ARGS:-} \
      > "$OUT/serve.log" 2>&1
    echo "serve rc=$? t=$(( $(date +%s) - T0 ))"; grep "\[serve\]" "$OUT/serve.log" | cut -c1-1800
    grep -E "Error|error" "$OUT/serve.log" | grep -v "Deprecat" | cut -c1-300 | tail -8 ;;
  prefix)
    timeout "$(lim ${PREFIX_S:-300})" python3 -m raydecode.scripts.bench.prefix_cache \
      --commit "$COMMIT" --out "$OUT/prefix-cache.json" ${PREFIX_ARGS:-} > "$OUT/prefix.log" 2>&1
    echo "prefix rc=$? t=$(( $(date +%s) - T0 ))"; grep "\[prefix" "$OUT/prefix.log" | cut -c1-1500
    grep -E "Error|error" "$OUT/prefix.log" | grep -v "Deprecat" | cut -c1-300 | tail -8 ;;
  prefill)
    timeout "$(lim ${PREFILL_S:-400})" python3 -m raydecode.scripts.bench.prefill \
      --commit "$COMMIT" --out "$OUT/prefill$PREFILL_TAG.json" --png "$OUT/prefill$PREFILL_TAG.png" \
      ${PREFILL_ARGS:-} > "$OUT/prefill$PREFILL_TAG.log" 2>&1
    echo "prefill rc=$? t=$(( $(date +%s) - T0 ))"; grep "\[prefill" "$OUT/prefill$PREFILL_TAG.log" | cut -c1-1500
    grep -E "Error|error" "$OUT/prefill$PREFILL_TAG.log" | grep -v "Deprecat" | cut -c1-300 | tail -8 ;;
  kverify)
    timeout "$(lim ${KVERIFY_S:-200})" python3 -m raydecode.scripts.bench.kda_verify --commit "$COMMIT" \
      --out "$OUT/kda-verify.json" ${KVERIFY_ARGS:-} > "$OUT/kda-verify.log" 2>&1
    echo "kda-verify rc=$? t=$(( $(date +%s) - T0 ))"; grep "^h=" "$OUT/kda-verify.log" | cut -c1-120
    grep -E "Error|error" "$OUT/kda-verify.log" | cut -c1-300 | tail -8 ;;
  spec)
    timeout "$(lim ${SPEC_S:-400})" python3 -m raydecode.scripts.bench.spec --commit "$COMMIT" \
      --out "$OUT/spec.json" --png "$OUT/spec.png" ${SPEC_ARGS:-} > "$OUT/spec.log" 2>&1
    echo "spec rc=$? t=$(( $(date +%s) - T0 ))"; grep "\[spec" "$OUT/spec.log" | cut -c1-1500
    grep -E "Error|error" "$OUT/spec.log" | grep -v "Deprecat" | cut -c1-300 | tail -8 ;;
  explore)
    for x in ${EXPLORE:-}; do          # NAME or NAME:ARGS, "@" for a space in ARGS
      n=${x%%:*}; a=""; [ "$n" != "$x" ] && a=$(echo "${x#*:}" | tr '@' ' ')
      timeout "$(lim ${EXPLORE_S:-300})" python3 -m raydecode.scripts.explore.$n \
        --commit "$COMMIT" --out "$OUT/$n.json" $a > "$OUT/$n.log" 2>&1
      echo "explore $n rc=$? t=$(( $(date +%s) - T0 ))"
      grep -vE "Warning|warn" "$OUT/$n.log" | tail -30 | cut -c1-400
    done ;;
  ncu)
    secs=""
    for x in ${NCU_SECTIONS:-WarpStateStats SchedulerStats ComputeWorkloadAnalysis \
               MemoryWorkloadAnalysis SpeedOfLight LaunchStats Occupancy}; do
      secs="$secs --section $x"
    done
    timeout "$(lim ${NCU_S:-240})" ncu --clock-control none $secs -k "regex:${NCU_KERNELS:?}" \
      -c "${NCU_COUNT:-2}" -f -o "$OUT/ncu" python3 -m raydecode.scripts.explore.${NCU_MODULE:?} \
      --commit "$COMMIT" --out "$OUT/ncu-run.json" $(echo "${NCU_ARGS:-}" | tr '@' ' ') \
      > "$OUT/ncu.log" 2>&1
    echo "ncu rc=$? t=$(( $(date +%s) - T0 ))"; tail -5 "$OUT/ncu.log" | cut -c1-300
    ncu --import "$OUT/ncu.ncu-rep" --csv --page details > "$OUT/ncu.csv" 2>/dev/null
    grep -E -e "Stall|Warp Cycles Per Issued|Issue Slots Busy|Compute \(SM\) Throughput" \
      -e "Memory Throughput|Duration|Registers Per|Achieved Occupancy" \
      "$OUT/ncu.csv" | cut -c1-220 | head -60 ;;
  step)
    B=${BATCHES:-1,4,16,64}
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for side in new ${STEP_REF:+ref}; do
        dir=$PWD; [ "$side" = ref ] && dir=$STEP_REF
        ( cd "$dir" && for d in kernels models scripts engine cluster actors; do ln -sfn ../$d raydecode/$d; done
          PYTHONPATH=$dir:${PYTHONPATH#$PWD:} timeout "$(lim ${STEP_S:-150})" python3 -m raydecode.scripts.bench.step \
            --tp 16 --batches "$B" --steps 20 --variants graphed --commit "$side-$COMMIT" \
            --out "$OUT/step-$side-$round.json" ) > "$OUT/step-$side-$round.log" 2>&1
        echo "step $side round $round rc=$? t=$(( $(date +%s) - T0 ))"; grep "^\[step\]" "$OUT/step-$side-$round.log"
      done
    done ;;
  esac
done
echo "done t=$(( $(date +%s) - T0 ))"
