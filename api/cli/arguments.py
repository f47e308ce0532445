"""One argument vocabulary for every ``foldtune`` command: each flag name has one meaning, one type and one
parser default, wherever it appears.

- :data:`FLAGS` is the vocabulary. A command adds a flag with :func:`add`, which takes the flag's meaning,
  type and default from here; a command may only say how the flag applies to it (``note``, appended to the
  help in parentheses) and whether it is required. Flags whose default depends on the hardware or the
  command (``--gpu``, ``--gpus``, ``--seq``, ``--gbs``, ``--precision``, ``--max-trials``, ``--timeout``, ...)
  default to "not given" here and are resolved by one function each (:mod:`api.cli._shape_args`,
  :func:`budget_defaults`, :func:`timeout_s`).
- :class:`Parser` builds every parser and sub-parser with ``allow_abbrev=False``: ``train --gpu 2`` is no
  longer read as ``--gpus 2``; an unknown prefix is an error.
- A renamed flag stays as :func:`retire`'s action: giving it is one line naming the new spelling (no silent
  alias, so every flag is spelled one way in scripts and docs).

``tests/api/test_cli_vocabulary.py`` walks every command's parser and holds the commands to this.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from api.cli._memory_args import parse_headroom
from spec.errors import FoldtuneError
from spec.hardware import DEFAULT_MIN_HEADROOM
from spec.proxy import PROXIES
from spec.shape_defaults import is_cpu
from spec.training_spec import PRECISIONS

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
EXPORT_FORMATS = ("megatron-args", "yaml", "json", "csv")  # api/cli/_export.py writes them


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that never matches an option by its prefix (its sub-parsers are of this class too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


class RetiredFlag(FoldtuneError):
    """A flag that was renamed: ``foldtune`` prints this as one error line naming the new one."""


@dataclass(frozen=True)
class Flag:
    """A flag's one meaning (the start of its help everywhere), its type and its parser default."""

    meaning: str
    type: Any = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    default: Any = None
    action: Any = None  # "store_true" for switches


GPU_NAMES = "h100-sxm, h200, b200, gb200, gb300, a100-80gb"

