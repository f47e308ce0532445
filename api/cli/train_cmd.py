"""``foldtune train``: run (or resume) a full training of one folded layout on this machine, with progress.

Local processes (gloo on CPU, NCCL on GPUs), real data from ``foldtune data prepare``, AdamW with warm-up
and cosine decay, gradient clipping, held-out evaluation, and DCP checkpoints in ``--checkpoint-dir``; a
directory that already holds a checkpoint is resumed, under whatever ``--layout`` is given now.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from api.cli._db import migrate_or_explain
from api.cli._units import seconds
from api.cli._shape_args import CPU_GBS, CPU_SEQ, LOCAL_GPU_NOTE, is_cpu, local_gpu, resolve_shape
from api.cli.arguments import add, retire
from api.cli._router_args import add_router_arguments, router_options_from
from api.cli.train_job import run_job_training
from api.service.checkpoint_space import checkpoint_space_problem
from api.worker.metrics import DatabaseMetrics
from api.cli._model_args import add_model_arguments, check_local_run, hf_model_from_args, model_from_args
from spec.catalog import get_hardware
from spec.errors import SpecError
from spec.hf_config import hf_config_from_spec, read_hf_config
from spec.parallel_config import ParallelConfig
from spec.recipe import DEFAULT_RECIPE
from spec.training_spec import TrainingSpec
from db.settings import database_settings

HELP = "train a model with one folded layout (or a tuning job's best) on local data, with checkpoints and resume"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add(parser, "--data", required=True)
    add_model_arguments(parser, required=False, note="with --layout; --job gives its own")
    source = parser.add_mutually_exclusive_group()
    add(source, "--layout", "default: dp1")
    add(source, "--job", "finished, from the service database: on its model, GPUs, sequence length, batch and "
                         "precision, through the runner (Ray)")
    add(parser, "--gpu", LOCAL_GPU_NOTE + "; with --job the job's")
    add(parser, "--cuda-graphs", "with --layout (its cuda_graphs knob on)")
    add(parser, "--gpus", "default: the layout's dp times tp·cp·pp")
    add(parser, "--steps", required=True)
    add(parser, "--seq", f"default: {CPU_SEQ} on CPU ranks; on GPUs give it; with --job the job's")
    add(parser, "--gbs", f"default: {CPU_GBS} on CPU ranks; on GPUs give it; with --job the job's")
    recipe = DEFAULT_RECIPE
    add(parser, "--lr", f"default: {recipe.lr:g}")
    parser.add_argument("--min-lr", type=float, default=None, metavar="X",
                        help=f"final learning rate of the cosine decay (default: {recipe.min_lr:g})")
    add(parser, "--lr-warmup", f"default: {recipe.warmup_steps}")
    parser.add_argument("--weight-decay", type=float, default=None, metavar="X",
                        help=f"AdamW weight decay (default: {recipe.weight_decay:g})")
    parser.add_argument("--clip-grad", type=float, default=None, metavar="X",
                        help=f"max global gradient norm, 0: no clipping (default: {recipe.max_grad_norm:g})")
    add(parser, "--eval-every", f"default: {recipe.eval_every}")
    parser.add_argument("--eval-batches", type=int, default=None, metavar="N",
                        help=f"held-out global batches per evaluation (default: {recipe.eval_batches})")
    add(parser, "--checkpoint-dir", "with --job the default is <data dir>/checkpoints/job-ID")
    add(parser, "--checkpoint-every", "default: 0")
    add(parser, "--keep-last", "default: 0")
    parser.add_argument("--export-hf", metavar="DIR",
                        help="at the end, write the trained model as a Hugging Face directory (config.json + "
                             "model.safetensors): the config of --model-dir/--hf-config, else one written for "
                             "the model (docs/huggingface.md)")
    add_router_arguments(parser, recipe.router_defaults())  # with --job: the job's unless given
    add(parser, "--seed", f"default: {recipe.data_seed}")
    parser.add_argument("--training-id", type=int,
                        help="also write every step's metrics to this training's rows in the service database")
    add(parser, "--database-url")
    retire(parser, "--warmup", "--lr-warmup", "the learning-rate warm-up; --untimed-steps are a measured run's")
    retire(parser, "--device", "--gpu", "--gpu cpu trains on CPU ranks, a GPU name on CUDA")


RECIPE_FLAGS = {"lr": "lr", "min_lr": "min_lr", "lr_warmup": "warmup_steps", "weight_decay": "weight_decay",
                "clip_grad": "max_grad_norm", "eval_every": "eval_every", "eval_batches": "eval_batches",
                "seed": "data_seed", "checkpoint_every": None, "keep_last": None}


def fill_recipe_defaults(args: argparse.Namespace) -> None:
    """The recipe's value (spec.recipe.DEFAULT_RECIPE; 0 for the checkpoint flags) for every training flag not
    given: the parser leaves them unset so that one flag has one default in every command."""
    for flag, field in RECIPE_FLAGS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, 0 if field is None else getattr(DEFAULT_RECIPE, field))


def _export_config(model, hf_source: str | None, defaults) -> dict:
    """The config.json --export-hf writes: the Hugging Face source's, else one for the model with the
    executor's default RoPE θ and norm ε (``defaults``: what a run without a Hugging Face config trains with)."""
    if hf_source:
        return read_hf_config(hf_source)[0]
    return hf_config_from_spec(model, defaults.rotary_base, defaults.norm_epsilon)


class _Progress:
    """Prints rank 0's progress, then hands the step to ``sink`` (if any)."""

    def __init__(self, sink=None):
        self.sink = sink

    def __call__(self, rank: int, m) -> None:
        print_progress(rank, m)
        if self.sink is not None:
            self.sink(rank, m)


