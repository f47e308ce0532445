"""``foldtune plan`` of a vision-language MoE model (``--model qwen3-vl-30b-a3b`` or ``<encoder>+<llm>``, with
``--images-per-sample N``): homogeneous and heterogeneous layouts (the encoder's own tp/dp and placement)
ranked by predicted step time, each with its placement and one reason per term of its step
(:mod:`planner.multimodal`)."""

from __future__ import annotations

import argparse
import json
import re

from costmodel.estimate import estimate
from costmodel.multimodal import estimate_multimodal
from planner.multimodal import llm_cluster, plan_multimodal
from spec.errors import SpecError
from spec.hardware import ClusterSpec
from spec.multimodal import ImageInputs
from spec.multimodal_layout import MultimodalLayout
from spec.validity import check_multimodal
from spec.vl_catalog import get_vl_model, is_vl_model

_SIZE = re.compile(r"(\d+)(?:x(\d+))?")


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--images-per-sample", type=int, default=None, metavar="N",
                        help="images in each training sample of a vision-language model (its --model: "
                             "qwen3-vl-30b-a3b, qwen3-vl-235b-a22b, or ENCODER+LLM such as qwen3-vit+mixtral-8x7b)")
    parser.add_argument("--image-size", default="448x448", metavar="HxW",
                        help="pixels of each image, HxW or one side (default 448x448)")


def is_multimodal_request(args: argparse.Namespace) -> bool:
    """Whether the plan request names a vision-language model or images."""
    model = getattr(args, "model", None)
    return getattr(args, "images_per_sample", None) is not None or bool(model and is_vl_model(model))


def _images(args: argparse.Namespace) -> ImageInputs:
    m = _SIZE.fullmatch(str(args.image_size).strip().lower())
    if m is None:
        raise SpecError(f"--image-size must be HxW or one side in pixels, got {args.image_size!r}")
    height = int(m.group(1))
    width = int(m.group(2)) if m.group(2) else height
    if args.images_per_sample is None:
        raise SpecError("a vision-language model needs --images-per-sample N (images in each training sample)")
    return ImageInputs(args.images_per_sample, height, width)


def run_multimodal(args: argparse.Namespace, plan_specs) -> int:
    """Plan, print (``--json`` or a table) and return the exit code: 0 when a layout fits, else 1."""
    if not getattr(args, "model", None) or not is_vl_model(args.model):
        raise SpecError("--images-per-sample plans a vision-language model: give --model qwen3-vl-30b-a3b, "
                        "qwen3-vl-235b-a22b, tiny-vl-moe, or ENCODER+LLM (e.g. qwen3-vit+mixtral-8x7b)")
    vl = get_vl_model(args.model)
    images = _images(args)
    _, training, cluster = plan_specs(args, "plan", base=vl.llm)
    if args.explain is not None:
        return _explain(args, vl, images, training, cluster)
    result = plan_multimodal(vl, training, images, cluster, top=args.top or 10)
    best = result.ranked[0] if result.ranked else None
    if args.json:
        print(json.dumps({
            "model": vl.name, "llm": vl.llm.name, "gpus": cluster.num_gpus, "gpu": cluster.gpu.name,
            "seq_length": training.seq_length, "global_batch_size": training.global_batch_size,
            "images": {**images.to_dict(), "patches_per_image": images.patches_per_image(vl.vision),
                       "tokens_per_image": images.tokens_per_image(vl.vision),
                       "image_tokens_per_sample": images.image_tokens_per_sample(vl.vision)},
            "priced": result.priced, "not_fitting": result.not_fitting, "rejected": dict(result.rejected),
            "why": result.why,
            "best_homogeneous": result.best_homogeneous.to_dict() if result.best_homogeneous else None,
            "best_heterogeneous": result.best_heterogeneous.to_dict() if result.best_heterogeneous else None,
            "ranked": [e.to_dict() for e in result.ranked],
        }, indent=2))
        return 0 if best else 1
    print(f"{vl.name} ({vl.vision.num_layers}-block encoder + {vl.llm.name}) on {cluster.num_gpus} x "
          f"{cluster.gpu.name}, seq {training.seq_length}, gbs {training.global_batch_size}, "
          f"{images.images_per_sample} images of {images.image_height}x{images.image_width} px per sample "
          f"({images.image_tokens_per_sample(vl.vision)} image tokens)")
    print(f"priced {result.priced} layouts, {result.not_fitting} do not fit; rejected by rule: "
          + (", ".join(f"{k} {v}" for k, v in sorted(result.rejected.items())) or "none"))
    if best is None:
        print("NO LAYOUT FITS")
        return 1
    for e in result.ranked:
        print(f"  {e.step_time:8.3f} s  {e.tflops_per_gpu:6.1f} TFLOP/s/GPU  {e.memory_bytes / 2 ** 30:5.1f} GiB  "
              f"{e.layout.label()}")
    print(result.why)
    print(f"best: {best.layout.label()}")
    for name, seconds in best.terms:
        print(f"  {name:22s} {seconds:8.3f} s  {dict(best.reasons)[name]}")
    print(f"  {'memory':22s} {dict(best.reasons)['memory']}")
    return 0


def _explain(args: argparse.Namespace, vl, images: ImageInputs, training, cluster: ClusterSpec) -> int:
    """``--explain LABEL``: the rules the multimodal layout breaks (named), else its priced step; exit 0 when it
    is valid and fits, else 1."""
    layout = MultimodalLayout.parse(args.explain, cluster.num_gpus)
    rejections = [r for r in check_multimodal(vl, training, images, layout, cluster)
                  if not r.rule.startswith("executor_")]
    priced = None
    if not rejections:
        share = llm_cluster(layout, cluster)
        llm = estimate(vl.llm, training, share, layout.llm)
        priced = estimate_multimodal(vl, training, images, layout, cluster, llm, share)
    ok = priced is not None and priced.fits
    if args.json:
        print(json.dumps({"layout": layout.label(), "valid": not rejections,
                          "rejections": [{"rule": r.rule, "reason": r.reason} for r in rejections],
                          "estimate": priced.to_dict() if priced else None}, indent=2))
        return 0 if ok else 1
    print(f"layout {layout.label()} for {vl.name}:")
    for r in rejections:
        print(f"  INVALID {r}")
    if priced is not None:
        print(f"  step {priced.step_time:.3f} s, {priced.memory_bytes / 2 ** 30:.1f} GiB, "
              + ("fits" if priced.fits else "does NOT fit"))
        for name, seconds in priced.terms:
            print(f"  {name:22s} {seconds:8.3f} s  {dict(priced.reasons)[name]}")
    return 0 if ok else 1
