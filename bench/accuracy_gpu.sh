#!/usr/bin/env bash
# Issue 16's accuracy bars on a 2-GPU machine: `foldtune calibrate` over both GPUs (CALIBRATE=0 skips it and
# uses $PROFILE), then, per proxy of MODELS (default "mixtral-8x7b qwen3-30b-a3b deepseek-v2-lite", each cut
# to LAYERS layers, default 2, seq SEQ 4096, global batch GBS 8, bf16):
#   - its 1-GPU layouts (micro-batch 1-2; recompute none, full, moe_act+layernorm), two shards at once on
#     GPUs 0 and 1;
#   - a diverse subset of TABLE2_LAYOUTS (default 16) of its 2-GPU layouts (micro-batch 1-2; recompute none,
#     full; both dispatchers) on GPUs 0,1.
# STEPS (default 6) timed steps per layout, the median kept: with 3, rows of one 2 × H200 call (2026-11-27
# 08:16) spread up to 19 % within a layout.
# SKIP1="model:gpu ..." skips 1-GPU tables measured earlier. Every layout table (with per-rank phases and peak memory) lands in $OUT/res/<model>/; bench/costmodel_accuracy.py
# --table replays them on any machine. Run from the repo root with .whl/ carried (bench/gpu_env.sh).
set -uo pipefail
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
OUT=${OUT:-/tmp/out}; RES=$OUT/res; mkdir -p "$RES"
exec > >(tee -a "$OUT/accuracy_log.txt") 2>&1
source bench/gpu_env.sh
gpu_type
echo "== $(date -u '+%F %T UTC') $(nvidia-smi -L | wc -l) x $NAME ($GPU), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
# a profile of this GPU type calibrated earlier (STORED, e.g. bench/results/issue16/acc-h100/h100-sxm-calibrated.json)
# is reused when it names this GPU type; otherwise calibrate now
PROFILE=$RES/$GPU-calibrated.json
for f in ${STORED:-}; do case "$(basename "$f")" in $GPU-calibrated.json) PROFILE=$f ;; esac; done
if [ ! -f "$PROFILE" ]; then
  echo "== calibrate start $(date -u +%T)"
  timeout 180 python3 -m api.cli.main calibrate --gpu "$GPU" --ranks 2 --timeout 170 --out "$PROFILE" \
    > "$RES/calibrate.log" 2>&1; echo "calibrate rc=$? end $(date -u +%T)"; tail -5 "$RES/calibrate.log"
fi
LAYERS=${LAYERS:-2}; SEQ=${SEQ:-4096}; GBS=${GBS:-8}
acc() {  # acc MODEL GPUS DEVICES [args...]
  local m=$1 n=$2 devs=$3; shift 3
  CUDA_VISIBLE_DEVICES=$devs timeout "${TABLE_TIMEOUT:-400}" python3 -m bench.costmodel_accuracy --model "$m" \
    --layers "$LAYERS" --gpus "$n" --gpu "$GPU" --profile "$PROFILE" --seq "$SEQ" --gbs "$GBS" --precision bf16 \
    --cp-min-chunk 1024 --warmup 1 --steps "${STEPS:-6}" --trial-timeout 120 --results-dir "$RES/$m" --no-write "$@"
}
for m in ${MODELS:-mixtral-8x7b qwen3-30b-a3b deepseek-v2-lite}; do
  mkdir -p "$RES/$m"
  echo; echo "== $m@${LAYERS}L 1-GPU layouts start $(date -u +%T)"
  pids=()  # (a bare `wait` would also wait for the tee above, forever)
  case " ${SKIP1:-} " in *" $m:$GPU "*) echo "(1-GPU layouts of $m on $GPU measured earlier)" ;; *)
    for s in 0 1; do
      acc "$m" 1 "$s" --mbs-max 2 --recompute none,full,moe_act+layernorm --dispatchers alltoall --shard "$s/2" \
        > "$RES/$m/table1-shard$s.log" 2>&1 & pids+=($!)
    done
    wait "${pids[@]}"; grep -h "^\[" "$RES/$m"/table1-shard*.log ;;
  esac
  echo "== $m@${LAYERS}L 2-GPU layouts start $(date -u +%T)"
  acc "$m" 2 0,1 --mbs-max 2 --recompute none,full --dispatchers alltoall,allgather \
    --max-layouts "${TABLE2_LAYOUTS:-16}" 2>&1 | grep -v "Warning: \[PG"
done
echo "== end $(date -u '+%F %T UTC')"
