#!/usr/bin/env bash
# Issues 16 and 19 on a 2-GPU machine in one call (what their bars still need measured): everything lands in $OUT/res and is packed into $OUT/results.tgz
# every 30 s and at the end (a call cut off by its time limit keeps what was measured; at most 8 files come
# back from a device call, so one archive), the log in $OUT/issue16_log.txt. Phases (PHASES, default all, in
# this order):
#   calibrate  foldtune calibrate over both GPUs (full, with the MLA attention shape) -> res/<gpu>-calibrated.json
#   trace      bench/layout_trace_gpu.py: one profiled step per rank of the 2-GPU layouts the model missed most
#              (DeepSeek-V2-Lite dp2 / TP2 / CP2 / EP2, Mixtral EP2) -> res/trace-<model>.json
#   cpdisp     bench/cp_dispatch_gpu.py: CP2 vs CP1 at seq 2k/4k/8k, alltoall vs allgather at EP2 -> res/cp_dispatch.json
#   raycal     foldtune calibrate --ray --quick over both GPUs of this host as one Ray node (the NCCL ranks as Ray
#              actors; one node, so no NIC stage) -> res/<gpu>-ray-calibrated.json (needs the Ray wheel)
#   first      bench/first_trial_gpu.sh: one fresh tuning job per proxy, the first after a quick calibration
#   fixedcost  issue 19: a 2-GPU tuning job of 8 trials with kept ranks (bench/trial_fixed_cost_gpu.sh, reuse only)
#   overlap    issue 19: EP2 step with and without the all-to-all overlap (bench/ep_overlap_gpu.py; OVERLAP_ARGS,
#              default --trace; a sweep of SM carveouts and NCCL channel caps: OVERLAP_ARGS="--rounds 1 --variants
#              on,on_carve8,on_carve16,on_carve32,on_nch8", ~2-3 min; OVERLAP_TIMEOUT, default 300 s)
#   ceprobe    issue 19: the copy-engine all-to-all against NCCL's on 2 GPUs: equality, speed, and what each takes
#              from grouped GEMMs beside it (bench/ce_alltoall_probe.py)
#   paired     issue 19: the same EP2 step with the overlap off and on in paired steps of one 2-process world
#              (bench/ep_overlap_paired.py; PAIRS, default 12), once per overlap transport in TRANSPORTS
#              (default auto, the executor's; "copy_engine nccl" for both): the bar's quotient without run-to-run
#              noise
#   components the per-model component factors of each proxy (MODELS), one GPU each, two at a time (`foldtune
#              calibrate --quick --model M --layers 2 --seq 4096 --ranks 1`), merged against this call's calibrated
#              profile -> res/<gpu>-calibrated-components.json (the tables replay with it off the device)
#   losskernel the output layer + loss with the Triton cross-entropy kernels against the same blocks on torch ops
#              and the unfused path (bench/loss_memory.py, GPU 0) -> res/loss_memory.json
#   fp8check   issue 19: fp8's loss against bf16 with its controls (the fp8 emulation on the GPU, bf16 with the
#              unfused loss: the noise floor) and every grouped GEMM against fp64 (bench/grouped_mm_probe.py), GPU 0
#   tables     bench/accuracy_gpu.sh with the calibration of this call: the proxies' 1- and 2-GPU layout tables
#   offload    issue 19: optimizer offload of a Mixtral proxy (4 layers) that does not fit without it, on GPU 0
#              (bench/offload_gpu.py --run-without; needs ~85 GB of host memory)
#   stack      issue 19: the decoder stack's profile (bench/stack_profile.py) on GPU 0, beside (GPU 1) the
#              1-GPU layout table of deepseek-v2-lite (not in the default phases: measured 2026-11-27)
# Environment: PHASES, MODELS (tables and first), STORED (calibrated profiles the offload phase may price with), TABLE2_LAYOUTS (default 16), COMMIT (the code's commit).
# All phases take more than one 10-minute device call (measured on 2 x H200, 2026-11-27: calibrate 65 s,
# components 60 s with isolated blocks, 116 s in-step with the host probes (below), tables of three proxies 5.5 min
# at 3 steps a layout and 4.5 min at 6, fp8check 4 min, overlap 2 rounds 65-110 s; estimated: cpdisp 1.5): run
# them in two or three calls, e.g.
#   PHASES="calibrate components tables"   then   PHASES="overlap offload"   then   PHASES=fp8check
# (each call starts a bare machine: a phase that needs the calibration takes it from the same call). A call
# carries at most 64 MiB of working tree: carry a `.whl/` without the Ray wheel (43 MiB) unless a phase runs
# a tuning job (first, fixedcost); for those, `python3 bench/slim_ray_wheel.py` first (Ray core only, 38.7 MiB:
# .whl/ and the tree then come to about 61 MiB). gpu_env.sh installs what the wheelhouse holds.
# Measured on 2 x H200 later the same day: components with each model's host probe 116 s for three models
# (12:49-12:51 UTC), first 2.1-2.7 min, fixedcost 55 s, overlap (4 rounds) 1.9 min, paired 45 s, offload 1.7-2.1
# min, raycal 67 s.
set -uo pipefail
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
OUT=${OUT:-/tmp/out}; RES=$OUT/res; mkdir -p "$RES"
exec > >(tee -a "$OUT/issue16_log.txt") 2>&1
source bench/gpu_env.sh
gpu_type
echo "== $(date -u '+%F %T UTC') $(nvidia-smi -L | wc -l) x $NAME ($GPU), commit ${COMMIT:-?}"
pack_results "$RES" "$OUT"
phases "calibrate trace cpdisp raycal fixedcost first overlap paired components losskernel fp8check tables offload"

