#!/usr/bin/env bash
# The one-GPU evidence that issues 38, 39 and 40 still need, in one device call. Everything lands in $OUT/res and is
# packed into $OUT/results.tgz every 30 s and at the end (a call cut off by its time limit keeps what was
# measured), the log in $OUT/evidence_log.txt; the scripts' own JSON files (bench/results/) and the sections they
# write into docs/benchmarks.md come back in the archive too (res/bench-results/, res/benchmarks.md).
# Phases (PHASES, default all, in this order):
#   precopt   bench/precision_optimizer.py: peak memory of a Mixtral 2-layer proxy with fp32, bf16-moment and
#             bf16-moment + fp16-master optimizer state, saving measured vs predicted (bar: within 5 %)
#   vlenc     bench/vl_encoder_gpu.py: the Qwen3-VL vision encoder's fwd+bwd at 4 and 16 images, measured vs priced
#   packed    bench/packed_attention_gpu.py: flex attention's document block mask vs the masked SDPA, 4K-32K
#   cp1       bench/cp_comm_gpu.py --world 1 --cp1: the single-GPU attention core at 32K-128K, Mixtral's heads (32/8)
#             and Qwen3-30B-A3B's (32/4), beside the cost model
#   vlstep    bench/vl_step_gpu.py: a Qwen3-VL-30B-A3B proxy (LLM at 4 layers, the whole encoder) at seq 8192, 4 images
#             of 448² a sample, homogeneous and colocated on one GPU, measured beside the cost model
#   cgtests   the CUDA-graph tests that need a GPU: captured layer parts equal to eager (tests/executor/test_cuda_graph_scope.py,
#             test_stack_fusions.py -k cuda_graph)
#   cgraph    bench/cuda_graphs_gpu.py: the 4-layer Qwen3-30B-A3B and DeepSeek-V2-Lite proxies' whole step with the
#             cuda_graphs knob off and on, at seq 4096 and (host-bound) 512
#   fp8gg     bench/fp8_grouped_gemm.py: the grouped fp8 GEMMs (torch's and foldtune's Triton kernels, rowwise and
#             blockwise) against bf16 at three models' expert shapes, 4096 and 16384 tokens
#   ctx128k   foldtune profile of the Qwen3-30B-A3B and Mixtral 2-layer proxies at seq 131072 (full recompute),
#             measured step and peak memory (priced off the device with `foldtune plan --explain`)
#   fp8mbs    fp8_expert_gemm 'fastest' (the fp8 default): its GPU test, then the 4-layer Qwen3-30B-A3B and
#             DeepSeek-V2-Lite proxies' whole step in bf16 and fp8 at micro-batch 1 and 8 (seq 4096, gbs 8), and
#             bench/fp8_step.py on the Mixtral 2-layer proxy (bf16, fp8 on torch's kernel, fp8 'fastest')
#   ttstep    bench/torchtitan_step.py: the 4-layer Qwen3-30B-A3B and DeepSeek-V2-Lite proxies' step against
#             torchtitan 0.3.0's compiled Trainer, side by side (carry .ttwhl: the wheels its docstring lists; the
#             flags that run on torch 2.11), then torchtitan's side with FSDP reshard never and profiled
#   fp8bound  bench/step_kernels_gpu.py in bf16 at mbs 8 and 1, then bench/fp8_bound.py on each row: every GEMM
#             of the step in bf16 and fp8, the most fp8 can gain (LM head bf16 or fp8)
#   cputune   the README's main job (`foldtune tune --gpu cpu`: calibration, then tiny-moe on 4 CPU ranks) three times,
#             each in a fresh HOME, on this host's CPU cores (16, so the ranks do not share cores): the
#             measured-vs-predicted table of each run
set -uo pipefail
OUT=${OUT:-/tmp/out}; RES=$OUT/res; mkdir -p "$RES"
exec > >(tee -a "$OUT/evidence_log.txt") 2>&1
source bench/gpu_env.sh
gpu_type
echo "== $(date -u '+%F %T UTC') $(nvidia-smi -L | wc -l) x $NAME ($GPU), commit ${COMMIT:-?}"
collect() { mkdir -p "$RES/bench-results"; cp -f bench/results/*.json "$RES/bench-results/" 2>/dev/null
            cp -f docs/benchmarks.md "$RES/benchmarks.md"; }
pack_results "$RES" "$OUT"
phases "precopt vlenc vlstep packed cp1 ctx128k"  # cgtests cgraph fp8gg: by name

if has precopt; then
  echo "== precision-aware optimizer start $(date -u +%T)"
  timeout 300 python3 -m bench.precision_optimizer --model mixtral-8x7b --layers 2 --gpu "$GPU" 2>&1 \
    | grep -v "Warning" | tail -12
  echo "precopt end $(date -u +%T)"; collect
fi
if has vlenc; then
  echo "== vision encoder start $(date -u +%T)"
  timeout 120 python3 -m bench.vl_encoder_gpu --model qwen3-vl-30b-a3b --gpu "$GPU" --images 4 16 --image-size 448 \
    2>&1 | tee "$RES/vl_encoder.jsonl" | tail -4
fi
if has vlstep; then
  echo "== vision-language step start $(date -u +%T)"
  timeout 300 python3 -m bench.vl_step_gpu --model qwen3-vl-30b-a3b --llm-layers 4 --seq 8192 --gbs 4 --images 4 \
    --gpu "$GPU" 2>&1 | grep -v "Warning" | tee "$RES/vl_step.txt" | tail -6
  # the control: the same LLM proxy text-only, same shape (what the images and the encoder add)
  timeout 200 python3 -m api.cli.main profile --model qwen3-30b-a3b --layers 4 --gpu "$GPU" --seq 8192 --gbs 4 \
    --layout "tp1 cp1 pp1 ep1 dp1 mbs1" --untimed-steps 2 --timed-steps 3 --timeout 190 --json \
    > "$RES/vl_control.log" 2>&1
  echo "control rc=$?"; grep -v "Warning" "$RES/vl_control.log" | tail -1 | cut -c1-600
fi
if has packed; then
  echo "== packed attention start $(date -u +%T)"
  timeout 120 python3 -m bench.packed_attention_gpu --seq 4096 8192 16384 32768 2>&1 | tee "$RES/packed_attention.txt" | tail -6
fi
if has cp1; then
  echo "== cp=1 attention core start $(date -u +%T)"
  timeout 150 python3 -m bench.cp_comm_gpu --world 1 --cp1 --seqs 32768 65536 131072 --price "$GPU" 2>&1 \
    | grep -v "Warning" | tee "$RES/cp1_mixtral.txt" | tail -8
  timeout 150 python3 -m bench.cp_comm_gpu --world 1 --cp1 --seqs 32768 65536 131072 --heads 32 --kv-heads 4 \
    --price "$GPU" 2>&1 | grep -v "Warning" | tee "$RES/cp1_qwen3.txt" | tail -8
  collect
fi
if has cgtests; then
  echo "== CUDA-graph tests start $(date -u +%T)"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/executor/test_cuda_graph_scope.py tests/executor/test_stack_fusions.py \
    -k "captured or cuda_graph or graph" 2>&1 | tail -6
fi
if has cgraph; then
  echo "== CUDA graphs knob start $(date -u +%T)"
  timeout 240 python3 -m bench.cuda_graphs_gpu --hardware "$GPU" --out "$RES/cuda_graphs_gpu.json" 2>&1 | grep -v Warning | tail -12
  timeout 150 python3 -m bench.cuda_graphs_gpu --hardware "$GPU" --seq 512 --gbs 16 --out "$RES/cuda_graphs_gpu_s512.json" \
    2>&1 | grep -v Warning | tail -8
fi
if has fp8gg; then
  echo "== grouped fp8 GEMMs start $(date -u +%T)"
  timeout 280 python3 -m bench.fp8_grouped_gemm 2>&1 | grep -v Warning | tail -45
  collect
fi
if has ctx128k; then
  for m in qwen3-30b-a3b mixtral-8x7b; do
    echo "== $m@2L at seq 131072 start $(date -u +%T)"
    timeout 200 python3 -m api.cli.main profile --model "$m" --layers 2 --gpu "$GPU" --seq 131072 --gbs 1 \
      --layout "tp1 cp1 pp1 ep1 dp1 mbs1 recompute=full" --untimed-steps 1 --timed-steps 2 --timeout 190 --json \
      > "$RES/ctx128k-$m.log" 2>&1
    echo "rc=$?"; grep -v "Warning" "$RES/ctx128k-$m.log" | tail -14
  done
fi
if has fp8mbs; then
  echo "== fp8 expert pick GPU test start $(date -u +%T)"
  timeout 120 python3 -m pytest -q -s -p no:cacheprovider \
    tests/executor/test_fp8_expert_pick.py::test_on_a_gpu_the_first_call_times_both_paths_and_keeps_the_faster 2>&1 | tail -4
  for m in qwen3-30b-a3b deepseek-v2-lite; do
    for mbs in 1 8; do
      for p in bf16 fp8; do
        echo "== $m@4L mbs $mbs $p start $(date -u +%T)"
        timeout 150 python3 -m api.cli.main profile --model "$m" --layers 4 --gpu "$GPU" --seq 4096 --gbs 8 \
          --precision "$p" --layout "tp1 cp1 pp1 ep1 dp1 mbs$mbs" --untimed-steps 2 --timed-steps 4 --timeout 140 \
          --json > "$RES/fp8mbs-$m-mbs$mbs-$p.log" 2>&1
        echo "rc=$?"; grep -v "Warning" "$RES/fp8mbs-$m-mbs$mbs-$p.log" | grep -i "ran in bf16\|step" | tail -3 | cut -c1-300
        python3 - "$RES/fp8mbs-$m-mbs$mbs-$p.log" <<'PY'
import json, sys
for line in reversed(open(sys.argv[1]).read().splitlines()):
    if line.startswith("{"):
        d = json.loads(line)
        m = d.get("measurement", d)
        print("step_time_s", m.get("step_time"), "tflops", m.get("tflops_per_gpu"), "fp8", m.get("fp8_expert_gemms"))
        break
PY
      done
    done
  done
  echo "== Mixtral fp8 step start $(date -u +%T)"
  timeout 300 python3 -m bench.fp8_step --runs bf16,fp8,fp8_fastest --out "$RES/fp8_step_fastest.json" 2>&1 \
    | grep -v Warning | tail -25
  collect
fi
if has ttstep; then
  echo "== torchtitan side by side start $(date -u +%T)"
  if [ -d .ttwhl ]; then
    pip install -q --no-index --no-deps --target /tmp/tts .ttwhl/*.whl 2>&1 | grep -v WARNING | tail -2
    for extra in "" "--torchtitan-reshard never --sides torchtitan --profile"; do
      PYTHONPATH=/tmp/tts:${PYTHONPATH:-} timeout 590 python3 -m bench.torchtitan_step --no-write --commit "${COMMIT:-?}" \
        --torchtitan-loss plain --torchtitan-cuda-graphs off --warmup 3 --steps 8 $extra \
        --out "$RES/torchtitan_step${extra:+_reshard_never}.json" 2>&1 | grep -v -i warn | tail -40
    done
  else
    echo "no .ttwhl here: carry the torchtitan wheels (bench/torchtitan_step.py's docstring)"
  fi
  collect
fi
if has fp8bound; then
  echo "== fp8 bound start $(date -u +%T)"
  timeout 330 python3 -m bench.step_kernels_gpu --runs bf16:8,bf16:1 --no-write --commit "${COMMIT:-?}" \
    --out "$RES/step_kernels_bf16.json" 2>&1 | grep -E "^==|step "
  for mbs in 8 1; do
    for m in qwen3-30b-a3b deepseek-v2-lite; do
      echo "-- $m mbs $mbs"
      timeout 120 python3 -m bench.fp8_bound --step-json "$RES/step_kernels_bf16.json" --model "$m" --mbs "$mbs" \
        --out "$RES/fp8_bound_${m}_mbs$mbs.json" 2>&1 | tail -9
    done
  done
  collect
fi
if has cputune; then
  for run in 1 2 3; do
    echo "== README tune on CPU ranks, run $run, start $(date -u +%T), $(nproc) cores"
    ( export HOME=$(mktemp -d); unset $(env | grep -o '^FOLDTUNE_[A-Z_]*'); RAY_AUTH_MODE=disabled \
      timeout 280 python3 -m api.cli.main tune --gpu cpu ) > "$RES/cputune-$run.log" 2>&1
    echo "rc=$?"; grep -v "Warning" "$RES/cputune-$run.log" | tail -22
  done
fi
collect
echo "== end $(date -u '+%F %T UTC')"
