#!/usr/bin/env bash
# One call on a 1-GPU machine (issues 16 and 19): results in $OUT/res, packed into $OUT/results.tgz every 30 s
# and at the end (a device call returns at most 8 files; a call cut off keeps what was measured), log in
# $OUT/gpu1_log.txt. Phases (PHASES, default all, in this order):
#   calibrate  foldtune calibrate on the one GPU (GEMM, grouped GEMM, attention incl. the MLA shape, copy, launch)
#   tables     every 1-GPU layout (micro-batch 1-2; recompute none, full, moe_act+layernorm) of each proxy of MODELS
#              (default mixtral-8x7b qwen3-30b-a3b deepseek-v2-lite, LAYERS 2, seq 4096, gbs 8, bf16), kept ranks
#   stack      bench/stack_profile.py: the Mixtral-shaped decoder stack, kernel tables before/after (issue 19)
#   fp8        bench/fp8_step.py --runs bf16,fp8: the 2-layer Mixtral proxy step, 4 micro-batches (issue 19)
set -uo pipefail
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
OUT=${OUT:-/tmp/out}; RES=$OUT/res; mkdir -p "$RES"
exec > >(tee -a "$OUT/gpu1_log.txt") 2>&1
source bench/gpu_env.sh
NAME=$(python3 -c "import torch; print(torch.cuda.get_device_name(0))")
case "$NAME" in *H200*) GPU=h200 ;; *) GPU=h100-sxm ;; esac
echo "== $(date -u '+%F %T UTC') 1 x $NAME ($GPU), commit ${COMMIT:-?}"
pack() { local tmp="$OUT/.results.$BASHPID.tgz"; tar czf "$tmp" -C "$RES" . 2>/dev/null && mv -f "$tmp" "$OUT/results.tgz"; }
( while sleep 30; do pack; done ) & PACKER=$!
trap 'kill $PACKER 2>/dev/null; pack' EXIT
PHASES=" ${PHASES:-calibrate tables stack fp8} "
has() { case "$PHASES" in *" $1 "*) return 0 ;; esac; return 1; }
PROFILE=$RES/$GPU-x1-calibrated.json
if has calibrate; then
  echo "== calibrate start $(date -u +%T)"
  timeout 150 python3 -m api.cli.main calibrate --gpu "$GPU" --ranks 1 --timeout 140 --name "$GPU-x1-calibrated" \
    --out "$PROFILE" > "$RES/calibrate.log" 2>&1
  echo "calibrate rc=$? end $(date -u +%T)"; grep -A16 "causal attention" "$RES/calibrate.log" | head -18
fi
if has tables; then
  for m in ${MODELS:-mixtral-8x7b qwen3-30b-a3b deepseek-v2-lite}; do
    echo "== $m@${LAYERS:-2}L 1-GPU layouts start $(date -u +%T)"
    mkdir -p "$RES/$m"
    timeout 200 python3 -m bench.costmodel_accuracy --model "$m" --layers "${LAYERS:-2}" --gpus 1 --gpu "$GPU" \
      --profile "$PROFILE" --seq 4096 --gbs 8 --precision bf16 --warmup 1 --steps 3 --trial-timeout 120 \
      --mbs-max 2 --recompute none,full,moe_act+layernorm --dispatchers alltoall --results-dir "$RES/$m" --no-write \
      2>&1 | grep -E "^\[|layouts, profile|datasheet|held out|share of the step"
  done
fi
if has stack; then
  echo "== stack profile start $(date -u +%T)"
  timeout 300 python3 -m bench.stack_profile --layers 2 --out "$RES/stack_profile.json" > "$RES/stack_profile.log" 2>&1
  echo "stack rc=$? end $(date -u +%T)"; tail -70 "$RES/stack_profile.log"
fi
if has fp8; then
  echo "== fp8 step start $(date -u +%T)"
  timeout 300 python3 -m bench.fp8_step --runs bf16,fp8 --out "$RES/fp8_step.json" > "$RES/fp8_step.log" 2>&1
  echo "fp8 rc=$? end $(date -u +%T)"; tail -40 "$RES/fp8_step.log"
fi
echo "== end $(date -u '+%F %T UTC')"