def print_progress(rank: int, m) -> None:
    """Rank 0's line per step (runs inside the rank process; module-level so spawned ranks can import it)."""
    if rank != 0:
        return
    line = (f"step {m.step + 1:>6}  loss {m.loss:.4f}  lr {m.lr:.2e}  grad_norm {m.grad_norm:.3f}  "
            f"{m.tokens_per_s:,.0f} tok/s  {seconds(m.step_time_s)}")
    if m.eval_loss is not None:
        line += f"  eval_loss {m.eval_loss:.4f}"
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    fill_recipe_defaults(args)
    if args.job is not None:
        if (args.model_file or args.model_dir or args.hf_config or args.export_hf or args.layers
                or args.proxy):  # --model may repeat the job's (train_job checks it)
            raise SpecError("--job trains the job's model (and its proxy); leave out --model-file, --model-dir, "
                            "--hf-config, --export-hf, --layers and --proxy")
        if args.cuda_graphs:
            raise SpecError("--job trains the job's best layout as it was measured; --cuda-graphs goes with --layout")
        return run_job_training(args)
    # torch and the executor: only the command that trains pays for them, not `foldtune --help`
    import torch

    from executor.hf.files import copy_tokenizer
    from executor.hf.weights import INDEX_FILE, SINGLE_FILE, check_loadable
    from executor.options import ExecutorOptions
    from executor.profile import peak_flops
    from executor.train.loop import TrainConfig, train_local

    if not (args.model or args.model_file or args.model_dir or args.hf_config):
        raise SpecError("--model is required with --layout (or --model-file, --model-dir, --hf-config; or give "
                        "--job ID to train a tuning job's best layout)")
    hf = hf_model_from_args(args)
    hf_source = args.model_dir or args.hf_config
    # --model-dir with weights: a fresh run starts from them (the full model only: a proxy has other shapes)
    weights = args.model_dir and any((Path(args.model_dir) / name).is_file() for name in (SINGLE_FILE, INDEX_FILE))
    hf_init = args.model_dir if weights else None
    if (hf_init or (hf_source and args.export_hf)) and (args.layers or args.proxy):
        raise SpecError("--layers/--proxy change the model's shapes: its Hugging Face weights would not fit")
    if hf_init:
        check_loadable(hf)
    args.layout = args.layout or "dp1"
    model = model_from_args(args)
    config = ParallelConfig.parse(args.layout, world_size=args.gpus)
    if args.cuda_graphs:
        config = config.replace(cuda_graphs=True)
    if args.gpu:
        get_hardware(args.gpu)  # `train --gpu 2`: an unknown hardware name, not a count of GPUs
    gpu = args.gpu or local_gpu(config.world_size)
    device = "cpu" if is_cpu(gpu) else "cuda"
    shape = resolve_shape(args, gpu, "train")  # the shared defaults
    args.seq, args.gbs = shape.seq, shape.gbs
    check_local_run(model, TrainingSpec(seq_length=args.seq, global_batch_size=args.gbs), config, gpu)
    cfg = TrainConfig(args.data, steps=args.steps, seq_length=args.seq, global_batch_size=args.gbs, lr=args.lr,
                      min_lr=args.min_lr, warmup_steps=args.lr_warmup, weight_decay=args.weight_decay,
                      max_grad_norm=args.clip_grad, eval_every=args.eval_every, eval_batches=args.eval_batches,
                      checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                      keep_last=args.keep_last, data_seed=args.seed, hf_init_dir=hf_init,
                      hf_export_dir=args.export_hf,
                      hf_export_config=_export_config(model, hf_source, ExecutorOptions()) if args.export_hf else None)
    space = checkpoint_space_problem(model, cfg.steps, cfg.checkpoint_every, cfg.keep_last, cfg.checkpoint_dir)
    if space is not None:  # before any rank starts, not at a save after the training
        raise SpecError(space)
    options = ExecutorOptions.for_router(router_options_from(args, DEFAULT_RECIPE.router_defaults()), model,
                                         **(hf.executor_options() if hf is not None else {}))
    print(f"training {model.name} with {config.label()} on {config.world_size} {device} rank(s): {args.steps} steps "
          f"of {args.gbs}×{args.seq} tokens" + (f", from the weights in {hf_init}" if hf_init else ""), flush=True)
    sink = None
    if args.training_id is not None:
        url = database_settings(args.database_url).url
        migrate_or_explain(url)
        name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
        sink = DatabaseMetrics(url, args.training_id, peak_flops(name, "bf16" if device == "cuda" else "fp32", None))
    report = train_local(model, config, cfg, options, on_step=_Progress(sink), device=device)
    if report.resumed_from:
        print(f"resumed from {report.resumed_from} (saved as {report.resumed_layout}) at step {report.start_step}")
    if report.initial_eval_loss is not None:
        print(f"initial eval_loss {report.initial_eval_loss:.4f}")
    if report.metrics:
        last = report.metrics[-1]
        print(f"done: step {last.step + 1}, loss {last.loss:.4f}, eval_loss {last.eval_loss:.4f}"
              + (f", last checkpoint {report.checkpoints[-1]}" if report.checkpoints else ""))
    else:
        print(f"nothing to do: the checkpoint is already at step {report.start_step}", file=sys.stderr)
    if args.export_hf:
        tokenizer = copy_tokenizer(args.model_dir, args.export_hf) if args.model_dir else []
        print(f"exported the trained model to {args.export_hf} (Hugging Face {cfg.hf_export_config['model_type']})"
              + (f" with the tokenizer of {args.model_dir} ({', '.join(tokenizer)})" if tokenizer else ""))
    return 0
