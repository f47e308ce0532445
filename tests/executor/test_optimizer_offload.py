"""Optimizer CPU offload (executor/optimizer.py, ``offload_fraction``): the first ceil(F·n) optimizer elements
are stepped on the CPU, and training gives the same parameters as without offload (fp32 Adam either way)."""

from __future__ import annotations

import math

import pytest
import torch

from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from executor.data import global_batch, micro_batches
from executor import optimizer
from executor.launch_local import launch
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state, single_process_state
from executor.train.optim_state import load_local_state, local_state
from executor.train_step import Trainer

TINY = get_model("tiny-moe")
BUCKET_MB = 0.01  # many buckets: the offloaded prefix ends inside one of them
STEPS = 3


def _train(state, steps: int = STEPS, dp_rank: int = 0, dp: int = 1, device: str = "cpu") -> Trainer:
    torch.manual_seed(0)
    model = MoEGPT(TINY, state, ExecutorOptions(), 16, device, dtype=torch.bfloat16)
    trainer = Trainer(model, lr=1e-2, weight_decay=0.1, bucket_mb=BUCKET_MB)
    batch = global_batch(TINY.vocab_size, 16, 4, 0, 0)
    for _ in range(steps):
        trainer.step(micro_batches(batch, 2, dp_rank, dp, device))
    trainer.finish_param_gather()
    return trainer


def _params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in trainer.model.parameters()]


def _masters(trainer: Trainer) -> torch.Tensor:
    return torch.cat([u.state("master") for u in trainer.optimizer.units])


def test_offloaded_elements_are_the_first_ceil_fraction_of_the_shard():
    config = ParallelConfig(world_size=1, optimizer_cpu_offload_fraction=0.3)
    trainer = Trainer(MoEGPT(TINY, single_process_state(config), ExecutorOptions(), 16, dtype=torch.bfloat16),
                      bucket_mb=BUCKET_MB)
    units = trainer.optimizer.units
    n = sum(u.shard_numel for u in units)
    host = [u.host_numel for u in units]
    assert sum(host) == math.ceil(0.3 * n)
    # a prefix: whole units on the host, then at most one split unit, then none
    split = next(i for i, h in enumerate(host) if h < units[i].shard_numel)
    assert all(h == u.shard_numel for h, u in zip(host[:split], units[:split]))
    assert 0 < host[split] < units[split].shard_numel and not any(host[split + 1:])
    opt = trainer.optimizer
    assert opt.host_state_bytes() == 12 * sum(host)
    assert opt.state_bytes() + opt.host_state_bytes() == 12 * n
    assert all(u.host.master.device.type == "cpu" for u in opt._host_units)


@pytest.mark.slow  # the two-rank test beside it is the fast tier's
def test_offload_fractions_train_to_the_same_parameters_single_process(monkeypatch):
    monkeypatch.setattr(optimizer, "HOST_STEP_ELEMENTS", 777)  # the CPU step in many uneven blocks
    results = {}
    for fraction in (0.0, 0.5, 1.0):
        config = ParallelConfig(world_size=1, optimizer_cpu_offload_fraction=fraction)
        trainer = _train(single_process_state(config))
        results[fraction] = (_params(trainer), _masters(trainer))
    base_params, base_master = results[0.0]
    start = _params(_train(single_process_state(ParallelConfig(world_size=1)), steps=0))
    assert any(not torch.equal(a, b) for a, b in zip(base_params, start))  # training moved the weights
    for fraction in (0.5, 1.0):
        params, master = results[fraction]
        torch.testing.assert_close(master, base_master, rtol=1e-6, atol=1e-7)
        for a, b in zip(params, base_params):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpoint_state_round_trips_through_an_offloaded_optimizer():
    plain = _train(single_process_state(ParallelConfig(world_size=1)))
    saved = local_state(plain.optimizer, list(plain.model.parameters()))
    config = ParallelConfig(world_size=1, optimizer_cpu_offload_fraction=0.5)
    offloaded = _train(single_process_state(config), steps=0)
    params = list(offloaded.model.parameters())
    load_local_state(offloaded.optimizer, {q: saved[p] for p, q in zip(plain.model.parameters(), params)}, STEPS)
    back = local_state(offloaded.optimizer, params)
    for p, q in zip(plain.model.parameters(), params):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[p][key], back[q][key]), key


def _two_rank_worker(rank, world):
    out = {}
    for fraction in (0.0, 0.5, 1.0):
        for overlap in (True, False):
            config = ParallelConfig(world_size=2, ep=2, overlap_param_gather=overlap,
                                    optimizer_cpu_offload_fraction=fraction)  # dp 2 sharded, edp 1
            state = build_parallel_state(config, rank)
            trainer = _train(state, dp_rank=state["dp_cp"].rank, dp=state["dp_cp"].size)
            out[(fraction, overlap)] = (_params(trainer), trainer.optimizer.host_state_bytes())
    return out


def test_offload_fractions_train_to_the_same_parameters_with_the_distributed_optimizer_on_two_ranks():
    launched = launch(_two_rank_worker, 2, backend="gloo", timeout_s=600, start_method="fork")
    assert launched.ok, launched.failure_reason
    for result in launched.results:
        for overlap in (True, False):
            base, none = result[(0.0, overlap)]
            assert none == 0
            for fraction in (0.5, 1.0):
                params, host = result[(fraction, overlap)]
                assert host > 0
                for a, b in zip(params, base):
                    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: pinned buffers, copies each way")
def test_cuda_offload_trains_to_the_same_parameters():
    base = _train(single_process_state(ParallelConfig(world_size=1)), device="cuda")
    for fraction in (0.5, 1.0):
        trainer = _train(single_process_state(ParallelConfig(world_size=1, optimizer_cpu_offload_fraction=fraction)),
                         device="cuda")
        assert all(u.host.grad.is_pinned() and u.host.out.is_pinned() for u in trainer.optimizer._host_units)
        # fp32 Adam on the CPU against the GPU's: equal up to the last bits of sqrt and division
        torch.testing.assert_close(_masters(trainer), _masters(base), rtol=1e-5, atol=1e-6)
        for a, b in zip(_params(trainer), _params(base)):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
