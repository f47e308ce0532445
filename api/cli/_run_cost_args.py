"""``--tokens N`` and ``--price-per-gpu-hour USD``: "how long, and how much, to train N tokens on this cluster"
(``plan`` and ``best``), and the lines that answer it (costmodel/training_run.py does the arithmetic)."""

from __future__ import annotations

import argparse

from api.cli.arguments import add_all
from costmodel.training_run import TrainingRun
from spec.errors import SpecError
from spec.run_inputs import RunQuestion, check_price_per_gpu_hour, format_token_count, parse_token_count

SECONDS_PER_DAY = 86400.0


def add_run_cost_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tokens`` and ``--price-per-gpu-hour`` (their meaning: api/cli/arguments.py)."""
    add_all(parser, "--tokens", "--price-per-gpu-hour")


def run_question(args: argparse.Namespace) -> RunQuestion | None:
    """The flags' question, None without ``--tokens``; SpecError (one line naming the flag) on a bad value."""
    if args.tokens is None:
        if args.price_per_gpu_hour is not None:
            raise SpecError("--price-per-gpu-hour needs --tokens (the number of tokens to price)")
        return None
    price = args.price_per_gpu_hour
    return RunQuestion(parse_token_count(args.tokens),
                       None if price is None else check_price_per_gpu_hour(price))


def hours(seconds: float) -> str:
    """Wall time in hours, with days beside it once it passes a day: ``5.25 h``, ``490.3 h (20.43 days)``."""
    h = seconds / 3600.0
    text = f"{h:,.4g} h" if h < 1000 else f"{h:,.0f} h"
    return text + (f" ({seconds / SECONDS_PER_DAY:,.4g} days)" if seconds >= SECONDS_PER_DAY else "")


def gpu_hours(value: float) -> str:
    """GPU-hours: whole tenths when large, three significant digits when small (a CPU demo's runs)."""
    return f"{value:,.1f}" if value >= 100 else f"{value:.3g}"


def usd(value: float) -> str:
    return f"{value:,.2f} USD"


def run_heading(run: TrainingRun, seq_length: int | None = None, global_batch_size: int | None = None) -> str:
    """What every run of one question shares: the tokens, the tokens per step (global batch x sequence length,
    named when given) and the steps, the price."""
    price = "" if run.price_per_gpu_hour is None else f", at {run.price_per_gpu_hour:g} USD per GPU-hour"
    shape = "" if seq_length is None else f"global batch {global_batch_size} x seq {seq_length} = "
    return (f"time and cost to train {format_token_count(run.tokens)} tokens ({run.tokens:,}): {shape}"
            f"{run.tokens_per_step:,} tokens per step, {run.steps:,} steps on {run.num_gpus} GPUs{price}")


def run_line(run: TrainingRun) -> str:
    """One run: wall time, GPU-hours and (with a price) cost."""
    cost = "" if run.cost_usd is None else f", cost {usd(run.cost_usd)}"
    return f"wall time {hours(run.wall_s)}, {gpu_hours(run.gpu_hours)} GPU-hours{cost}"