if has calibrate; then
  echo "== calibrate start $(date -u +%T)"
  timeout 180 python3 -m api.cli.main calibrate --gpu "$GPU" --ranks 2 --timeout 170 \
    --out "$RES/$GPU-calibrated.json" > "$RES/calibrate.log" 2>&1
  echo "calibrate rc=$? end $(date -u +%T)"; grep -A14 "causal attention" "$RES/calibrate.log" | head -16
fi
if has trace; then
  echo "== trace start $(date -u +%T)"
  T=bench/results/issue16/acc-h100
  timeout 200 python3 -m bench.layout_trace_gpu --table $T/deepseek-v2-lite/layout_table-deepseek-v2-lite-2L-2-2026-11-27-gpu.json \
    --match "ep1 etp1 dp2 edp2 mbs1,tp2 cp1,cp2 pp1 vpp1 ep1 etp1 dp1 edp2 mbs2,ep2 etp1 dp2 edp1 mbs2" \
    --out "$RES/trace-deepseek-v2-lite.json" 2>&1 | grep -v "Warning\|USDT\|self.profiler"
  timeout 90 python3 -m bench.layout_trace_gpu --table $T/mixtral-8x7b/layout_table-mixtral-8x7b-2L-2-2026-11-27-gpu.json \
    --match "ep2 etp1 dp2 edp1 mbs2" --out "$RES/trace-mixtral-8x7b.json" 2>&1 | grep -v "Warning\|USDT\|self.profiler"
  echo "trace end $(date -u +%T)"
fi
if has cpdisp; then
  echo "== cp_dispatch start $(date -u +%T)"
  timeout 240 python3 -m bench.cp_dispatch_gpu --out "$RES/cp_dispatch.json" 2>&1 | grep -v "Warning: \[PG"
  echo "cp_dispatch rc=${PIPESTATUS[0]} end $(date -u +%T)"
fi
if has raycal; then
  echo "== calibrate --ray start $(date -u +%T)"
  timeout 240 python3 -m api.cli.main calibrate --ray --gpu "$GPU" --ranks 2 --quick --timeout 230 \
    --out "$RES/$GPU-ray-calibrated.json" > "$RES/raycal.log" 2>&1
  echo "calibrate --ray rc=$? end $(date -u +%T)"
  grep -E "^calibrating|ranks ran on|^GEMM efficiency|all_to_all:intra |profile .* written|error" "$RES/raycal.log"
fi
if has first; then
  echo "== first trials start $(date -u +%T)"
  OUT=$RES/first bash bench/first_trial_gpu.sh 2>&1 | grep -E "^==|calibrat|trial +[0-9].*measured|error|priced|best layout" \
    | grep -v "Warning"
fi
if has fixedcost; then
  echo "== fixed cost start $(date -u +%T)"
  OUT=$RES/fixedcost MODES=reuse bash bench/trial_fixed_cost_gpu.sh 2>&1 | grep -E "^==|trial +[0-9].*measured|fixed cost|best layout"
fi
if has overlap && [ -f bench/ep_overlap_gpu.py ]; then
  echo "== EP overlap start $(date -u +%T)"
  timeout "${OVERLAP_TIMEOUT:-300}" python3 -m bench.ep_overlap_gpu ${OVERLAP_ARGS:---trace} --out "$RES/ep_overlap_gpu.json" 2>&1 \
    | grep -v "Warning: \[PG" | tail -40
fi
if has ceprobe; then
  echo "== copy-engine all-to-all probe start $(date -u +%T)"
  timeout 240 python3 -m bench.ce_alltoall_probe --out "$RES/ce_alltoall_probe.json" 2>&1 \
    | grep -v "Warning: \[PG" | tail -8
