#!/usr/bin/env bash
# Issue 19's bar: a 2-GPU tuning job of TRIALS trials (default 8) has a median fixed cost per trial (dispatch to
# the first timed step) of at most 5 s after the first. Runs the same `foldtune tune` job of MODEL (default
# mixtral-8x7b, LAYERS layers, default 2; seq SEQ 4096, gbs GBS 8) twice in one fresh data directory: with the
# rank actors kept between trials (the default) and with --no-reuse (each trial starts its own, as before), and
# prints each job's per-trial fixed cost and its 'fixed cost per trial' summary line (no auto-calibration: the
# datasheet profile prices the candidates; pricing does not change a trial's fixed cost). MODES=reuse runs the
# first job only. Log under $OUT.
set -uo pipefail
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/trial_fixed_cost_log.txt") 2>&1
source bench/gpu_env.sh
NGPU=${NGPU:-2}
gpu_type
export FOLDTUNE_DATA_DIR=$OUT/trial_fixed_cost; rm -rf "$FOLDTUNE_DATA_DIR"; mkdir -p "$FOLDTUNE_DATA_DIR"
echo "== $(date -u '+%F %T UTC') $NGPU x $NAME ($GPU), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
rc=0
for mode in ${MODES:-reuse no-reuse}; do
  flag=(); [ "$mode" = no-reuse ] && flag=(--no-reuse)
  echo; echo "== ${MODEL:-mixtral-8x7b}@${LAYERS:-2}L, $mode, start $(date -u +%T)"
  start=$(date +%s)
  timeout 280 python3 -m api.cli.main tune --model "${MODEL:-mixtral-8x7b}" --layers "${LAYERS:-2}" --gpu "$GPU" \
    --gpus "$NGPU" --seq "${SEQ:-4096}" --gbs "${GBS:-8}" --max-trials "${TRIALS:-8}" --warmup 1 --steps 3 \
    --trial-timeout 180 --auto-calibrate off "${flag[@]}" || rc=1
  echo "== $mode: job took $(( $(date +%s) - start )) s"
done
echo "== end $(date -u '+%F %T UTC') rc=$rc"
exit $rc
