#!/usr/bin/env bash
# One GPU-machine session of foldtune's benchmarks, phase by phase, on every GPU the machine has.
#
#   bench/gpu_session.sh PHASE...      (from the repo root on the GPU machine; .whl/ carried, see README)
#
# Phases (each one's output goes to $OUT/log.txt; results to $RES, tarred to $OUT/results.tgz after each):
#   equiv      NCCL equivalence matrix of the layouts that need > 2 GPUs (bench/nccl_equivalence.py)
#   calibrate  foldtune calibrate over all GPUs -> $RES/<gpu>-x<N>-calibrated.json
#   fp8cal     foldtune calibrate --precision fp8 (fp8 GEMM curve for bench/validate_reference.py) -> $RES/<gpu>-x<N>-fp8.json
#   tableN     cost-model accuracy table of the Mixtral proxy (2 layers, seq 4096) on N GPUs (N = 1, 2, 4, 8)
#   tables12   table1 on the last GPU while table2 runs on GPUs 0,1 (a 4-GPU machine's spare GPUs)
#   table2x    every layout of the 2-GPU regret space (alltoall, recompute none/full, mbs <= 2), two shards
#              measured at once on GPU pairs 0,1 and 2,3 (TABLE2_LAYOUTS: a diverse subset of that many)
#   last       executor bench on GPUs 0,1 (EXEC_PARTS) | CP attention check on GPU 2 | table1 on GPU 3
#   tune       a tuning job of byte-moe-650m through Ray over all GPUs (foldtune tune)
#   train      foldtune train --job <the tune job> on real text for TRAIN_STEPS steps
#   redo       re-measure the failed layouts of stored tables (REDO4, REDO2: comma lists of table files)
#   last4      at once: executor bench on GPUs 0,1 (EXEC_PARTS) | fp8 check (bench/fp8_check.py) on GPU 2 |
#              table1 on GPU 3
#   fp8check   bench/fp8_check.py on GPU 0 (fp8 kernels vs emulation, speed, a bf16/fp8 profile)
#   power      bench/power_probe.py on GPU 0: GEMM clock under 20 s of load, MoE layer/ideal alternated
#   last3      at once: executor bench on GPUs 0,1 (EXEC_PARTS), component calibration of the Mixtral
#              proxy on GPU 2, table1 on GPU 3
#   executor   bench/executor_gpu.py (MoE layer / stack / EP2 parts) on GPU 0 (and 1)
#   probe      CP attention check (bench/cp_attention_check.py) on GPU 0 beside the EP all-to-all probe
#              (bench/a2a_probe.py) on the last two GPUs, then the probe over every GPU
#   components component calibration of the Mixtral proxy at seq 4096 mbs 1 and 2, seq 2048 and 1024 mbs 1,
#              one shape per GPU at once, merged into the machine profile -> $RES/<gpu>-x<N>-components.json
#   archmoe    bench/executor_gpu.py on GPU 0: the MoE layer / ideal bars of the Qwen3-30B-A3B (>= 0.90) and
#              DeepSeek-V3 (32 of 256 experts, shared expert, sigmoid group-limited routing; >= 0.90) layers,
#              forced balance (headline) and the router's own choices, plus the dense GEMM ceiling and the
#              per-stage breakdown (ARCH_PARTS, default gemm,moe,moe_breakdown; ARCH_SHAPES, default
#              qwen3-30b-a3b,deepseek-v3; add mixtral for its row) -> $RES/executor_gpu_arch.json
#   archtune   over HTTP on all GPUs: foldtune serve + foldtune runner, one tuning job per model of
#              ARCHTUNE_MODELS (default "qwen3-30b-a3b deepseek-v2-lite") submitted as an ARCHTUNE_LAYERS-layer
#              proxy (submit --layers, default 4) at seq ARCHTUNE_SEQ (4096), gbs ARCHTUNE_GBS (2 per GPU),
#              ARCHTUNE_TRIALS trials (6) within ARCHTUNE_SECONDS (150 s) each; waits for each job, prints its
#              trials and best layout, then foldtune train --job on that layout for ARCHTUNE_STEPS steps (200,
#              TRAIN_TIMEOUT each) -> $RES/archtune-<model>-job.json, $RES/archtune-<model>-train.log, service
#              logs in $RES/archtune-{serve,runner}.log. Both models need more than one 10-minute call: run
#              one model per call (ARCHTUNE_MODELS=qwen3-30b-a3b, then ARCHTUNE_MODELS=deepseek-v2-lite)
# Environment: TRAIN_STEPS (default 1200), TABLE_LAYOUTS (default 24), TRAIN_TIMEOUT (s, default 240),
# SUSTAINED_S (seconds of calibrate's sustained-load run; default: calibrate's own, 10), and the ARCH*
# variables of archmoe and archtune above.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_AUTH_MODE=disabled FOLDTUNE_DATA_DIR=/tmp/foldtune TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=0
OUT=${OUT:-/tmp/out}; RES=$OUT/res; mkdir -p "$OUT" "$RES" "$FOLDTUNE_DATA_DIR"
LOG=$OUT/log.txt
exec > >(tee -a "$LOG") 2>&1

