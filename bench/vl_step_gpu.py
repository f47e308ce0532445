"""A vision-language MoE proxy's whole training step on this machine's GPU(s): the homogeneous layout (the encoder
in the LLM's layout) and the colocated one (the encoder with its own tp/dp on the same GPUs), measured through
``executor.vlm.profile.profile_vl_layout`` (bf16, synthetic images), each beside the cost model's price
(``costmodel.multimodal.estimate_multimodal`` on ``--gpu``).

    python3 -m bench.vl_step_gpu --model qwen3-vl-30b-a3b --llm-layers 4 --seq 8192 --gbs 4 --images 4 --gpu h200

Prints one JSON line per layout (measured step, peak memory, the predicted step and its terms) and a short table.
On one GPU both layouts hold tp = dp = 1, so they differ only in the process groups the encoder uses: the
comparison checks the pricing, not a heterogeneity gain (that needs two or more GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-vl-30b-a3b", help="a vision-language model of the catalog")
    parser.add_argument("--llm-layers", type=int, default=4, help="decoder layers of the LLM proxy (>= deepstack layers)")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--gbs", type=int, default=4)
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--images", type=int, default=4, help="images per sample")
    parser.add_argument("--image-size", type=int, default=448, help="pixels per side")
    parser.add_argument("--gpu", default="h200", help="the catalog hardware that prices the layouts")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the layouts span")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=400.0)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (e.g. --model tiny-vl-moe "
                        "--llm-layers 2 --seq 64 --gbs 2 --images 1 --image-size 16 --gpu cpu)")
    return parser.parse_args()


def main() -> int:
    args = _parse()
    from costmodel.estimate import estimate
    from costmodel.multimodal import estimate_multimodal
    from executor.options import ExecutorOptions
    from executor.vlm.profile import profile_vl_layout
    from spec.catalog import get_hardware
    from spec.hardware import ClusterSpec
    from spec.multimodal import ImageInputs
    from spec.multimodal_layout import MultimodalLayout
    from spec.parallel_config import ParallelConfig
    from spec.training_spec import TrainingSpec
    from spec.vl_catalog import get_vl_model

    base = get_vl_model(args.model)
    vl = dataclasses.replace(base, name=f"{base.name}@{args.llm_layers}L", llm=base.llm.with_layers(args.llm_layers))
    training = TrainingSpec(seq_length=args.seq, global_batch_size=args.gbs,
                            precision="bf16" if args.device == "cuda" else "fp32")
    images = ImageInputs(args.images, args.image_size, args.image_size)
    cluster = ClusterSpec(get_hardware(args.gpu), args.gpus)
    llm = ParallelConfig(world_size=args.gpus, micro_batch_size=args.mbs)
    layouts = [MultimodalLayout.homogeneous(llm),
               MultimodalLayout(llm, "colocated", encoder_tp=1, encoder_dp=args.gpus)]
    options = ExecutorOptions.for_training(training, model=vl.llm)
    rows = []
    for layout in layouts:
        priced = estimate_multimodal(vl, training, images, layout, cluster, estimate(vl.llm, training, cluster, llm),
                                     cluster)
        m = profile_vl_layout(vl, training, images, layout, options, warmup_steps=args.warmup,
                              timed_steps=args.steps, timeout_s=args.timeout, device=args.device)
        row = {"model": vl.name, "layout": layout.label(), "ok": m.ok, "failure": m.failure_reason,
               "measured_step_s": m.step_time if m.ok else None,
               "peak_allocated_bytes": m.peak_allocated_bytes if m.ok else None,
               "phases": m.phases if m.ok else None, "predicted_step_s": priced.step_time,
               "predicted_terms_s": dict(priced.terms), "predicted_memory_bytes": priced.memory_bytes,
               "encoder_microbatch_s": priced.encoder.microbatch_s, "seq": args.seq, "gbs": args.gbs,
               "images_per_sample": args.images, "image_size": args.image_size, "gpu": args.gpu}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| layout | measured step (s) | predicted (s) | pred./meas. | peak GiB | predicted GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        meas = r["measured_step_s"]
        ratio = f"{r['predicted_step_s'] / meas:.2f}" if meas else "-"
        peak = f"{r['peak_allocated_bytes'] / 2**30:.1f}" if r["peak_allocated_bytes"] else "-"
        print(f"| {r['layout']} | {meas if meas is None else round(meas, 4)} | {r['predicted_step_s']:.4f} | {ratio} "
              f"| {peak} | {r['predicted_memory_bytes'] / 2**30:.1f} |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
