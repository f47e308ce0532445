"""``foldtune export-hf``: a foldtune training checkpoint (any layout) as a Hugging Face model directory.

The checkpoint holds full tensors, so the conversion runs in this process, without ranks; the config.json
comes from the Hugging Face model the run was trained from (``--model-dir`` / ``--hf-config``), or is written
for a catalog model (``--model``, with the executor's default RoPE θ and norm ε). ``--model-dir``'s tokenizer
files are copied beside the weights. See docs/huggingface.md.
"""

from __future__ import annotations

import argparse

from spec.errors import SpecError

HELP = "write a training checkpoint as a Hugging Face model directory (config.json + model.safetensors)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a --checkpoint-dir of foldtune train (its latest step) or one step-N dir")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-dir", metavar="DIR", help="the Hugging Face model the run was trained from")
    source.add_argument("--hf-config", metavar="FILE", help="its config.json")
    source.add_argument("--model", help="the catalog model it trained (a config.json is written for it)")
    parser.add_argument("--layers", type=int, metavar="N", help="with --model: the proxy of N layers it trained")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="weights' dtype in the safetensors file (default: float32)")


def run(args: argparse.Namespace) -> int:
    # torch and the executor: only this command pays for them
    import torch

    from executor.hf.convert import export_checkpoint
    from executor.hf.files import copy_tokenizer

    from executor.options import ExecutorOptions
    from spec.catalog import get_model
    from spec.hf_config import hf_config_from_spec, read_hf_config

    if args.model:
        spec = get_model(args.model)
        spec = spec.with_layers(args.layers) if args.layers else spec
        defaults = ExecutorOptions()
        config = hf_config_from_spec(spec, defaults.rotary_base, defaults.norm_epsilon)
    else:
        if args.layers:
            raise SpecError("--layers goes with --model (a Hugging Face config has its own layer count)")
        config = read_hf_config(args.model_dir or args.hf_config)[0]
    out = export_checkpoint(args.checkpoint, config, args.out, getattr(torch, args.dtype))
    tokenizer = copy_tokenizer(args.model_dir, out) if args.model_dir else []
    print(f"wrote {out} ({args.dtype})" + (f" with the tokenizer of {args.model_dir} ({', '.join(tokenizer)})"
                                           if tokenizer else ""))
    return 0
