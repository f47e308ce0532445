"""foldtune's whole training step against torchtitan 0.3.0's compiled step of the same widths (issue 38's bar).

Both sides train the same proxy in one call, one after the other, each in a process of its own on one GPU: the
first ``--layers`` (4) decoder layers of Qwen3-30B-A3B or DeepSeek-V2-Lite at their real widths, sequence
``--seq`` (4096), micro-batch ``--mbs`` (1), ``--micro-batches`` (4) micro-batches a step, bf16 compute with
fp32 optimizer state, AdamW, random tokens.

- foldtune: the executor's step (:func:`bench.fp8_step.step_worker`, bf16, no recompute), its defaults.
- torchtitan: its own ``Trainer`` and ``Trainer.train_step``, built from its own config for the model
  (``qwen3_30b_a3b()`` / ``deepseek_v3_16b()`` of its config registry: its loss, optimizer, attention backend
  and CUDA-graph setting) with these changes: the layers cut to ``--layers``; ``torch.compile`` on (its
  per-block model compile and its compiled loss: ``CompileConfig(enable=True)``); no activation checkpointing
  (foldtune runs none either); one GPU (its single-device setup: FSDP2 over a mesh of one, bf16 parameters
  for compute, fp32 reductions); no checkpoints; the synthetic tokens of :class:`_RandomTokens` in place of
  its HuggingFace dataset. ``--torchtitan-cuda-graphs on|off`` overrides the config's CUDA-graph choice
  (Qwen3's config leaves 0.3.0's default, graphs on; DeepSeek-V3-16B's turns them off).

Each side runs ``--warmup`` steps (compilation and graph capture happen there), then times ``--steps`` steps
one by one (host clock around a synchronised step); the median is reported with tokens/s and foldtune's
speed-up (torchtitan's step time over foldtune's; the bar is >= 1.3).

torchtitan is not a dependency of foldtune. Install it beside the repo without its dependencies, e.g.::

    pip download --no-deps -d .ttwhl torchtitan==0.3.0 tyro docstring_parser typeguard typing_extensions \\
        einops spmd_types==0.2.3 torchdata
    pip install --no-index --no-deps --target /tmp/tts .ttwhl/*.whl
    PYTHONPATH=/tmp/tts:$PWD python3 -m bench.torchtitan_step

0.3.0's trainer module imports packages that this step never calls: HuggingFace ``datasets`` and
``tokenizers`` (its dataset loaders and tokenizer) and tensorboard (its metric writer, off by default), and,
from torch newer than 2.11, the class ``torch.distributed.fsdp.DataParallelMeshDims`` (a type hint of its
full-DTensor backend, not the default one run here). Where one of those is missing the torchtitan process
installs an empty placeholder for it before importing torchtitan, and the report lists which
(``placeholders``); a placeholder that were called would raise. Its flex-attention masks pass
``create_block_mask`` an argument newer than torch 2.11 (``separate_full_blocks=True``, which 2.11 does
anyway); on such a torch an adapter drops it (:func:`_adapt_block_mask`, listed there too).

On torch 2.11 (the H200 machine's, 2026-12-04) two of the configs' choices fail: the chunked loss
(``ChunkedLossWrapper``) in its backward ("data is not allocated yet") and the CUDA-graphed forward-backward at
its second step ("BlockMask structure must remain constant"). ``--torchtitan-loss plain`` (its
``CrossEntropyLoss`` after the model's whole output layer) and ``--torchtitan-cuda-graphs off`` run there.
``--torchtitan-reshard never`` keeps FSDP's unsharded parameters from forward to backward (fewer copies a
micro-batch); ``--profile`` adds torchtitan's kernels by class; ``--sides`` runs one side only.

Usage (GPU): python3 -m bench.torchtitan_step [--models qwen3-30b-a3b,deepseek-v2-lite] [--layers 4]
             [--seq 4096] [--mbs 1] [--micro-batches 4] [--warmup 4] [--steps 8] [--commit C] [--no-write]
             [--torchtitan-loss config|plain] [--torchtitan-cuda-graphs config|on|off]
             [--torchtitan-reshard default|always|never] [--profile] [--sides foldtune,torchtitan]
On a GPU the table replaces its own section of docs/benchmarks.md (``--no-write``: print only; ``--render F[,F]``
writes the section of saved reports, e.g. those a remote GPU run sent back, into ``--doc`` or that file).
Writes $OUT/torchtitan_step.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from bench.report import DOC, add_report_arguments, machine, replace_section

# foldtune's catalog name -> (torchtitan model package, its config-registry function)
TORCHTITAN_CONFIGS = {
    "qwen3-30b-a3b": ("qwen3", "qwen3_30b_a3b"),
    "deepseek-v2-lite": ("deepseek_v3", "deepseek_v3_16b"),
}
BAR_SPEEDUP = 1.3
SECTION = "## foldtune's step against torchtitan 0.3.0's compiled step (`python3 -m bench.torchtitan_step`)"
CHILD_TIMEOUT_S = 900  # compilation of four blocks and the loss takes minutes on a cold cache


class ConfigError(ValueError):
    """A bad command-line value (named in the message)."""


def parse_models(text: str) -> list[str]:
    """'qwen3-30b-a3b,deepseek-v2-lite' -> the names; ConfigError for a model torchtitan has no config of."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in TORCHTITAN_CONFIGS]
    if unknown or not names:
        raise ConfigError(f"--models: each must be one of {', '.join(TORCHTITAN_CONFIGS)}; got {text!r}")
    return names


