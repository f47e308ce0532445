#!/usr/bin/env bash
# Issue 16 on a 2-GPU machine in one call: everything lands in $OUT/res and is packed into $OUT/results.tgz
# every 30 s and at the end (a call cut off by its time limit keeps what was measured; at most 8 files come
# back from a device call, so one archive), the log in $OUT/issue16_log.txt. Phases (PHASES, default all, in
# this order):
#   calibrate  foldtune calibrate over both GPUs (full, with the MLA attention shape) -> res/<gpu>-calibrated.json
#   cpdisp     bench/cp_dispatch_gpu.py: CP2 vs CP1 at seq 2k/4k/8k, alltoall vs allgather at EP2 -> res/cp_dispatch.json
#   first      bench/first_trial_gpu.sh: one fresh tuning job per proxy, the first after a quick calibration
#   tables     bench/accuracy_gpu.sh with the calibration of this call: the proxies' 1- and 2-GPU layout tables
# Environment: PHASES, MODELS (tables and first), TABLE2_LAYOUTS (default 10), COMMIT (the code's commit).
set -uo pipefail
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
OUT=${OUT:-/tmp/out}; RES=$OUT/res; mkdir -p "$RES"
exec > >(tee -a "$OUT/issue16_log.txt") 2>&1
source bench/gpu_env.sh
NAME=$(python3 -c "import torch; print(torch.cuda.get_device_name(0))")
case "$NAME" in *H200*) GPU=h200 ;; *) GPU=h100-sxm ;; esac
echo "== $(date -u '+%F %T UTC') $(nvidia-smi -L | wc -l) x $NAME ($GPU), commit ${COMMIT:-?}"
pack() { local tmp="$OUT/.results.$BASHPID.tgz"; tar czf "$tmp" -C "$RES" . 2>/dev/null && mv -f "$tmp" "$OUT/results.tgz"; }
( while sleep 30; do pack; done ) & PACKER=$!
trap 'kill $PACKER 2>/dev/null; pack' EXIT
PHASES=" ${PHASES:-calibrate cpdisp first tables} "
has() { case "$PHASES" in *" $1 "*) return 0 ;; esac; return 1; }

if has calibrate; then
  echo "== calibrate start $(date -u +%T)"
  timeout 180 python3 -m api.cli.main calibrate --gpu "$GPU" --ranks 2 --timeout 170 \
    --out "$RES/$GPU-calibrated.json" > "$RES/calibrate.log" 2>&1
  echo "calibrate rc=$? end $(date -u +%T)"; grep -A14 "causal attention" "$RES/calibrate.log" | head -16
fi
if has cpdisp; then
  echo "== cp_dispatch start $(date -u +%T)"
  timeout 240 python3 -m bench.cp_dispatch_gpu --out "$RES/cp_dispatch.json" 2>&1 | grep -v "Warning: \[PG"
  echo "cp_dispatch rc=${PIPESTATUS[0]} end $(date -u +%T)"
fi
if has first; then
  echo "== first trials start $(date -u +%T)"
  OUT=$RES/first bash bench/first_trial_gpu.sh 2>&1 | grep -E "^==|calibrat|trial +[0-9].*measured|error|priced|best layout" \
    | grep -v "Warning"
fi
if has tables; then
  echo "== tables start $(date -u +%T)"
  OUT=$RES/tables STORED="$RES/$GPU-calibrated.json" TABLE2_LAYOUTS=${TABLE2_LAYOUTS:-10} \
    bash bench/accuracy_gpu.sh 2>&1 | grep -E "^==|^\[|layouts, profile|datasheet|calibrated \(held"
fi
echo "== end $(date -u '+%F %T UTC')"