source bench/gpu_env.sh
ft() { python3 -m api.cli.main "$@"; }
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
gpu_type
PROFILE=$RES/$GPU-x$NGPU-calibrated.json
[ -f "$PROFILE" ] || PROFILE=$(ls bench/results/$GPU-x$NGPU-calibrated*.json 2>/dev/null | head -1)
echo "== $(date -u '+%F %T UTC') $NGPU x $NAME ($GPU); torch $(python3 -c 'import torch; print(torch.__version__)')"
nvidia-smi topo -m 2>/dev/null | head -8

pack() { local tmp="$OUT/.results.$BASHPID.tgz"; tar czf "$tmp" -C "$RES" . 2>/dev/null && mv -f "$tmp" "$OUT/results.tgz"; }
# a call cut off by its time limit still returns what it measured: pack every 30 s as well as after each phase
( while sleep 30; do pack; done ) & PACKER=$!
trap 'kill $PACKER 2>/dev/null; pack' EXIT
phase() { echo; echo "== phase $1 start $(date -u +%T)"; }
done_() { echo "== phase $1 rc=$2 end $(date -u +%T)"; pack; }

table() {  # table N [CUDA_VISIBLE_DEVICES] [extra args...]
  local n=$1 devs=${2:-} prof=(); shift 2 || shift $#
  [ -n "${PROFILE:-}" ] && [ -f "$PROFILE" ] && prof=(--profile "$PROFILE")
  local extra=(--mbs-max 2 --recompute none,full --dispatchers alltoall,allgather --max-layouts "${TABLE_LAYOUTS:-24}")
  [ "$n" = 1 ] && extra=(--mbs-max 4 --recompute "none,full,core_attn,moe_act+layernorm" --dispatchers alltoall)
  [ $# -gt 0 ] && extra=("$@")
  CUDA_VISIBLE_DEVICES=${devs:-$CUDA_VISIBLE_DEVICES_ALL} python3 -m bench.costmodel_accuracy --model mixtral-8x7b \
    --layers 2 --gpus "$n" --gpu "$GPU" "${prof[@]}" --seq 4096 --gbs $((n >= 4 ? 16 : 8)) --precision bf16 \
    --cp-min-chunk 1024 --warmup 1 --steps 3 --trial-timeout 150 --results-dir "$RES/table$n" --no-write "${extra[@]}"
}
CUDA_VISIBLE_DEVICES_ALL=$(seq -s, 0 $((NGPU - 1)))

prep_data() {  # the byte-level training text of the train phases (/tmp/data), once per machine
  [ -f /tmp/data.prepared ] && return 0
  local site; site=$(python3 -c "import site; print(site.getsitepackages()[0])")
  ft data prepare "$site" /tmp/site --out /tmp/data --heldout 0.02 --overwrite | tail -3 && touch /tmp/data.prepared
}

stop_pid() {  # SIGTERM, up to 30 s to exit (a runner hands its job back), then SIGKILL
  local pid=$1 i
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq 30); do kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null; return 0; }; sleep 1; done
  kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
}