def summarize(step_seconds: list[float], tokens_per_step: int) -> dict:
    """Median step (ms) and tokens/s of the timed steps (seconds each)."""
    median = statistics.median(step_seconds)
    return {"step_ms": median * 1e3, "tokens_per_s": tokens_per_step / median,
            "step_ms_all": [round(s * 1e3, 2) for s in step_seconds]}


def speedup(foldtune: dict, torchtitan: dict) -> float | None:
    """foldtune's speed-up: torchtitan's median step time over foldtune's (None where either side failed)."""
    if "step_ms" not in foldtune or "step_ms" not in torchtitan:
        return None
    return torchtitan["step_ms"] / foldtune["step_ms"]


def section(reports: list[dict]) -> str:
    """The docs/benchmarks.md section of one or more runs (each with its command line), a table each."""
    lines = [SECTION]
    for report in reports:
        lines += ["",
                  f"`{report['command']}` at {report.get('commit') or 'an unnamed commit'}, "
                  f"{report['date'][:16].replace('T', ' ')} UTC on {report['machine']} (torch {report['torch']}, "
                  f"torchtitan {report.get('torchtitan') or '?'}): {report['layers']}-layer proxies at seq "
                  f"{report['seq']}, micro-batch {report['mbs']}, {report['micro_batches']} micro-batches a step, "
                  f"median of {report['steps']} steps after {report['warmup']} warm-up steps, each side in a process "
                  f"of its own, one after the other. torchtitan: its own Trainer and config for the model, compiled "
                  f"(model blocks and loss), no activation checkpointing. Bar: foldtune >= {BAR_SPEEDUP}x.", "",
                  "| model | foldtune ms | torchtitan ms | torchtitan loss, FSDP reshard | torchtitan CUDA graphs | "
                  "foldtune tokens/s | torchtitan tokens/s | foldtune's speed-up |",
                  "|---|---:|---:|---|---|---:|---:|---:|"]
        for row in report["rows"]:
            f, t = row["foldtune"], row["torchtitan"]
            fm = f"{f['step_ms']:.1f}" if "step_ms" in f else f"failed: {f.get('error', '?')[:60]}"
            tm = f"{t['step_ms']:.1f}" if "step_ms" in t else f"failed: {t.get('error', '?')[:60]}"
            ft = f"{f['tokens_per_s']:,.0f}" if "tokens_per_s" in f else "-"
            tt = f"{t['tokens_per_s']:,.0f}" if "tokens_per_s" in t else "-"
            ratio = speedup(f, t)
            graphs = "on" if t.get("cuda_graphs") else ("off" if "cuda_graphs" in t else "-")
            setup = f"{t['loss']}, {t.get('reshard_after_forward', 'default')}" if "loss" in t else "-"
            lines.append(f"| {row['model']} | {fm} | {tm} | {setup} | {graphs} | {ft} | {tt} | "
                         f"{f'{ratio:.2f}x' if ratio else '-'} |")
        placeholders = sorted({p for row in report["rows"] for p in row["torchtitan"].get("placeholders", [])})
        if placeholders:
            lines += ["", "Placeholders and adapters for what torchtitan 0.3.0 imports from newer packages or never "
                      "calls here (the script's docstring): " + ", ".join(f"`{p}`" for p in placeholders) + "."]
    return "\n".join(lines) + "\n"


