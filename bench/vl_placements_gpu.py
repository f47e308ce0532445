"""Measure multimodal layouts of one vision-language model side by side on this machine's GPUs, as a tuning
trial measures them (:func:`executor.vlm.profile.profile_vl_layout`: VLTrainer / the separate placement's
trainers, bf16, NCCL), each beside the cost model's predicted step (the LLM priced on its own share when the
encoder is separate).

    python3 -m bench.vl_placements_gpu --gpus 2 --gpu h200

Default layouts on 2 GPUs: homogeneous, colocated (encoder tp 2, encoder dp 2), separate (the LLM on one GPU,
the encoder on the other); on 4 GPUs the same kinds (the default model's LLM is too shallow for pp 2 under
Qwen3-ViT's three deepstack levels: rule executor_vl_layout). Prints a table and writes
``bench/results/vl_placements-<model>-<gpus>gpu-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

LAYOUTS = {
    2: ["dp2 placement=homogeneous", "dp2 placement=colocated enc_tp2 enc_dp1",
        "dp2 placement=colocated enc_tp1 enc_dp2", "dp1 placement=separate enc_tp1 enc_dp1"],
    4: ["dp4 placement=homogeneous", "dp4 placement=colocated enc_tp1 enc_dp4",
        "dp2 placement=separate enc_tp1 enc_dp2"],
}


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-vit+small-moe", help="a vision-language model of the catalog")
    parser.add_argument("--gpus", type=int, default=2, choices=sorted(LAYOUTS))
    parser.add_argument("--gpu", default="h200", help="the catalog hardware the predictions are priced on")
    parser.add_argument("--layouts", nargs="+", help="multimodal labels (default: the list for --gpus)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--images-per-sample", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (gloo, fp32)")
    return parser.parse_args()


def main() -> None:
    args = _parse()
    from costmodel.estimate import estimate
    from costmodel.multimodal import estimate_multimodal
    from planner.multimodal import llm_cluster
    from spec.catalog import get_hardware
    from spec.errors import FoldtuneError
    from spec.hardware import ClusterSpec
    from spec.multimodal import ImageInputs
    from spec.multimodal_layout import MultimodalLayout
    from spec.training_spec import TrainingSpec
    from spec.validity import check_multimodal
    from spec.vl_catalog import get_vl_model
    from executor.vlm.profile import profile_vl_layout

    vl = get_vl_model(args.model)
    training = TrainingSpec(seq_length=args.seq, global_batch_size=args.gbs,
                            precision="bf16" if args.device == "cuda" else "fp32")
    images = ImageInputs(args.images_per_sample, args.image_size, args.image_size)
    cluster = ClusterSpec(get_hardware(args.gpu), args.gpus)
    rows = []
    for label in args.layouts or LAYOUTS[args.gpus]:
        layout = MultimodalLayout.parse(label, args.gpus)
        broken = check_multimodal(vl, training, images, layout, cluster)
        predicted = None
        if not broken:
            try:
                share = llm_cluster(layout, cluster)
                llm = estimate(vl.llm, training, share, layout.llm)
                predicted = estimate_multimodal(vl, training, images, layout, cluster, llm, share).step_time
            except FoldtuneError:
                pass
        m = profile_vl_layout(vl, training, images, layout, warmup_steps=args.warmup, timed_steps=args.steps,
                              device=args.device, hardware=args.gpu)
        rows.append({"layout": layout.label(), "placement": layout.placement, "ok": m.ok,
                     "failure": m.failure_reason, "measured_s": m.step_time if m.ok else None,
                     "predicted_s": predicted, "rules_broken": [r.rule for r in broken],
                     "tokens_per_s_per_gpu": m.tokens_per_s_per_gpu if m.ok else None,
                     "peak_allocated_bytes": m.peak_allocated_bytes if m.ok else None,
                     "losses": m.losses if m.ok else [], "device": m.device if m.ok else None})
    print(f"{'layout':92s} {'measured s':>10s} {'predicted s':>11s} {'tok/s/GPU':>10s}")
    for r in rows:
        measured = f"{r['measured_s']:.4f}" if r["measured_s"] else "failed"
        predicted = f"{r['predicted_s']:.4f}" if r["predicted_s"] else "-"
        tokens = f"{r['tokens_per_s_per_gpu']:.0f}" if r["tokens_per_s_per_gpu"] else "-"
        print(f"{r['layout'][:92]:92s} {measured:>10s} {predicted:>11s} {tokens:>10s}")
        if not r["ok"]:
            print(f"    {r['failure']}")
    out = Path(__file__).parent / "results" / (
        f"vl_placements-{vl.name.replace('+', '_')}-{args.gpus}gpu-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": vl.name, "gpus": args.gpus, "priced_on": args.gpu, "seq": args.seq,
                               "gbs": args.gbs, "images": images.to_dict(), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
