"""Measurement: what one profiled layout run yields (or why it failed). JSON-serialisable, stored in the DB."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from spec.failure import FailureKind


@dataclass
class Measurement:
    """Result of warm-up plus timed steps of one layout.

    Times are seconds (``step_time`` is the median of ``step_times``; ``phases`` are rank 0's median
    seconds per phase per step, tiling the step); throughput is per GPU; memory is the maximum over
    ranks in bytes (None on CPU); ``tokens_per_expert`` sums routed tokens over MoE layers and timed steps.
    """

    ok: bool
    failure_reason: str | None = None
    failure_kind: FailureKind | None = None  # None on success and in records written before this field existed
    model: str | None = None
    layout: str | None = None
    world_size: int | None = None
    device: str | None = None
    precision: str | None = None
    seq_length: int | None = None
    global_batch_size: int | None = None
    step_time: float | None = None
    step_times: list[float] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    # torch.cuda.memory_allocated once the model and optimizer are built (before the first step) and
    # after the first step (optimizer states, main grads, buckets materialised; activations freed);
    # max over ranks, None on CPU and in records written before these fields existed.
    static_allocated_bytes: int | None = None
    static_after_step_allocated_bytes: int | None = None
    tokens_per_expert: list[int] = field(default_factory=list)
    # every rank's median seconds per phase (rank order): ranks that wait in a collective for a slower peer
    # show it in that collective's phase; empty in records written before this field existed
    phases_by_rank: list[dict[str, float]] = field(default_factory=list)
    # every rank's memory (rank order, CUDA only): {'peak_allocated', 'peak_reserved', 'static_before_step',
    # 'static_after_step'} in bytes; the fields above keep the max over ranks, which hides the stage (a pipeline's
    # first and last stages hold different tensors) whose peak a memory error belongs to
    memory_by_rank: list[dict[str, int | None]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    pruned: bool = False  # the driver stopped the run early (fewer timed steps than asked)
    # per rank where it ran (the Ray launcher: {'node': Ray node id, 'ip': ..., 'gpus': [GPU ids]}); empty locally
    placement: list[dict[str, Any]] = field(default_factory=list)
    # unix seconds when the ranks began the run and when it ended (the Ray launcher): shows trials side by side
    run_window: list[float] = field(default_factory=list)
    # A trial's fixed cost (seconds): from the driver dispatching the run to the first timed step starting on
    # the last rank to reach it; ``startup_s`` is the part until every rank had the layout's process groups
    # (waiting for devices, processes, Ray actors, the default and the layout's groups), ``warmup_s`` the rest
    # (model build, warm-up steps: CUDA context, allocator and kernel first use). ``reused_ranks``: the trial
    # ran on ranks kept from an earlier trial (executor.rank_pool). None in records written before these
    # fields existed; the fixed cost also None for failed runs.
    fixed_cost_s: float | None = None
    startup_s: float | None = None
    warmup_s: float | None = None
    reused_ranks: bool | None = None
    # precision fp8: the routed experts' GEMM shapes by the path they ran, 'bf16' / 'fp8' / 'fp8 untimed'
    # (counts of shapes) and 'bf16_shapes' / 'fp8_shapes' (calls per shape, over ranks): with
    # ExecutorOptions.fp8_expert_gemm 'fastest' the shapes where bf16 timed faster ran bf16
    # (executor.kernels.fp8.expert_pick); None in other precisions and in records written before this field
    fp8_expert_gemms: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.failure_kind is not None:  # read back from JSON as its string value
            self.failure_kind = FailureKind(self.failure_kind)

    @classmethod
    def failed(cls, reason: str, kind: FailureKind = FailureKind.ERROR, **context: Any) -> Measurement:
        """A failed run: ``reason`` is the readable sentence, ``kind`` the word the search and storage use."""
        return cls(ok=False, failure_reason=reason, failure_kind=kind, **context)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["failure_kind"] = self.failure_kind.value if self.failure_kind is not None else None
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def summary(self) -> str:
        """A few human-readable lines."""
        if not self.ok:
            return f"FAILED {self.layout or ''} ({self.model}): {self.failure_reason}"
        gib = 2**30
        lines = [f"{self.model}  {self.layout}  world {self.world_size}  on {self.device} ({self.precision})",
                 f"step time {self.step_time * 1e3:.1f} ms (median of {len(self.step_times)})   "
                 f"{self.tokens_per_s_per_gpu:.0f} tokens/s/GPU   {self.tflops_per_gpu:.2f} TFLOP/s/GPU"
                 + (f"   MFU {self.mfu:.1%}" if self.mfu is not None else "")]
        if self.peak_allocated_bytes is not None:
            lines.append(f"peak memory {self.peak_allocated_bytes / gib:.2f} GiB allocated, "
                         f"{self.peak_reserved_bytes / gib:.2f} GiB reserved"
                         + (f"; static {self.static_allocated_bytes / gib:.2f} GiB before the first step, "
                            f"{self.static_after_step_allocated_bytes / gib:.2f} GiB after it"
                            if self.static_allocated_bytes is not None
                            and self.static_after_step_allocated_bytes is not None else ""))
        if self.fixed_cost_s is not None:
            lines.append(f"fixed cost {self.fixed_cost_s:.2f} s to the first timed step (start-up "
                         f"{self.startup_s:.2f} s, warm-up {self.warmup_s:.2f} s"
                         + ("; reused ranks)" if self.reused_ranks else ")"))
        if self.fp8_expert_gemms and self.fp8_expert_gemms.get("bf16"):
            paths = self.fp8_expert_gemms
            lines.append(f"fp8: {paths['bf16']} of {paths['bf16'] + paths['fp8']} GEMM shapes (experts, dense linears) ran in "
                         f"bf16 (timed faster): {'; '.join(paths['bf16_shapes'])}")
        if self.phases:
            total = sum(self.phases.values()) or 1.0
            parts = sorted(self.phases.items(), key=lambda kv: -kv[1])
            lines.append("phases: " + ", ".join(f"{k} {v * 1e3:.1f} ms ({v / total:.0%})" for k, v in parts))
        if self.tokens_per_expert:
            mean = sum(self.tokens_per_expert) / len(self.tokens_per_expert)
            lines.append(f"tokens per expert: max/mean {max(self.tokens_per_expert) / mean:.2f}" if mean else "")
        return "\n".join(line for line in lines if line)