FLAGS: dict[str, Flag] = {
    # ---- what runs, where ----------------------------------------------------------------------------
    "--model": Flag("catalog model name (GET /v1/models lists them, and a --catalog file adds to them)"),
    "--model-file": Flag("YAML/JSON file of ModelSpec fields (Megatron names)", metavar="FILE"),
    "--model-dir": Flag("Hugging Face model directory (its config.json; the model is named after DIR)",
                        metavar="DIR"),
    "--hf-config": Flag("a Hugging Face config.json file", metavar="FILE"),
    "--layers": Flag("a proxy of the model with N decoder layers, at its widths and with its features "
                     "(default: every layer)", type=int, metavar="N"),
    "--proxy": Flag("tiny: every architecture feature of the model at test widths (hidden 64, vocab 256)",
                    choices=PROXIES),
    "--gpu": Flag(f"the hardware: catalog hardware ({GPU_NAMES}), a calibrated profile's name, or cpu "
                  "(CPU ranks with gloo)", metavar="NAME"),
    "--gpus": Flag("number of GPUs, or of CPU ranks with --gpu cpu: the world size", type=int, metavar="N"),
    "--gpus-per-node": Flag("GPUs (ranks) per node", type=int, metavar="N"),
    "--profile": Flag("a hardware profile JSON file (written by foldtune calibrate)", metavar="FILE"),
    # ---- the training's shape --------------------------------------------------------------------------
    "--seq": Flag("sequence length in tokens", type=int, metavar="N"),
    "--gbs": Flag("global batch size in sequences per optimizer step", type=int, metavar="N"),
    "--mbs": Flag("micro-batch size in sequences", type=int, metavar="N"),
    "--precision": Flag("number format: bf16, fp16, fp8 or fp32", choices=PRECISIONS),
    "--routing": Flag("MoE routing: dropless, or capacity (with --capacity-factor)",
                      choices=("dropless", "capacity"), default="dropless"),
    "--capacity-factor": Flag("expert capacity factor (with --routing capacity)", type=float, metavar="X"),
    "--pad-to-capacity": Flag("pad every expert's input to its capacity (with --routing capacity; Megatron's "
                              "--moe-pad-expert-input-to-capacity)", action="store_true"),
    "--layout": Flag('a folded layout as foldtune prints it, e.g. "tp2 ep2 dp1 mbs1" (any subset of its tokens)',
                     metavar="LABEL"),
    "--cuda-graphs": Flag("replay each decoder layer's static part (attention, norms, router logits, shared experts) "
                          "from CUDA graphs: the layout's cuda_graphs knob (CUDA ranks only)", default=False,
                          action="store_true"),
    "--min-headroom": Flag("memory per GPU kept free when pruning layouts: a fraction of the GPU's memory "
                           f"(e.g. 0.1) or bytes (e.g. 4GiB); default {DEFAULT_MIN_HEADROOM}", type=parse_headroom,
                           metavar="FRACTION|BYTES"),
    "--search-precision": Flag("search precision as a knob: bf16 and fp8 (fp8 only on GPUs with an fp8 peak), "
                               "ranked by predicted step time", default=False, action="store_true"),
    "--top": Flag("how many of the plan's fastest layouts: listed by plan (default: 10), checked by verify "
                  "(default: 3)", type=int, metavar="N"),
    "--tokens": Flag("also answer the wall time (and with --price-per-gpu-hour the cost) of training N tokens at "
                     "the step time, e.g. 1e12, 300B, 1.5T (suffixes K, M, B, T)", metavar="N"),
    "--price-per-gpu-hour": Flag("price of one GPU-hour in US dollars (with --tokens): cost = GPUs x hours x price",
                                 type=float, metavar="USD"),
    # ---- measuring (profile, tune, calibrate) ----------------------------------------------------------
    "--timed-steps": Flag("timed optimizer steps of each measured run (default: 5)", type=int, metavar="N"),
    "--untimed-steps": Flag("untimed warm-up steps of each measured run, before the timed ones (default: 2)",
                            type=int, metavar="N"),
    "--timeout": Flag("seconds before a run of ranks is stopped, each trial's in tune (default: 600; calibrate: "
                      "1200)", type=float, metavar="SECONDS"),
    "--max-trials": Flag("measured trials at most (default: 6 with --gpu cpu, 20 on GPUs)", type=int, metavar="N"),
    "--max-seconds": Flag("wall-clock seconds of search at most (default: 900 with --gpu cpu, 3600 on GPUs)",
                          type=float, metavar="SECONDS"),
    # ---- training ----------------------------------------------------------------------------------------
    "--job": Flag("a tuning job's id: train its best measured layout", type=int, metavar="ID"),
    "--data": Flag("dataset directory written by `foldtune data prepare`", metavar="DIR"),
    "--steps": Flag("optimizer steps of the training in total (a resume continues to it)", type=int, metavar="N"),
    "--lr": Flag("peak learning rate", type=float, metavar="X"),
    "--lr-warmup": Flag("learning-rate warm-up steps (linear, then cosine decay)", type=int, metavar="N"),
    "--eval-every": Flag("optimizer steps between held-out evaluations (0: at the end only)", type=int, metavar="N"),
    "--seed": Flag("data order seed", type=int, metavar="N"),
    "--checkpoint-dir": Flag("where checkpoints go and are resumed from", metavar="DIR"),
    "--checkpoint-every": Flag("optimizer steps between checkpoints (0: at the end only)", type=int, metavar="N"),
    "--keep-last": Flag("keep the newest N complete checkpoints, deleting older ones once a new one is complete "
                        "(0: keep all)", type=int, metavar="N"),
    # ---- services and output -------------------------------------------------------------------------------
    "--database-url": Flag("the service database, a SQLAlchemy URL (also: FOLDTUNE_DATABASE_URL; default: SQLite "
                           "in FOLDTUNE_DATA_DIR or ~/.foldtune)", metavar="URL"),
    "--ray-address": Flag("the Ray cluster, e.g. head:6379 (also: FOLDTUNE_RAY_ADDRESS; default: a local Ray)",
                          metavar="ADDR"),
    "--url": Flag("API base URL (also: FOLDTUNE_URL; default http://127.0.0.1:8321)", metavar="URL"),
    "--api-key": Flag("API key (also: FOLDTUNE_API_KEY; default: the local key `foldtune tune` wrote)",
                      metavar="KEY"),
    "--format": Flag("print the measured best layout as Megatron-LM arguments with their environment (a shell "
                     "fragment), or as YAML, JSON or one CSV row", choices=EXPORT_FORMATS),
    "--json": Flag("print the answer as JSON instead of text", default=False, action="store_true"),
    "--wait": Flag("follow it until it ends, printing each trial or step", default=False, action="store_true"),
    "--poll": Flag("seconds between polls with --wait (default: 2)", type=float, metavar="SECONDS", default=2.0),
    "--cancel": Flag("cancel the job or training ID", default=False, action="store_true"),
    "--status": Flag("only those with this status", choices=JOB_STATUSES),
    "--limit": Flag("rows per page (default: 20)", type=int, metavar="N", default=20),
    "--offset": Flag("rows to skip (default: 0)", type=int, metavar="N", default=0),
    "--out": Flag("where to write the result", metavar="PATH"),
    "--name": Flag("name of the hardware profile written", metavar="NAME"),
}


