"""The executor's host-side op counts that costmodel/host.py prices: re-measured on CPU ranks and compared.

Every kernel-launching aten op (views and metadata queries excluded) and every ``c10d::`` collective the
executor dispatches in ``Trainer.forward_backward`` is counted with a ``TorchDispatchMode``; runs with 2
and 4 layers and with 1 and 2 micro-batches separate per layer, per micro-batch extras and per step.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from costmodel import host
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig

pytestmark = pytest.mark.slow

# ops that create no kernel: views of existing storage and metadata queries
NO_KERNEL = {"view", "_unsafe_view", "permute", "transpose", "t", "expand", "slice", "select", "split", "unsqueeze",
             "squeeze", "alias", "detach", "as_strided", "unbind", "split_with_sizes", "reshape", "view_as", "diagonal",
             "_reshape_alias", "narrow", "chunk", "lift_fresh", "unflatten", "flatten", "sym_size", "sym_stride",
             "sym_numel", "is_same_size", "_local_scalar_dense", "item", "dim", "size", "stride"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in NO_KERNEL:
            self.ops[f"{func.namespace}::{name}"] += 1
        return func(*args, **(kwargs or {}))


def _model(layers: int, variant: str):
    # small-moe's layer structure at a quarter of its widths: op counts do not depend on widths (one gradient
    # bucket and one vocabulary block either way), and the counted steps run several times faster
    spec = dataclasses.replace(get_model("small-moe").with_layers(layers), hidden_size=64, ffn_hidden_size=256,
                               moe_ffn_hidden_size=128, vocab_size=1024)
    if variant == "dense":
        spec = dataclasses.replace(spec, moe_layer_freq=tuple([0] * layers))
    elif variant == "shared":
        spec = dataclasses.replace(spec, moe_shared_expert_intermediate_size=128)
    return spec


def _worker(rank: int, world: int, cfg: dict, runs: list[tuple[int, int]], variant: str) -> list[tuple[int, int]]:
    """(ops, collectives) of the counted step of each (layers, micro-batches) of ``runs``, one after the other in
    this rank: each run builds its model, groups and trainer afresh, and counts its own second step, by which
    any lazy state of the process (the first run's included) exists."""
    return [_count(rank, world, cfg, layers, micro, variant) for layers, micro in runs]


def _count(rank: int, world: int, cfg: dict, layers: int, micro: int, variant: str) -> tuple[int, int]:
    from spec.training_spec import TrainingSpec
    from executor.data import global_batch, micro_batches
    from executor.model import MoEGPT
    from executor.options import ExecutorOptions
    from executor.parallel.groups import build_parallel_state
    from executor.train_step import Trainer

    spec = _model(layers, variant)
    config = ParallelConfig(world_size=world, **cfg)
    gbs = micro * config.micro_batch_size * (world // (config.tp * config.cp * config.pp))
    training = TrainingSpec(seq_length=64, global_batch_size=gbs, precision="bf16")
    state = build_parallel_state(config, rank)
    net = MoEGPT(spec, state, ExecutorOptions.for_training(training), 64, torch.device("cpu"), torch.bfloat16)
    trainer = Trainer(net)
    for step in range(2):  # the second step is counted (lazy state exists by then)
        batch = global_batch(spec.vocab_size, 64, gbs, 0, step)
        mbs = micro_batches(batch, state.dp.size, state.dp.rank, config.micro_batch_size, torch.device("cpu"))
        trainer.optimizer.zero_grad()
        with _Count() as counted:
            trainer.forward_backward(mbs)
    colls = sum(v for k, v in counted.ops.items() if k.startswith("c10d::"))
    return sum(counted.ops.values()) - colls, colls


def measure(world: int, cfg: dict, variant: str = "moe") -> dict[str, tuple[float, float]]:
    """Rank 0's (ops, collectives) per layer and per micro-batch extras of ``cfg`` (ParallelConfig fields)."""
    from executor.launch_local import launch

    # one launch for the three runs: a launch's fork, rendezvous and groups cost more than a counted step
    result = launch(_worker, world, (cfg, [(2, 1), (4, 1), (2, 2)], variant), backend="gloo", timeout_s=300,
                    start_method="fork")
    assert result.ok, result.failure_reason
    a, b, c = result.results[0]
    per_layer = tuple((y - x) / 2 for x, y in zip(a, b))
    extras = tuple((z - x) - 2 * p for x, z, p in zip(a, c, per_layer))
    return {"layer": per_layer, "extras": extras}


def predicted(world: int, cfg: dict, variant: str = "moe") -> dict[str, tuple[float, float]]:
    config = ParallelConfig(world_size=world, **cfg)
    layer = host.layer_host_ops(_model(4, variant), config, variant != "dense")
    if config.recompute_granularity == "full":
        layer = layer + host.full_recompute_ops(variant != "dense")
    extras = host.extras_host_ops(config, True, config.pp == 1)
    return {"layer": (layer.ops, layer.collectives), "extras": (extras.ops, extras.collectives)}


@pytest.mark.parametrize("world,cfg,variant", [
    (1, {}, "moe"), (1, {}, "dense"), (1, {}, "shared"),
    (2, {"tp": 2, "sequence_parallel": True}, "moe"), (2, {"ep": 2}, "moe"), (2, {"etp": 2}, "moe"),
    (2, {"cp": 2}, "moe"), (2, {"ep": 2, "moe_token_dispatcher_type": "allgather"}, "moe"),
    (2, {"cp": 2, "cp_comm_type": "p2p"}, "moe"), (4, {"cp": 4, "cp_comm_type": "p2p"}, "moe"),
    (2, {"cp": 2, "cp_comm_type": "a2a"}, "moe"),
    (4, {"cp": 4, "cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": (2, 2)}, "moe"),
    (2, {"recompute_granularity": "full"}, "moe"),
    (2, {"recompute_granularity": "selective", "recompute_modules": ("moe",)}, "moe"),
])
def test_host_op_counts_match_the_executor(world, cfg, variant):
    measured, model = measure(world, cfg, variant), predicted(world, cfg, variant)
    print(f"\n{variant} {cfg}: measured {measured}, model {model}")
    for part in ("layer", "extras"):
        (ops, colls), (p_ops, p_colls) = measured[part], model[part]
        assert p_ops == pytest.approx(ops, rel=0.10, abs=3), part
        assert p_colls == pytest.approx(colls, abs=1), part
