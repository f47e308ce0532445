"""``foldtune export-hf``: a foldtune training checkpoint (any layout) as a Hugging Face model directory.

The checkpoint holds full tensors, so the conversion runs in this process, without ranks; the config.json
comes from the Hugging Face model the run was trained from (``--model-dir`` / ``--hf-config``), or is written
for a catalog model (``--model``, with the executor's default RoPE θ and norm ε). ``--model-dir``'s tokenizer
files are copied beside the weights. See docs/huggingface.md.
"""

from __future__ import annotations

import argparse

from api.cli.arguments import add, retire
from spec.errors import SpecError

EXPORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --precision -> torch dtype
HELP = "write a training checkpoint as a Hugging Face model directory (config.json + model.safetensors)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a --checkpoint-dir of foldtune train (its latest step) or one step-N dir")
    source = parser.add_mutually_exclusive_group(required=True)
    add(source, "--model-dir", "the one the run was trained from; its tokenizer is copied too")
    add(source, "--hf-config", "the one the run was trained from")
    add(source, "--model", "the one it trained: a config.json is written for it")
    add(parser, "--layers", "with --model: the proxy it trained")
    add(parser, "--out", "the directory", required=True)
    add(parser, "--precision", "the weights' in model.safetensors: fp32, bf16 or fp16; default: fp32")
    retire(parser, "--dtype", "--precision", "float32/bfloat16/float16 are fp32/bf16/fp16, as in every command")


def run(args: argparse.Namespace) -> int:
    # torch and the executor: only this command pays for them
    import torch

    from executor.hf.convert import export_checkpoint
    from executor.hf.files import copy_tokenizer

    from executor.options import ExecutorOptions
    from spec.catalog import get_model
    from spec.hf_config import hf_config_from_spec, read_hf_config

    precision = args.precision or "fp32"
    if precision not in EXPORT_DTYPES:
        raise SpecError(f"--precision {precision} is no storage format of the export: give "
                        + ", ".join(EXPORT_DTYPES))
    if args.model:
        spec = get_model(args.model)
        spec = spec.with_layers(args.layers) if args.layers else spec
        defaults = ExecutorOptions()
        config = hf_config_from_spec(spec, defaults.rotary_base, defaults.norm_epsilon)
    else:
        if args.layers:
            raise SpecError("--layers goes with --model (a Hugging Face config has its own layer count)")
        config = read_hf_config(args.model_dir or args.hf_config)[0]
    out = export_checkpoint(args.checkpoint, config, args.out, getattr(torch, EXPORT_DTYPES[precision]))
    tokenizer = copy_tokenizer(args.model_dir, out) if args.model_dir else []
    print(f"wrote {out} ({precision})" + (f" with the tokenizer of {args.model_dir} ({', '.join(tokenizer)})"
                                           if tokenizer else ""))
    return 0
