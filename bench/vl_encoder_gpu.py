"""Time the vision encoder of a vision-language MoE model (forward + backward of one micro-batch of images, bf16)
on this machine's GPU and set it beside the cost model's prediction (``costmodel.multimodal.encoder_cost``).

    python3 -m bench.vl_encoder_gpu --model qwen3-vl-30b-a3b --gpu h200 --images 4 16 --image-size 448

Prints one JSON line per image count: measured and predicted seconds (median of ``--repeats`` timed runs after
``--warmup`` untimed ones).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-vl-30b-a3b", help="a vision-language model of the catalog")
    parser.add_argument("--gpu", default="h200", help="the catalog hardware whose prediction is printed beside")
    parser.add_argument("--images", type=int, nargs="+", default=[4, 16], help="images per micro-batch")
    parser.add_argument("--image-size", type=int, default=448, help="pixels per side")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    return parser.parse_args()


def main() -> None:
    args = _parse()
    import torch

    from costmodel.multimodal import encoder_cost
    from spec.catalog import get_hardware
    from spec.hardware import ClusterSpec
    from spec.multimodal import ImageInputs
    from spec.multimodal_layout import MultimodalLayout
    from spec.parallel_config import ParallelConfig
    from spec.training_spec import TrainingSpec
    from spec.vl_catalog import get_vl_model
    from executor.vlm.vision import VisionEncoder

    vl = get_vl_model(args.model)
    device = torch.device("cuda")
    torch.manual_seed(0)
    encoder = VisionEncoder(vl.vision, device=device, dtype=torch.bfloat16)
    cluster = ClusterSpec(get_hardware(args.gpu), 1)
    for count in args.images:
        images = ImageInputs(count, args.image_size, args.image_size)
        rows, cols = images.grid(vl.vision)
        patches = torch.randn(count * rows * cols, vl.vision.patch_dim, device=device, dtype=torch.bfloat16)
        grids = [(rows, cols)] * count
        seconds = []
        for step in range(args.warmup + args.repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            tokens, deep = encoder(patches, grids)
            (tokens.float().square().mean() + sum(d.float().square().mean() for d in deep)).backward()
            torch.cuda.synchronize()
            if step >= args.warmup:
                seconds.append(time.perf_counter() - start)
            encoder.zero_grad(set_to_none=True)
        # one micro-batch of `count` images on one GPU: the homogeneous layout of a one-GPU LLM, gbs 1
        training = TrainingSpec(seq_length=max(8192, 2 * images.image_tokens_per_sample(vl.vision)),
                                global_batch_size=1)
        cost = encoder_cost(vl, training, images, MultimodalLayout.homogeneous(ParallelConfig(1)), cluster, 1)
        print(json.dumps({"model": vl.name, "device": torch.cuda.get_device_name(), "images": count,
                          "image_size": args.image_size, "patches": count * rows * cols,
                          "measured_s": statistics.median(seconds), "predicted_s": cost.microbatch_s,
                          "predicted_gpu": args.gpu}))


if __name__ == "__main__":
    main()
