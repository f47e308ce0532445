"""Command-line arguments the benchmark scripts share (bench/): one spelling, one default, one check each."""

from __future__ import annotations

import argparse

import torch

START_METHODS = ("spawn", "fork")


def add_start_method_argument(parser: argparse.ArgumentParser, cpu_flag: str) -> None:
    """A script's ``--start-method``: how its runs' ranks start (executor.launch_local.launch). 'fork' is for the
    CPU runs ``cpu_flag`` selects (the tests' smoke runs, whose ranks then skip re-importing torch): CUDA cannot be
    initialised again in a forked child. Every run is still a fresh world with its own environment."""
    parser.add_argument("--start-method", choices=START_METHODS, default="spawn",
                        help=f"how each run's ranks start: 'fork' only with {cpu_flag} (the tests' smoke runs, whose "
                             f"ranks then skip re-importing torch); every run is still a fresh world")


def check_start_method(parser: argparse.ArgumentParser, start_method: str, on_cpu: bool, cpu_flag: str) -> None:
    """Refuse (``parser.error``, exit 2) a 'fork' start for a run on CUDA devices."""
    if start_method == "fork" and not on_cpu:
        parser.error(f"--start-method fork is for {cpu_flag} runs: CUDA ranks are spawned")


def add_linear_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """``--rows``, ``--n``, ``--k``: one linear layer's shape (x [rows, k], weight [n, k]), Qwen3-30B-A3B's q
    projection at one micro-batch of seq 4096 by default."""
    parser.add_argument("--rows", type=int, default=4096, help="rows of x (default: 4096)")
    parser.add_argument("--n", type=int, default=4096, help="weight rows, the output width (default: 4096)")
    parser.add_argument("--k", type=int, default=2048, help="weight columns, the input width (default: 2048)")


def linear_operands(rows: int, n: int, k: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """(x [rows, k] requiring grad, weight [n, k] as a Parameter scaled by k^-1/2, dy [rows, n]), bf16, drawn from a
    generator seeded 0 on ``device``: the same operands in every script and run."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, k, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
    w = torch.nn.Parameter((torch.randn(n, k, device=device, generator=gen) * k ** -0.5).to(torch.bfloat16))
    dy = torch.randn(rows, n, device=device, generator=gen).to(torch.bfloat16)
    return x, w, dy