fi
if has paired; then
  for transport in ${TRANSPORTS:-auto}; do
    echo "== EP overlap, paired steps ($transport) start $(date -u +%T)"
    timeout 300 python3 -m bench.ep_overlap_paired --pairs "${PAIRS:-12}" --transport "$transport" \
      --out "$RES/ep_overlap_paired-$transport.json" 2>&1 | grep -v "Warning: \[PG" | tail -12
  done
fi
if has stack; then
  echo "== stack profile (GPU 0) | deepseek-v2-lite 1-GPU table (GPU 1) start $(date -u +%T)"
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m bench.stack_profile --layers 2 --out "$RES/stack_profile.json" \
    > "$RES/stack_profile.log" 2>&1 & spid=$!
  mkdir -p "$RES/dsv2-1gpu"
  CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m bench.costmodel_accuracy --model deepseek-v2-lite --layers 2 --gpus 1 \
    --gpu "$GPU" --profile "$RES/$GPU-calibrated.json" --seq 4096 --gbs 8 --precision bf16 --warmup 1 --steps 3 \
    --trial-timeout 120 --mbs-max 2 --recompute none,full,moe_act+layernorm --dispatchers alltoall \
    --results-dir "$RES/dsv2-1gpu" --no-write > "$RES/dsv2-1gpu/table1.log" 2>&1 & tpid=$!
  wait $spid; tail -60 "$RES/stack_profile.log"; wait $tpid; grep -E "^\[|measured|layouts" "$RES/dsv2-1gpu/table1.log"
fi
if has components; then
  echo "== components start $(date -u +%T)"
  comp=(); i=0; pids=()
  for m in ${MODELS:-mixtral-8x7b qwen3-30b-a3b deepseek-v2-lite}; do
    CUDA_VISIBLE_DEVICES=$((i % 2)) timeout 200 python3 -m api.cli.main calibrate --gpu "$GPU" --ranks 1 --quick \
      --model "$m" --layers 2 --seq 4096 --timeout 190 --out "$RES/comp-$m.json" > "$RES/comp-$m.log" 2>&1 & pids+=($!)
    comp+=("$RES/comp-$m.json"); i=$((i + 1))
    if [ $((i % 2)) = 0 ]; then wait "${pids[@]}"; pids=(); fi
  done
  [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
  grep -h -A8 "^components of" "$RES"/comp-*.log | grep -v "^--"
  python3 -m api.cli.main calibrate merge --profile "$RES/$GPU-calibrated.json" --components "$(IFS=,; echo "${comp[*]}")" \
    --out "$RES/$GPU-calibrated-components.json" 2>&1 | tail -3
  echo "components end $(date -u +%T)"
fi
if has losskernel; then
  echo "== loss kernel start $(date -u +%T)"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m bench.loss_memory --out "$RES/loss_memory.json" 2>&1 | tail -20
fi
if has fp8check; then
  echo "== fp8 check start $(date -u +%T)"
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m bench.grouped_mm_probe --out "$RES/grouped_mm_probe.json" 2>&1 | tail -15
  CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m bench.fp8_step --runs bf16,fp8,fp8_emulated,bf16_torch_ce \
    --out "$RES/fp8_drift.json" 2>&1 | tail -25
fi
if has tables; then
  echo "== tables start $(date -u +%T)"
  OUT=$RES/tables STORED="$RES/$GPU-calibrated.json" TABLE2_LAYOUTS=${TABLE2_LAYOUTS:-16} \
    bash bench/accuracy_gpu.sh 2>&1 | grep -E "^==|^\[|layouts, profile|datasheet|calibrated \(held"
fi
if has offload; then
  echo "== offload start $(date -u +%T)"
  # without this call's calibration, a stored one of the same GPU type (STORED: profile files) prices it
  for f in ${STORED:-}; do [ ! -f "$RES/$GPU-calibrated.json" ] && [ "$(basename "$f")" = "$GPU-calibrated.json" ] \
    && cp "$f" "$RES/" && echo "pricing with the stored $f"; done
  # 4 Mixtral layers (~6.1 B parameters, ~110 GB of weights, gradients and Adam state) overflow an 80 GB H100;
  # an H200 (141 GB) holds them, so there it takes 6 (~9.1 B)
  OFFLOAD_LAYERS=${OFFLOAD_LAYERS:-$([ "$GPU" = h200 ] && echo 6 || echo 4)}
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m bench.offload_gpu --model mixtral-8x7b --layers "$OFFLOAD_LAYERS" --gpu "$GPU" \
    $( [ -f "$RES/$GPU-calibrated.json" ] && echo --profile "$RES/$GPU-calibrated.json" ) --steps 3 --warmup 1 \
    --run-without --out "$RES/offload_gpu.json" 2>&1 | tail -25
fi
echo "== end $(date -u '+%F %T UTC')"