def help_of(name: str, note: str | None = None) -> str:
    """The help text of ``name``: its meaning, then the command's ``note`` in parentheses."""
    meaning = FLAGS[name].meaning
    if not note:
        return meaning
    # a meaning that ends in a parenthesis takes the note into it: "(default: 2; with --wait)"
    return f"{meaning[:-1]}; {note})" if meaning.endswith(")") else f"{meaning} ({note})"


def add(parser, name: str, note: str | None = None, *, required: bool = False) -> argparse.Action:
    """Add the vocabulary's flag ``name`` to ``parser`` (a parser, argument group or mutually exclusive group)."""
    flag = FLAGS[name]
    kwargs: dict[str, Any] = {"help": help_of(name, note), "default": flag.default}
    if required:
        kwargs["required"] = True
    if flag.action is not None:
        kwargs["action"] = flag.action
    else:
        kwargs.update({k: v for k, v in (("type", flag.type), ("metavar", flag.metavar), ("choices", flag.choices))
                       if v is not None})
    return parser.add_argument(name, **kwargs)


def add_all(parser, *names: str) -> None:
    """Add several of the vocabulary's flags, each without a note."""
    for name in names:
        add(parser, name)


class _Retired(argparse.Action):
    """Raises :class:`RetiredFlag` naming the flag that replaced this one."""

    def __init__(self, option_strings, dest, replacement: str = "", why: str = "", **kwargs) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.replacement, self.why = replacement, why

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise RetiredFlag(f"{option_string} is now {self.replacement}" + (f" ({self.why})" if self.why else "")
                          + f": `{parser.prog} {self.replacement} ...`")


def retire(parser, old: str, new: str, why: str = "") -> None:
    """``old`` (a renamed flag) becomes an error naming ``new``; hidden from the help."""
    parser.add_argument(old, action=_Retired, replacement=new, why=why)


def retired_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The retired flags of ``parser`` and the flag each names."""
    return {option: action.replacement for action in parser._actions if isinstance(action, _Retired)
            for option in action.option_strings}


# ---- defaults that depend on the hardware or the command ---------------------------------------------------
CPU_BUDGET = (6, 900.0)  # the CPU demo: a few trials of seconds each
GPU_BUDGET = (20, 3600.0)  # the service's own defaults (api/schemas/jobs.py BudgetIn)
TIMEOUT_S = {"calibrate": 1200.0}  # its benchmarks run longer than one training step's
DEFAULT_TIMEOUT_S = 600.0
TIMED_STEPS, UNTIMED_STEPS = 5, 2


def budget_defaults(args: argparse.Namespace, gpu: str) -> tuple[int, float]:
    """``--max-trials`` and ``--max-seconds`` as given, else their defaults for ``gpu``."""
    trials, seconds = CPU_BUDGET if is_cpu(gpu) else GPU_BUDGET
    return (trials if args.max_trials is None else args.max_trials,
            seconds if args.max_seconds is None else args.max_seconds)


TOP = {"plan": 10, "verify": 3}


def top(args: argparse.Namespace, command: str) -> int:
    """``--top`` as given, else the command's default (:data:`TOP`)."""
    return args.top if args.top is not None else TOP[command]


def timeout_s(args: argparse.Namespace, command: str) -> float:
    """``--timeout`` as given, else the command's default (:data:`TIMEOUT_S`)."""
    return args.timeout if args.timeout is not None else TIMEOUT_S.get(command, DEFAULT_TIMEOUT_S)


def step_counts(args: argparse.Namespace) -> tuple[int, int]:
    """(untimed, timed) steps of a measured run: ``--untimed-steps`` / ``--timed-steps`` or their defaults."""
    untimed = UNTIMED_STEPS if args.untimed_steps is None else args.untimed_steps
    timed = TIMED_STEPS if args.timed_steps is None else args.timed_steps
    return untimed, timed
