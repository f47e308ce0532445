"""The optimizer's fused AdamW kernel (torch's ``_fused_adamw_``) against the chain of in-place ops it replaced.

Both implement the same formula (decoupled weight decay, bias-corrected moments); they may differ only by
float rounding. Checked on the unsharded optimizer (one rank) and the distributed optimizer (two ranks, dense
units over DP 2 with the overlapped parameter gather), with weight decay on, in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from executor.data import global_batch, micro_batches
from executor.launch_local import launch
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.parallel.sharding import gather_model
from executor.train_step import Trainer

TINY = get_model("tiny-moe")
SEQ, GBS, STEPS = 16, 8, 4


def _train(label: str, world: int, rank: int, dtype: torch.dtype, fused: bool) -> dict:
    config = ParallelConfig.parse(label, world_size=world)
    state = build_parallel_state(config, rank)
    torch.manual_seed(0)
    model = MoEGPT(TINY, state, ExecutorOptions(), SEQ, dtype=dtype)
    trainer = Trainer(model, lr=1e-2, weight_decay=0.1, bucket_mb=0.01, eps=1e-6)
    trainer.optimizer.fused = fused
    losses = []
    for step in range(STEPS):
        micro = micro_batches(global_batch(TINY.vocab_size, SEQ, GBS, 0, step), state.dp.size, state.dp.rank, 1)
        losses.append(trainer.step(micro).loss)
    return {"loss": losses, "params": gather_model(model, state), "units": len(trainer.optimizer.units),
            "fused": trainer.optimizer.fused}


def _worker(rank, world, label, dtype):
    out = {fused: _train(label, world, rank, dtype, fused) for fused in (True, False)}
    return out if rank == 0 else None


@pytest.mark.parametrize("label,world,dtype", [
    ("dp1", 1, torch.float32),
    ("dp2 distopt=off", 2, torch.bfloat16),
    ("dp2", 2, torch.bfloat16),
], ids=["one_rank_fp32", "dp2_bf16_unsharded", "dp2_bf16_sharded_overlapped_gather"])
def test_fused_adamw_equals_the_op_chain(label, world, dtype):
    if not hasattr(torch, "_fused_adamw_"):
        pytest.skip("this torch has no _fused_adamw_")
    result = launch(_worker, world, (label, dtype), backend="gloo", timeout_s=240, start_method="fork")
    assert result.ok, result.failure_reason
    fused, chain = result.results[0][True], result.results[0][False]
    assert fused["fused"] and not chain["fused"]  # the kernel really ran on one side only
    assert fused["units"] > 1  # several units: the fused call takes lists
    assert fused["loss"] == pytest.approx(chain["loss"], rel=1e-5)
    assert set(fused["params"]) == set(chain["params"])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, expected in chain["params"].items():
        got = fused["params"][name].float()
        moved = (expected.float() - got).abs().max().item()
        assert moved <= tol * max(1.0, expected.float().abs().max().item()), (name, moved)


def test_fused_step_updates_like_the_formula():
    """One fused step against AdamW worked by hand on three numbers (lr 0.1, betas 0.9/0.95, wd 0.1, eps 0):
    m = 0.1 g, v = 0.05 g^2, m_hat = g, v_hat = g^2, so each weight moves by -lr·sign(g) after the decay."""
    if not hasattr(torch, "_fused_adamw_"):
        pytest.skip("this torch has no _fused_adamw_")
    w = torch.tensor([1.0, -2.0, 0.5])
    g = torch.tensor([0.3, -4.0, 2.0])
    m, v = torch.zeros(3), torch.zeros(3)
    torch._fused_adamw_([w], [g], [m], [v], [], [torch.tensor(1.0)], lr=0.1, beta1=0.9, beta2=0.95,
                        weight_decay=0.1, eps=0.0, amsgrad=False, maximize=False)
    expected = torch.tensor([1.0 * 0.99 - 0.1, -2.0 * 0.99 + 0.1, 0.5 * 0.99 - 0.1])
    assert torch.allclose(w, expected, atol=1e-6)
