"""Tiny stand-in cost models for planner tests: simple closed forms with the monotone properties the
ranker relies on (memory grows with mbs and shrinks with recompute and the distributed optimizer; time
grows with recompute). They are test fixtures only; the planner's default path uses costmodel's models."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
RECOMPUTE_LEVEL = {("none", ()): 0, ("selective", ("core_attn",)): 1, ("selective", ("layernorm", "moe_act")): 2,
                   ("selective", ("core_attn", "moe_act", "layernorm")): 3,
                   ("selective", ("core_attn", "moe_act", "layernorm", "mla_up_proj")): 4, ("full", ()): 5}


@dataclass(frozen=True)
class FakeMemory:
    stage: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float = 0.0
    comm_buffers: float = 0.0
    allocator_overhead: float = 0.0
    details: tuple = ()

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits
                + self.comm_buffers + self.allocator_overhead)


@dataclass(frozen=True)
class FakeTime:
    step_time: float
    terms: tuple
    hidden: tuple = ()
    tokens_per_s_per_gpu: float = 1.0
    tflops_per_gpu: float = 1.0
    mfu: float = 0.5
    bottleneck: str = "compute"


def level(c) -> int:
    return RECOMPUTE_LEVEL[(c.recompute_granularity, tuple(c.recompute_modules))]


def fake_memory(model, training, cluster, c, *, weight_gib: float = 64.0, act_gib: float = 6.0) -> FakeMemory:
    """Weights split over tp·pp·ep; activations over tp·cp·pp, times mbs, shrunk by recompute."""
    weights = weight_gib * GIB / (c.tp * c.pp * c.ep * c.etp)
    optimizer = 6 * weights / (c.dp if c.use_distributed_optimizer else 1)
    acts = act_gib * GIB * c.micro_batch_size / (c.tp * c.cp) * (1.0, 0.7, 0.55, 0.4, 0.3, 0.1)[level(c)]
    if c.moe_token_dispatcher_type == "allgather":
        acts *= 1.5
    return FakeMemory(stage=0, weights=weights, grads=2 * weights, optimizer=optimizer, activations=acts)


def fake_time(model, training, cluster, c) -> FakeTime:
    """Compute over world, comm grows with tp/cp/ep, bubble (pp-1)/(vpp·m), recompute adds forward work."""
    m = c.num_micro_batches(training.global_batch_size)
    compute = 1.0 * (1 + 0.1 * level(c)) * (1 + 0.05 / c.micro_batch_size)
    comm = 0.02 * (c.tp - 1) + 0.03 * (c.cp - 1) + 0.01 * (c.ep - 1) + (0.05 if c.moe_token_dispatcher_type ==
                                                                         "allgather" else 0.0)
    bubble = compute * (c.pp - 1) / (c.vpp * m)
    opt = 0.01 if c.use_distributed_optimizer else 0.02
    step = compute + comm + bubble + opt
    terms = (("gemm", compute), ("ep_a2a", comm), ("pp_bubble", bubble), ("optimizer", opt))
    neck = max(terms, key=lambda kv: kv[1])[0]
    names = {"gemm": "compute", "ep_a2a": "all-to-all", "pp_bubble": "pp-bubble", "optimizer": "optimizer"}
    return FakeTime(step_time=step, terms=terms, bottleneck=names[neck])