# ---- the torchtitan side (runs in a process of its own) ------------------------------------------------------

def _install_placeholders() -> list[str]:
    """Empty stand-ins for what torchtitan 0.3.0's trainer imports and this step never calls (module
    docstring); the names of those installed. Each placeholder callable raises."""
    installed = []

    def unavailable(*_args, **_kwargs):
        raise RuntimeError("a placeholder installed by bench.torchtitan_step was called")

    def placeholder(name: str, **attrs) -> None:
        module = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        sys.modules[name] = module
        installed.append(name)

    for name, attrs in (("datasets", {"Dataset": object, "load_dataset": unavailable}),
                        ("tokenizers", {"AddedToken": unavailable, "Tokenizer": unavailable})):
        try:
            __import__(name)
        except ImportError:
            placeholder(name, **attrs)
            if name == "datasets":
                placeholder("datasets.distributed", split_dataset_by_node=unavailable)
                sys.modules["datasets"].distributed = sys.modules["datasets.distributed"]
    try:
        import torch.utils.tensorboard  # noqa: F401  (present where tensorboard is installed)
    except ImportError:
        placeholder("torch.utils.tensorboard", SummaryWriter=unavailable)
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})
        installed.append("torch.distributed.fsdp.DataParallelMeshDims")
    return installed