api_json() {  # api_json PATH: GET $FOLDTUNE_URL/PATH with the phase's key, pretty JSON on stdout
  python3 -c "import json, os, sys, httpx
r = httpx.get(os.environ['FOLDTUNE_URL'] + sys.argv[1], headers={'X-API-Key': os.environ['FOLDTUNE_API_KEY']}, timeout=30)
print(json.dumps(r.json(), indent=1))" "$1"
}

archtune() {  # see the header; returns the number of models whose job or training did not succeed
  local models=(${ARCHTUNE_MODELS:-qwen3-30b-a3b deepseek-v2-lite}) layers=${ARCHTUNE_LAYERS:-4}
  local seq=${ARCHTUNE_SEQ:-4096} gbs=${ARCHTUNE_GBS:-$((2 * NGPU))} seconds=${ARCHTUNE_SECONDS:-150}
  local port=${ARCHTUNE_PORT:-8321} failed=0 srv runner m id out i
  local -A job_of=()
  if ! ft submit --help | grep -q -- "--layers"; then
    echo "archtune: foldtune submit has no --layers (the proxy depth) in this checkout; not run"; return 1
  fi
  prep_data || { echo "archtune: data prepare failed"; return 1; }
  export FOLDTUNE_URL=http://127.0.0.1:$port
  FOLDTUNE_API_KEY=$(ft keys create "archtune-$$" | tail -1); export FOLDTUNE_API_KEY
  case "$FOLDTUNE_API_KEY" in ft_*) ;; *) echo "archtune: no API key ($FOLDTUNE_API_KEY)"; return 1 ;; esac
  ft serve --port "$port" --log-level warning > "$RES/archtune-serve.log" 2>&1 & srv=$!
  for i in $(seq 60); do ft jobs --limit 1 > /dev/null 2>&1 && break; sleep 1; done
  if ! ft jobs --limit 1 > /dev/null; then
    echo "archtune: the API did not come up in 60 s"; tail -20 "$RES/archtune-serve.log"; stop_pid "$srv"; return 1
  fi
  # trial budget as the tune phase's: 1 warm-up and 3 timed steps, 90 s per trial
  FOLDTUNE_TRIAL_WARMUP_STEPS=1 FOLDTUNE_TRIAL_STEPS=3 FOLDTUNE_TRIAL_TIMEOUT_S=90 \
    ft runner --runner-id archtune > "$RES/archtune-runner.log" 2>&1 & runner=$!
  for m in "${models[@]}"; do  # all queued at once: the runner takes them one after the other
    out=$(ft submit --model "$m" --layers "$layers" --gpu "$GPU" --gpus "$NGPU" --seq "$seq" --gbs "$gbs" \
            --max-trials "${ARCHTUNE_TRIALS:-6}" --max-seconds "$seconds" 2>&1)
    echo "$out"
    id=$(sed -n 's/^job \([0-9][0-9]*\) .*/\1/p' <<< "$out" | head -1)
    if [ -n "$id" ]; then job_of[$m]=$id; else echo "archtune: $m not submitted"; failed=$((failed + 1)); fi
  done
  for m in "${models[@]}"; do
    id=${job_of[$m]:-}; [ -n "$id" ] || continue
    echo "---- $m: job $id"
    # a job waits for the one before it; its own budget is $seconds, plus Ray start and the last trial
    timeout $((seconds + 240)) python3 -m api.cli.main jobs "$id" --wait; i=$?
    if [ $i = 124 ]; then echo "archtune: job $id still running after $((seconds + 240)) s: cancelled"; ft jobs "$id" --cancel; fi
    ft jobs "$id"
    api_json "/v1/jobs/$id" > "$RES/archtune-$m-job.json"
    python3 -c "import json, sys
