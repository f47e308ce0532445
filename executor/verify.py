"""Numerical equivalence of a folded layout with the single-process reference.

:func:`run_scenario` trains a few steps of a scenario under one layout and returns, on rank 0, the loss
of every step, every gradient of the first step and every parameter after the last step, all at full
shape. :func:`layout_worker` runs several (layout, scenario) pairs in one launched world (see ``executor.launch_local``);
:func:`compare` lists what differs beyond tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from spec.model_spec import ModelSpec
from spec.optimizer_dtypes import FIELDS as OPTIMIZER_DTYPE_FIELDS
from spec.parallel_config import ParallelConfig
from executor.buildable import check_buildable, training_for
from executor.data import global_batch, micro_batches, packed_global_batch, packed_micro_batches
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.parallel.sharding import gather_model
from executor.train_step import Trainer


@dataclass(frozen=True)
class Scenario:
    name: str
    model: ModelSpec
    options: ExecutorOptions = field(default_factory=ExecutorOptions)
    seq_length: int = 16
    global_batch_size: int = 4
    micro_batch_size: int = 1
    steps: int = 3
    lr: float = 1e-3
    # Adam divides by sqrt(v) + eps: gradients of ~1e-9 (cancellations) carry fp32 reduction-order noise
    # of a few percent, which eps = 1e-8 would amplify into visible parameter differences.
    adam_eps: float = 1e-6
    device: str = "cpu"  # 'cuda': rank r runs on GPU r (NCCL)
    packed: bool = False  # packed rows of random documents (executor.data.packed_global_batch)


def run_scenario(config: ParallelConfig, scenario: Scenario, rank: int = 0) -> dict | None:
    """Train ``scenario.steps`` steps on this rank's slice; rank 0 returns losses, step-1 grads and final params.
    The rule book judges the layout first (:func:`executor.buildable.check_buildable`)."""
    training = training_for(scenario.seq_length, scenario.global_batch_size,
                            scenario.options.moe_expert_capacity_factor,
                            scenario.options.moe_pad_expert_input_to_capacity)
    check_buildable(scenario.model, training, config.replace(micro_batch_size=scenario.micro_batch_size))
    return train_and_gather(config, scenario, rank)


def train_and_gather(config: ParallelConfig, scenario: Scenario, rank: int = 0) -> dict | None:
    """:func:`run_scenario` without the rule book's judgement: for a test of an executor path that only
    Megatron's rules keep out of the product (the EP overlap's combined 1F1B at pp > 1 without virtual stages,
    which Megatron's schedule lacks and the executor's runs)."""
    state = build_parallel_state(config, rank)
    torch.manual_seed(0)
    device = torch.device("cuda", rank) if scenario.device == "cuda" else torch.device("cpu")
    model = MoEGPT(scenario.model, state, scenario.options, scenario.seq_length, device)
    trainer = Trainer(model, lr=scenario.lr, eps=scenario.adam_eps)
    dp = state.dp  # CP ranks share their micro-batches (each keeps its part of the sequence)
    losses, counts, by_layer, grads = [], [], [], None
    for step in range(scenario.steps):
        result = trainer.step(_micro_batches(scenario, step, dp, device))
        losses.append(result.loss)
        counts.append(result.tokens_per_expert)
        by_layer.append(result.tokens_per_expert_by_layer)
        if step == 0:
            trainer.reducer.materialize()  # the distributed optimizer leaves only this rank's reduced shard
            grads = gather_model(model, state, grads=True)
    params = gather_model(model, state)
    if rank != 0:
        return None
    return {"loss": losses, "tokens_per_expert": counts, "tokens_per_expert_by_layer": by_layer, "grads": grads,
            "params": params}


def _micro_batches(scenario: Scenario, step: int, dp, device: torch.device) -> list[tuple]:
    """This DP rank's micro-batches of the scenario's global batch of ``step`` (packed ones with segment ids)."""
    args = (scenario.model.vocab_size, scenario.seq_length, scenario.global_batch_size, scenario.options.seed, step)
    if not scenario.packed:
        return micro_batches(global_batch(*args), dp.size, dp.rank, scenario.micro_batch_size, device)
    rows, flags = packed_global_batch(*args)
    # the same contiguous DP share as micro_batches (which also refuses an uneven split)
    micro_batches(rows, dp.size, dp.rank, scenario.micro_batch_size)
    per_rank = rows.shape[0] // dp.size
    mine = slice(dp.rank * per_rank, (dp.rank + 1) * per_rank)
    return packed_micro_batches(rows[mine], flags[mine], scenario.micro_batch_size, device)


def layout_worker(rank: int, world_size: int, runs: list[tuple[ParallelConfig, Scenario]]) -> dict:
    """Launched-world entry point: each (layout, scenario) pair in turn, all of world ``world_size``.

    Every rank reports the ranks of the process groups it built for the first layout; rank 0 also the
    :func:`run_scenario` results.
    """
    state = build_parallel_state(runs[0][0], rank)
    groups = {name: list(group.ranks) for name, group in state.groups.items()}
    results = [run_scenario(config, scenario, rank) for config, scenario in runs]
    return {"groups": groups, "results": results if rank == 0 else None}


def reference(config: ParallelConfig, scenario: Scenario) -> dict:
    """The single-process run of ``scenario`` (same dispatcher type and optimizer state dtypes as ``config``:
    what the layout computes, not how it is laid out)."""
    single = ParallelConfig(world_size=1, moe_token_dispatcher_type=config.moe_token_dispatcher_type,
                            **dict(zip(OPTIMIZER_DTYPE_FIELDS, config.optimizer_dtypes)))
    return run_scenario(single, replace(scenario, device="cpu"), 0)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[bool, float]:
    err = (a - b).abs()
    ok = bool((err <= atol + rtol * b.abs()).all())
    return ok, float((err / (b.abs() + atol)).max()) if err.numel() else 0.0


def compare(ref: dict, got: dict, rtol: float = 1e-4, atol: float = 1e-6) -> list[str]:
    """Differences between two :func:`run_scenario` results beyond |a-b| <= atol + rtol·|b|; empty when equal."""
    problems = []
    ok, err = _close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]), rtol, atol)
    if not ok:
        problems.append(f"loss {got['loss']} vs reference {ref['loss']}")
    if got["tokens_per_expert"] != ref["tokens_per_expert"]:
        problems.append(f"tokens per expert {got['tokens_per_expert']} vs {ref['tokens_per_expert']}")
    elif got["tokens_per_expert_by_layer"] != ref["tokens_per_expert_by_layer"]:
        problems.append(f"tokens per expert by layer {got['tokens_per_expert_by_layer']} vs "
                        f"{ref['tokens_per_expert_by_layer']}")
    for kind in ("grads", "params"):
        missing = set(ref[kind]) ^ set(got[kind])
        if missing:
            problems.append(f"{kind}: names differ: {sorted(missing)}")
        for name in sorted(set(ref[kind]) & set(got[kind])):
            a, b = got[kind][name], ref[kind][name]
            if a.shape != b.shape:
                problems.append(f"{kind} {name}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
                continue
            ok, err = _close(a, b, rtol, atol)
            if not ok:
                problems.append(f"{kind} {name}: max relative error {err:.2e}")
    return problems
