#!/usr/bin/env bash
# Issue 20's GPU bar on one host with 2 GPUs (from the repo root; .whl/ carried where the image lacks the
# service's packages, as for bench/gpu_session.sh):
#
#   bench/multinode_gpu.sh            results and log under $OUT (default /tmp/out)
#
# 1. `foldtune tune --gpus 2`: every trial's two ranks run on the node's two GPUs (one each, where the planner
#    put them): bench/multinode_check.py placement --want-gpus 2.
# 2. `foldtune tune --gpus 1`: the runner runs two 1-GPU trials side by side on the two GPUs; their run
#    windows (UTC timestamps printed) overlap and they share no GPU: bench/multinode_check.py overlap.
# Environment: MODEL (default small-moe), SEQ (512), GBS (8), TRIALS (4).
set -uo pipefail
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/multinode_log.txt") 2>&1
source bench/gpu_env.sh
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
gpu_type
echo "== $(date -u '+%F %T UTC') $NGPU x $NAME ($GPU)"
[ "$NGPU" -ge 2 ] || { echo "needs 2 GPUs, found $NGPU"; exit 2; }
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}

rc=0
run() {  # run NAME GPUS CHECK...: a fresh data dir, one tuning job, then the check on its trials
  local name=$1 gpus=$2; shift 2
  export FOLDTUNE_DATA_DIR=$OUT/$name; rm -rf "$FOLDTUNE_DATA_DIR"; mkdir -p "$FOLDTUNE_DATA_DIR"
  echo; echo "== $name: foldtune tune --gpus $gpus  start $(date -u +%T)"
  timeout 420 python3 -m api.cli.main tune --model "${MODEL:-small-moe}" --gpu "$GPU" --gpus "$gpus" \
    --seq "${SEQ:-512}" --gbs "${GBS:-8}" --max-trials "${TRIALS:-4}" --warmup 1 --steps 3 --trial-timeout 180 \
    || { echo "== $name: tune failed"; rc=1; return; }
  python3 -m bench.multinode_check "$@" --db "$FOLDTUNE_DATA_DIR/foldtune.sqlite3" || rc=1
  echo "== $name: end $(date -u +%T) rc=$rc"
}
run gpus2 2 placement --want-gpus 2
run side_by_side 1 overlap
echo "== end $(date -u '+%F %T UTC') rc=$rc"
exit $rc