j = json.load(open(sys.argv[1])); b = j.get('best_trial') or {}
print(f\"{sys.argv[2]}: job {j.get('id')} {j.get('status')}; best layout: {b.get('label') or b.get('config') or 'none'}\"
      + (f\" at {b['step_time_s'] * 1e3:.1f} ms/step\" if b.get('step_time_s') else ''))" "$RES/archtune-$m-job.json" "$m"
    [ $i = 0 ] || { failed=$((failed + 1)); unset "job_of[$m]"; }
  done
  stop_pid "$runner"  # its Ray gives the GPUs back before the trainings start their own
  tail -5 "$RES/archtune-runner.log"
  for m in "${models[@]}"; do
    id=${job_of[$m]:-}; [ -n "$id" ] || continue
    echo "---- $m: train --job $id, ${ARCHTUNE_STEPS:-200} steps"
    # the job fixes the model (its proxy depth included), GPUs, seq, batch and precision
    timeout "${TRAIN_TIMEOUT:-240}" python3 -m api.cli.main train --job "$id" --data /tmp/data \
      --steps "${ARCHTUNE_STEPS:-200}" --warmup 20 --eval-every 100 --checkpoint-dir "/tmp/ckpt-archtune-$id" \
      > "$RES/archtune-$m-train.log" 2>&1 || { echo "archtune: training of job $id failed (rc $?)"; failed=$((failed + 1)); }
    awk 'NR % 20 == 1' "$RES/archtune-$m-train.log" | head -30; tail -6 "$RES/archtune-$m-train.log"
  done
  stop_pid "$srv"
  return $failed
}

for p in "$@"; do
  phase "$p"; rc=0
  case "$p" in
    equiv) timeout 420 python3 -m bench.nccl_equivalence --out "$RES/nccl_equivalence.json"; rc=$? ;;
    calibrate)
      timeout 240 python3 -m api.cli.main calibrate --gpu "$GPU" --ranks "$NGPU" --name "$GPU-x$NGPU-calibrated" \
        ${SUSTAINED_S:+--sustained-seconds "$SUSTAINED_S"} --out "$RES/$GPU-x$NGPU-calibrated.json"; rc=$?
      [ $rc = 0 ] && PROFILE=$RES/$GPU-x$NGPU-calibrated.json ;;
    fp8cal)
      timeout 240 python3 -m api.cli.main calibrate --gpu "$GPU" --ranks "$NGPU" --precision fp8 \
        ${SUSTAINED_S:+--sustained-seconds "$SUSTAINED_S"} --name "$GPU-x$NGPU-fp8" --out "$RES/$GPU-x$NGPU-fp8.json"; rc=$? ;;
    table1|table2|table4|table8) table "${p#table}" ""; rc=$? ;;
    table2x)  # the whole 2-GPU space of the search-regret benchmark, one half on each GPU pair
      x=(--mbs-max 2 --recompute none,full --dispatchers alltoall)
      [ -n "${TABLE2_LAYOUTS:-}" ] && x+=(--max-layouts "$TABLE2_LAYOUTS")
      table 2 0,1 "${x[@]}" --shard 0/2 > "$OUT/t0.log" 2>&1 & t0=$!
      table 2 2,3 "${x[@]}" --shard 1/2 > "$OUT/t1.log" 2>&1; rc1=$?
      wait $t0; rc=$?; cat "$OUT/t0.log" "$OUT/t1.log"; rm -f "$OUT/t0.log" "$OUT/t1.log"; rc=$((rc + rc1)) ;;
    redo)  # re-measure the failed layouts of stored tables: REDO4 (4 GPUs), REDO2 (2 GPUs, on both GPU pairs)
      was=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1].split(',')[0]))['device'])" "${REDO4:-${REDO2}}")
      if [ "$was" != "$NGPU""x $NAME" ]; then echo "redo skipped: tables from '$was', this is '${NGPU}x $NAME'"; continue; fi
      [ -n "${REDO4:-}" ] && { table 4 "" --mbs-max 2 --recompute none,full --dispatchers alltoall,allgather \
                                 --redo "$REDO4"; rc=$?; }
      if [ -n "${REDO2:-}" ]; then
        x=(--mbs-max 2 --recompute none,full --dispatchers alltoall --redo "$REDO2")
        table 2 0,1 "${x[@]}" --shard 0/2 > "$OUT/t0.log" 2>&1 & t0=$!
        table 2 2,3 "${x[@]}" --shard 1/2 > "$OUT/t1.log" 2>&1; rc1=$?
        wait $t0; rc=$((rc + $? + rc1)); cat "$OUT/t0.log" "$OUT/t1.log"; rm -f "$OUT/t0.log" "$OUT/t1.log"
      fi ;;
    last4)
      CUDA_VISIBLE_DEVICES=0,1 timeout 480 python3 -m bench.executor_gpu --parts "${EXEC_PARTS:-gemm,moe,stack,ep2}" \
        --out "$RES/executor_gpu.json" > "$OUT/ex.log" 2>&1 & ex=$!
      CUDA_VISIBLE_DEVICES=$((NGPU > 2 ? 2 : 0)) timeout 300 python3 -m bench.fp8_check --out "$RES/fp8_check.json" \
        > "$OUT/fp8.log" 2>&1 & f8=$!
      table 1 $((NGPU - 1)) > "$OUT/t1.log" 2>&1; rc=$?
      wait $f8; rc=$((rc + $?)); wait $ex; rc=$((rc + $?))
      for f in ex fp8 t1; do echo "---- $f"; grep -v -E "TensorLikePair|^\s+\[\[?-?[0-9]|^\s+tensor\(|device='cuda" "$OUT/$f.log"; done
      rm -f "$OUT/ex.log" "$OUT/fp8.log" "$OUT/t1.log" ;;
    fp8check) CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m bench.fp8_check --out "$RES/fp8_check.json"; rc=$? ;;
    power) CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m bench.power_probe --seconds 20 --out "$RES/power_probe.json"; rc=$? ;;
    last3)  # a 4-GPU machine's last call: executor bench (GPUs 0,1) | component calibration (2) | table1 (3)
      CUDA_VISIBLE_DEVICES=0,1 timeout 480 python3 -m bench.executor_gpu --parts "${EXEC_PARTS:-gemm,moe,stack,ep2}" \
        --out "$RES/executor_gpu.json" > "$OUT/ex.log" 2>&1 & ex=$!
      ( for mbs in 1 2; do CUDA_VISIBLE_DEVICES=2 timeout 200 python3 -m api.cli.main calibrate --gpu "$GPU" --ranks 1 \
          --quick --model mixtral-8x7b --layers 2 --seq 4096 --mbs $mbs --out "$RES/$GPU-components-mbs$mbs.json"; done
      ) > "$OUT/comp.log" 2>&1 & comp=$!
      table 1 3 > "$OUT/t1.log" 2>&1; rc=$?
      wait $comp; rc=$((rc + $?)); wait $ex; rc=$((rc + $?))
      for f in ex comp t1; do echo "---- $f"; grep -v -E "TensorLikePair|^\s+\[\[?-?[0-9]|^\s+tensor\(|device='cuda" "$OUT/$f.log"; done
      rm -f "$OUT/ex.log" "$OUT/comp.log" "$OUT/t1.log" ;;
    probe)
      CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m bench.cp_attention_check --out "$RES/cp_attention.json" \
        > "$OUT/cp.log" 2>&1 & cp=$!
      CUDA_VISIBLE_DEVICES=$((NGPU - 2)),$((NGPU - 1)) timeout 240 python3 -m bench.a2a_probe --world 2 \
        --out "$RES/a2a_probe_ep2.json"; rc=$?
      wait $cp; rc=$((rc + $?)); echo "---- cp attention"; cat "$OUT/cp.log"; rm -f "$OUT/cp.log"
      if [ "$NGPU" -gt 2 ]; then
        timeout 240 python3 -m bench.a2a_probe --world "$NGPU" --out "$RES/a2a_probe_ep$NGPU.json"; rc=$((rc + $?))
      fi ;;
    components)
      shapes=("4096 1" "4096 2" "2048 1" "1024 1"); pids=(); files=()
      for i in "${!shapes[@]}"; do
        read -r seq mbs <<< "${shapes[$i]}"; f="$RES/$GPU-components-seq$seq-mbs$mbs.json"; files+=("$f")
        CUDA_VISIBLE_DEVICES=$((i % NGPU)) timeout 300 python3 -m api.cli.main calibrate --gpu "$GPU" --ranks 1 \
          --quick --model mixtral-8x7b --layers 2 --seq "$seq" --mbs "$mbs" --out "$f" > "$OUT/comp$i.log" 2>&1 &
        pids+=($!)
        if [ $(( (i + 1) % NGPU )) = 0 ]; then for q in "${pids[@]}"; do wait "$q" || rc=$((rc + 1)); done; pids=(); fi
      done
      for q in "${pids[@]}"; do wait "$q" || rc=$((rc + 1)); done
      for i in "${!shapes[@]}"; do grep -A6 "^components of" "$OUT/comp$i.log"; rm -f "$OUT/comp$i.log"; done
      if [ -n "${PROFILE:-}" ] && [ -f "$PROFILE" ]; then
        ft calibrate merge --profile "$PROFILE" --components "$(IFS=,; echo "${files[*]}")" \
          --out "$RES/$GPU-x$NGPU-components.json" --name "$GPU-x$NGPU-components" && \
          PROFILE=$RES/$GPU-x$NGPU-components.json
      fi ;;
    last)
      CUDA_VISIBLE_DEVICES=0,1 timeout 420 python3 -m bench.executor_gpu --parts "${EXEC_PARTS:-gemm,moe,stack,ep2}" \
        --out "$RES/executor_gpu.json" > "$OUT/ex.log" 2>&1 & ex=$!
      CUDA_VISIBLE_DEVICES=2 timeout 240 python3 -m bench.cp_attention_check --out "$RES/cp_attention.json" \
        > "$OUT/cp.log" 2>&1 & cp=$!
      table 1 3 > "$OUT/t1.log" 2>&1; rc=$?
      wait $cp; rc=$((rc + $?)); wait $ex; rc=$((rc + $?))
      for f in ex cp t1; do echo "---- $f"; grep -v -E "TensorLikePair|^\s+\[\[?-?[0-9]|^\s+tensor\(|device='cuda" "$OUT/$f.log"; done
      rm -f "$OUT/ex.log" "$OUT/cp.log" "$OUT/t1.log" ;;
    tables12)
      table 2 0,1 > "$OUT/table2.log" 2>&1 & t2=$!
      table 1 $((NGPU - 1)) > "$OUT/table1.log" 2>&1; rc1=$?
      wait $t2; rc=$?; cat "$OUT/table1.log" "$OUT/table2.log"; rm -f "$OUT/table1.log" "$OUT/table2.log"
      rc=$((rc + rc1)) ;;
    tune)
      prof=(--gpu "$GPU"); [ -n "${PROFILE:-}" ] && [ -f "$PROFILE" ] && prof=(--profile "$PROFILE")
      timeout 300 python3 -m api.cli.main tune --model byte-moe-650m "${prof[@]}" --gpus "$NGPU" --seq 1024 --gbs 32 \
        --max-trials 6 --max-seconds 200 --warmup 2 --steps 3 --trial-timeout 90; rc=$? ;;
    train)
      prep_data
      timeout "${TRAIN_TIMEOUT:-240}" python3 -m api.cli.main train --job 1 --data /tmp/data --steps "${TRAIN_STEPS:-1200}" \
        --lr 1e-3 --min-lr 1e-4 --warmup 50 --eval-every 200 --checkpoint-dir /tmp/ckpt > "$OUT/train.log" 2>&1; rc=$?
      awk 'NR % 25 == 1' "$OUT/train.log" | head -80; tail -15 "$OUT/train.log"
      mv "$OUT/train.log" "$RES/train.log" ;;  # metrics: training_metrics of $RES/foldtune.sqlite3
    executor)
      timeout 420 python3 -m bench.executor_gpu --parts gemm,moe,stack,ep2 --out "$RES/executor_gpu.json"; rc=$? ;;
    archmoe)
      CUDA_VISIBLE_DEVICES=0 timeout 540 python3 -m bench.executor_gpu --parts "${ARCH_PARTS:-gemm,moe,moe_breakdown}" \
        --shapes "${ARCH_SHAPES:-qwen3-30b-a3b,deepseek-v3}" --out "$RES/executor_gpu_arch.json"; rc=$? ;;
    archtune) archtune; rc=$? ;;
    *) echo "unknown phase $p"; rc=2 ;;
  esac
  cp -f "$FOLDTUNE_DATA_DIR"/foldtune.sqlite3 "$RES/" 2>/dev/null
  done_ "$p" $rc
done
echo "== end $(date -u '+%F %T UTC')"