def _adapt_block_mask() -> list[str]:
    """torchtitan 0.3.0 builds its flex-attention masks with ``create_block_mask(..., separate_full_blocks=True)``,
    an argument newer than torch 2.11, whose ``create_block_mask`` always keeps the full blocks apart (the same
    mask). On such a torch the call goes through an adapter that drops the argument (and refuses False, which
    2.11 cannot do). The adaptation's name, or nothing where this torch takes the argument."""
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask

    from torchtitan.models.common import attention

    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return []
    compiled = attention._compiled_create_block_mask

    def adapted(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise RuntimeError("this torch's create_block_mask cannot merge full and partial blocks")
        return compiled(*args, **kwargs)

    attention._compiled_create_block_mask = adapted
    return ["create_block_mask(separate_full_blocks=True) as torch 2.11's create_block_mask"]


def _torchtitan_trainer_config(model: str, layers: int, seq: int, mbs: int, micro_batches: int,
                               cuda_graphs: str, loss: str = "config", reshard: str = "default"):
    """torchtitan's own Trainer.Config for ``model`` with this benchmark's changes (module docstring)."""
    import dataclasses
    import importlib
    from dataclasses import dataclass

    import torch

    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.config import CompileConfig, ParallelismConfig
    from torchtitan.models.common.config_utils import decoder_vocab_size

    class _NoTokenizer(BaseTokenizer):
        """The tokenizer slot of a run on synthetic token ids: only its vocabulary size is read."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 0

        def __init__(self, config, **_kwargs):
            super().__init__()
            self.vocab_size = config.vocab_size
            self.eos_id = 0

        def encode(self, *args, **kwargs):
            raise NotImplementedError("synthetic tokens: nothing is encoded")

        def decode(self, *args, **kwargs):
            raise NotImplementedError("synthetic tokens: nothing is decoded")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class _RandomTokens(BaseDataLoader):
        """Uniform random token ids, a fixed seed, forever: inputs, next-token labels, and positions 0..seq-1 in
        each row (one document a sequence: the attention mask is plain causal, as foldtune's)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 0

        def __init__(self, config, *, seq_len: int, local_batch_size: int, **_kwargs):
            self.vocab_size, self.seq_len, self.batch = config.vocab_size, seq_len, local_batch_size
            self.generator = torch.Generator().manual_seed(0)

        def __iter__(self):
            while True:
                tokens = torch.randint(0, self.vocab_size, (self.batch, self.seq_len + 1), generator=self.generator)
                positions = torch.arange(self.seq_len).expand(self.batch, -1).contiguous()
                yield {"input": tokens[:, :-1], "positions": positions}, tokens[:, 1:]

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    package, function = TORCHTITAN_CONFIGS[model]
    config = getattr(importlib.import_module(f"torchtitan.models.{package}.config_registry"), function)()
    config.model_spec.model.layers = config.model_spec.model.layers[:layers]
    vocab = decoder_vocab_size(config.model_spec)
    training = dataclasses.replace(config.training, local_batch_size=mbs, global_batch_size=mbs * micro_batches,
                                   seq_len=seq, steps=10_000)
    if cuda_graphs != "config":
        training = dataclasses.replace(training, disable_cuda_graphs=cuda_graphs == "off")
    config.training = training
    config.tokenizer = _NoTokenizer.Config(vocab_size=vocab)
    config.dataloader = _RandomTokens.Config(vocab_size=vocab)
    config.parallelism = ParallelismConfig(fsdp_reshard_after_forward=reshard)
    config.activation_checkpoint = None
    config.compile = CompileConfig(enable=True)
    if loss == "plain":  # the whole output layer inside the model's forward, then torchtitan's cross-entropy
        config.loss = CrossEntropyLoss.Config(global_vocab_size=vocab)
    config.checkpoint = dataclasses.replace(config.checkpoint, enable=False)
    config.dump_folder = tempfile.mkdtemp(prefix="torchtitan_step_")
    return config


def torchtitan_child(model: str, layers: int, seq: int, mbs: int, micro_batches: int, warmup: int, steps: int,
                     cuda_graphs: str, loss: str = "config", profile: bool = False,
                     reshard: str = "default") -> dict:
    """torchtitan's side in this process (one GPU, a process group of one from the environment); ``profile``:
    one more step under torch.profiler, its CUDA kernels by class (``bench.step_kernels_gpu``'s classes)."""
    placeholders = _install_placeholders()
    import torch

    import torchtitan
    from torchtitan.trainer import Trainer

    placeholders += _adapt_block_mask()
    config = _torchtitan_trainer_config(model, layers, seq, mbs, micro_batches, cuda_graphs, loss, reshard)
    trainer = Trainer(config)
    batches = trainer.batch_generator(trainer.dataloader)
    times = []
    for step in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.step += 1
        trainer.train_step(batches)
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    out = summarize(times, mbs * micro_batches * seq)
    if profile:
        out.update(_profiled_step(lambda: trainer.train_step(batches)))
    out.update(cuda_graphs=not config.training.disable_cuda_graphs, placeholders=placeholders,
               loss=type(config.loss).__qualname__.split(".")[0], reshard_after_forward=reshard,
               torchtitan=getattr(torchtitan, "__version__", None) or _dist_version("torchtitan"),
               peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
               params=sum(p.numel() for m in trainer.model_parts for p in m.parameters()))
    return out


def _profiled_step(step) -> dict:
    """One ``step()`` under torch.profiler: its CUDA kernels' milliseconds by class, and the top 15 kernels."""
    import torch
    from torch.profiler import ProfilerActivity

    from bench.step_kernels_gpu import classes_ms
    from executor.microbench.step_trace import cuda_kernels, kernel_times, top_kernels

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    times = kernel_times(cuda_kernels(prof))
    every = top_kernels(times, len(times))
    return {"classes_ms": classes_ms(every), "top": every[:15], "busy_ms": sum(k["ms"] for k in every)}


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# ---- the parent: both sides per model ---------------------------------------------------------------------

def run_torchtitan(model: str, args) -> dict:
    """torchtitan's side in a child process (its own CUDA context and memory); its result or {'error': ...}.
    Not :func:`executor.launch_local.launch`: torchtitan's trainer starts its own process group from the
    environment torchrun would set."""
    from executor.launch_local import free_port

    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        command = [sys.executable, "-m", "bench.torchtitan_step", "--child", model, "--child-out", result_path,
                   "--layers", str(args.layers), "--seq", str(args.seq), "--mbs", str(args.mbs),
                   "--micro-batches", str(args.micro_batches), "--warmup", str(args.warmup),
                   "--steps", str(args.steps), "--torchtitan-cuda-graphs", args.torchtitan_cuda_graphs,
                   "--torchtitan-loss", args.torchtitan_loss, "--torchtitan-reshard", args.torchtitan_reshard,
                   *(["--profile"] if args.profile else [])]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {CHILD_TIMEOUT_S} s"}
        if done.returncode != 0 or not os.path.exists(result_path):
            lines = [line for line in (done.stderr + done.stdout).splitlines()
                     if line.strip() and "warn" not in line.lower()]
            tail = lines[-40:]
            print("\n".join("   | " + line for line in tail), flush=True)
            return {"error": tail[-1] if tail else f"exit status {done.returncode}"}
        with open(result_path) as f:
            return json.load(f)


def run_foldtune(model: str, args) -> dict:
    """foldtune's side in a process of its own (bench.fp8_step.step_worker, bf16); its result or an error."""
    from bench.fp8_step import step_worker
    from executor.launch_local import launch
    from spec.training_spec import TrainingSpec

    training = TrainingSpec(seq_length=args.seq, global_batch_size=args.mbs * args.micro_batches, precision="bf16")
    worker = functools.partial(step_worker, micro_batch_size=args.mbs)
    launched = launch(worker, 1, (model, args.layers, training, args.warmup + args.steps, args.warmup, 0, True),
                      backend="nccl", timeout_s=CHILD_TIMEOUT_S)
    if not launched.ok:
        return {"error": launched.failure_reason}
    rep = launched.results[0]
    out = summarize(rep["step_times"][args.warmup:], args.mbs * args.micro_batches * args.seq)
    out["peak_allocated_gib"] = rep.get("peak_allocated_gib")
    return out


def render(paths: str, doc: str | None) -> int:
    """Write the docs section of the saved reports at ``paths`` (a comma list; each with its own command line,
    commit and date) into ``doc`` (default docs/benchmarks.md); 2 with a message for a file that is not one."""
    reports = []
    for path in paths.split(","):
        try:
            with open(path) as f:
                reports.append(json.load(f))
            section(reports[-1:])
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"--render {path}: not a report of this script ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
    text = section(reports)
    replace_section(SECTION, text, Path(doc) if doc else DOC)
    print(text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-30b-a3b,deepseek-v2-lite")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--mbs", type=int, default=1, help="micro-batch size (sequences)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches a step")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first (compilation, graph capture)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--torchtitan-cuda-graphs", choices=("config", "on", "off"), default="config",
                        help="torchtitan's CUDA-graphed forward-backward: as its model config says, or forced")
    parser.add_argument("--torchtitan-loss", choices=("config", "plain"), default="config",
                        help="torchtitan's loss: its config's (chunked over the sequence with the output layer) "
                             "or its plain cross-entropy after the model's whole output layer")
    parser.add_argument("--torchtitan-reshard", choices=("default", "always", "never"), default="default",
                        help="torchtitan's FSDP reshard_after_forward (its single-GPU run is FSDP2 over a mesh of "
                             "one; 'never' keeps the bf16 parameters between forward and backward)")
    parser.add_argument("--profile", action="store_true",
                        help="torchtitan's side profiles one more step and reports its kernels by class")
    parser.add_argument("--sides", default="foldtune,torchtitan", help="which sides run (comma list)")
    add_report_arguments(parser, "torchtitan_step.json")
    parser.add_argument("--render", metavar="JSON[,JSON]",
                        help="write the docs/benchmarks.md section of saved reports (GPU runs' --out) and exit")
    parser.add_argument("--doc", help="with --render: the Markdown file whose section is written "
                                      "(default docs/benchmarks.md)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("layers", "seq", "mbs", "micro_batches", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.render:
        return render(args.render, args.doc)
    try:
        models = parse_models(args.child or args.models)
    except ConfigError as e:
        parser.error(str(e))
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - {"foldtune", "torchtitan"}:
        parser.error(f"--sides: foldtune and/or torchtitan, got {args.sides!r}")

    if args.child:
        result = torchtitan_child(models[0], args.layers, args.seq, args.mbs, args.micro_batches, args.warmup,
                                  args.steps, args.torchtitan_cuda_graphs, args.torchtitan_loss, args.profile,
                                  args.torchtitan_reshard)
        with open(args.child_out, "w") as f:
            json.dump(result, f)
        return 0

    import torch

    if not torch.cuda.is_available():
        print("bench.torchtitan_step needs a CUDA GPU: torchtitan's trainer runs on CUDA only", file=sys.stderr)
        return 2
    if "torchtitan" in sides and _dist_version("torchtitan") is None:
        print("torchtitan is not installed here; see this script's docstring (python3 -m bench.torchtitan_step "
              "--help) for how to put it beside the repo", file=sys.stderr)
        return 2
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "machine": machine(),
              "commit": args.commit, "torch": torch.__version__, "torchtitan": _dist_version("torchtitan"),
              "layers": args.layers, "seq": args.seq, "mbs": args.mbs, "micro_batches": args.micro_batches,
              "warmup": args.warmup, "steps": args.steps, "rows": [],
              "command": "python3 -m bench.torchtitan_step " + " ".join(sys.argv[1:])}
    failed = 0
    for model in models:
        row = {"model": model, "foldtune": {}, "torchtitan": {}}
        for side in sides:
            print(f"== {model}@{args.layers}L {side}", flush=True)
            result = run_foldtune(model, args) if side == "foldtune" else run_torchtitan(model, args)
            row[side] = result
            if "error" in result:
                failed += 1
                print(f"   failed: {result['error']}", flush=True)
            else:
                print(f"   step {result['step_ms']:.1f} ms ({result['tokens_per_s']:,.0f} tokens/s); steps "
                      f"{result['step_ms_all']}", flush=True)
                for label, ms in result.get("classes_ms", {}).items():
                    print(f"      {ms:8.2f} ms  {label}", flush=True)
                for k in result.get("top", []):
                    print(f"      {k['ms']:8.2f} ms {k['calls']:5d}x {k['name'][:110]}", flush=True)
        row["speedup"] = speedup(row["foldtune"], row["torchtitan"])
        if row["speedup"]:
            print(f"   foldtune's speed-up: {row['speedup']:.3f}x (bar {BAR_SPEEDUP}x)", flush=True)
        report["rows"].append(row)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    if not args.no_write and sides == ["foldtune", "torchtitan"]:
        replace_section(SECTION, section([report]))
        print("wrote its section of docs/benchmarks.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
