#!/usr/bin/env bash
# Issue 16's "first trial of a fresh tuning job" row: on a GPU machine with no stored calibration, one tuning
# job per proxy (MODELS, default "qwen3-30b-a3b deepseek-v2-lite mixtral-8x7b", each with LAYERS layers,
# default 2) on all GPUs at seq SEQ (4096), gbs GBS (8), TRIALS trials (2), in ONE fresh data directory: the
# first job runs the quick calibration of its GPU type and stores it, the later ones price with it. Prints each
# job's measured-vs-predicted table; the first trial's error is the row's figure. Results under $OUT.
set -uo pipefail
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/first_trial_log.txt") 2>&1
source bench/gpu_env.sh
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
gpu_type
export FOLDTUNE_DATA_DIR=$OUT/first_trial; rm -rf "$FOLDTUNE_DATA_DIR"; mkdir -p "$FOLDTUNE_DATA_DIR"
echo "== $(date -u '+%F %T UTC') $NGPU x $NAME ($GPU), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
rc=0
for m in ${MODELS:-qwen3-30b-a3b deepseek-v2-lite mixtral-8x7b}; do
  echo; echo "== $m@${LAYERS:-2}L start $(date -u +%T)"
  timeout 300 python3 -m api.cli.main tune --model "$m" --layers "${LAYERS:-2}" --gpu "$GPU" --gpus "$NGPU" \
    --seq "${SEQ:-4096}" --gbs "${GBS:-8}" --max-trials "${TRIALS:-2}" --warmup 1 --steps 3 --trial-timeout 180 || rc=1
done
echo "== end $(date -u '+%F %T UTC') rc=$rc"
exit $rc
