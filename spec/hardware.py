"""The hardware a layout runs on: GPU datasheet figures, a node/network profile, and the cluster size.

Bandwidths are bytes per second *per GPU per direction*; latencies are seconds; FLOP rates are dense
(no structured sparsity) FLOP/s. A :class:`HardwareProfile` starts from datasheet figures and may carry
measured efficiency curves (from ``foldtune calibrate``); the time model prefers measured curves.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field
from typing import Any

from spec._validate import positive_ints, raise_if, require
from spec.limits import CLUSTER_BOUNDS, bound_problems

GIB = 1024**3

# Host-side launch costs when no calibration measured them. Not datasheet figures (no vendor publishes
# one): rules of thumb for eager PyTorch on a current x86 server CPU driving a recent NVIDIA GPU —
# Python + dispatcher + cudaLaunchKernel per op, and a small NCCL collective's fixed host/protocol cost.
# ``foldtune calibrate`` measures both (executor/microbench/launch.py) and stores them in the profile.
DEFAULT_OP_LAUNCH_S = 8e-6
DEFAULT_COLLECTIVE_LAUNCH_S = 25e-6
# Host <-> GPU copies (optimizer and activation offload) when no calibration measured them. Datasheet: an
# H100/H200 SXM's host link is PCIe Gen5 x16, 64 GB/s raw per direction, about 55 GB/s effective for pinned
# copies. CPU Adam: bytes of fp32 optimizer state (master + two moments, 12 per element) stepped per second
# by torch's CPU ops; an assumption, deliberately conservative (a server CPU's eager elementwise ops pass the
# state through DRAM about eight times). ``foldtune calibrate`` measures both (executor/microbench/offload.py).
# Classes of memory-bound ops that calibration times one by one (executor/microbench/memory_bound.py) and the
# cost model prices each at its own measured bandwidth and seconds per kernel (costmodel.compute.memory_time):
# 'elementwise' (products, adds, casts: also every op of no other class), 'norm' (RMSNorm), 'activation'
# (SwiGLU), 'permute' (the dispatcher's gather of token rows).
MEMORY_OP_CLASSES = ("elementwise", "norm", "activation", "permute")
DEFAULT_HOST_LINK_BANDWIDTH = 55e9
DEFAULT_CPU_ADAM_BANDWIDTH = 2e9


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet figures of one accelerator. ``peak_flops`` maps a dtype ('bf16', 'fp8', ...) to FLOP/s."""

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s

    def __post_init__(self) -> None:
        if isinstance(self.peak_flops, dict):
            object.__setattr__(self, "peak_flops", tuple(sorted(self.peak_flops.items())))
        p: list[str] = []
        require(p, bool(self.peak_flops), "peak_flops must name at least one dtype")
        require(p, all(v > 0 for _, v in self.peak_flops), "every peak_flops value must be > 0")
        require(p, self.hbm_bytes > 0, f"hbm_bytes must be > 0, got {self.hbm_bytes}")
        require(p, self.hbm_bandwidth > 0, f"hbm_bandwidth must be > 0, got {self.hbm_bandwidth}")
        raise_if(p, f"GPU {self.name!r}")

    @property
    def supports_fp8(self) -> bool:
        """Whether the datasheet gives an fp8 peak (fp8 training is then a searchable precision)."""
        return "fp8" in dict(self.peak_flops)

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; fp16 falls back to bf16 and fp8 to bf16 on GPUs without fp8."""
        table = dict(self.peak_flops)
        for candidate in (dtype, "bf16" if dtype in ("fp16", "fp8") else dtype):
            if candidate in table:
                return table[candidate]
        return table.get("bf16", max(table.values()))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "peak_flops": dict(self.peak_flops), "hbm_bytes": self.hbm_bytes,
                "hbm_bandwidth": self.hbm_bandwidth}


@dataclass(frozen=True)
class MeasuredCurve:
    """A measured efficiency curve: ``points`` are (x, efficiency) with x ascending (FLOPs, bytes, ...).

    Evaluation interpolates linearly in log(x) and clamps at both ends, so a curve measured over a
    range of sizes answers for any size.
    """

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        pts = tuple(sorted((float(x), float(y)) for x, y in self.points))
        object.__setattr__(self, "points", pts)
        p: list[str] = []
        require(p, len(pts) >= 1, "a curve needs at least one point")
        require(p, all(math.isfinite(x) and math.isfinite(y) and x > 0 and y > 0 for x, y in pts),
                "curve points must be finite with x > 0 and efficiency > 0")
        raise_if(p, "measured curve")

    def __call__(self, x: float) -> float:
        pts = self.points
        if x <= pts[0][0]:
            return pts[0][1]
        if x >= pts[-1][0]:
            return pts[-1][1]
        i = bisect.bisect_right([p[0] for p in pts], x)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return y0 + t * (y1 - y0)


@dataclass(frozen=True)
class HardwareProfile:
    """One node type and its network: what the cost model prices FLOPs and bytes against.

    ``gemm_efficiency`` maps FLOPs of one GEMM to achieved/peak; ``gemm_bwd_efficiency`` maps a linear
    layer's forward FLOPs to achieved/peak of its two backward GEMMs; ``grouped_gemm_efficiency`` maps
    tokens per expert to achieved/peak (one expert shape); ``grouped_gemm_shape_efficiency`` holds such a curve
    per measured expert shape ('<hidden>x<expert ffn>'); ``collective_efficiency`` maps a collective name
    ('all_to_all', 'all_reduce', 'all_gather', 'reduce_scatter', 'p2p') plus a link scope
    ('intra'/'inter') to a curve of message bytes -> achieved/link bandwidth. All are optional: the
    time model falls back to datasheet peaks times default efficiencies. ``op_launch_s`` (seconds the
    host needs to issue one eager op) and ``collective_launch_s`` (seconds of one collective that moves
    almost no bytes) are measured by calibration; None means "not measured" and the time model uses
    :attr:`op_launch_seconds` / :attr:`collective_launch_seconds`, which fall back to the documented
    rules of thumb ``DEFAULT_OP_LAUNCH_S`` / ``DEFAULT_COLLECTIVE_LAUNCH_S``. ``moe_layer_host_s`` is the
    measured host time of one of this project's executor MoE layers on tiny shapes (forward + backward);
    the time model derives its seconds per executor op from it when present. ``overlap_slowdown`` is the
    measured fraction of an overlapped gradient collective's seconds that the compute beside it still
    pays (SMs and HBM bandwidth the collective takes); None means not measured, priced as 0 (perfect
    overlap). ``sustained_clock_factor`` is the measured ratio of a GEMM's throughput under seconds of
    back-to-back load to its throughput in a short burst (the card lowers its clock at its power limit); the
    time model scales the compute peaks by it, as the efficiency curves are timed in bursts. None means not
    measured, priced as 1. ``allocator_fragmentation`` is the measured share the PyTorch caching allocator
    reserves beyond its allocated peak over real training steps of a proxy (``reserved / allocated - 1``,
    ``foldtune calibrate`` on a GPU); the memory model adds it to the dynamic bytes. None means not measured:
    the memory model's prior (``costmodel.memory.FRAGMENTATION``). ``host_link_bandwidth`` (bytes/s per
    direction of a pinned host<->GPU copy) and ``cpu_adam_bandwidth`` (bytes of fp32 optimizer state the CPU
    Adam steps per second) price offloading; None means not measured: :attr:`host_link_bytes_per_s` and
    :attr:`cpu_adam_bytes_per_s` fall back to ``DEFAULT_HOST_LINK_BANDWIDTH`` (datasheet) and
    ``DEFAULT_CPU_ADAM_BANDWIDTH`` (assumption). ``cp_exchange_fixed_s`` (one CP K/V exchange: K and V
    all-gathered forward, their gradients reduce-scattered backward) and ``dispatcher_fixed_s`` (dispatcher
    name -> one MoE layer's dispatch + combine, forward + backward) are the seconds per call the executor's
    own code pays beyond what the bandwidth curves price; ``cp_chunk_floor_s`` is the least one CP chunk
    attention call takes, forward + backward, however few its FLOPs (the host issuing it: a short chunk's
    kernel waits for it). All three are measured by ``foldtune calibrate`` on two or more ranks
    (``executor/microbench/exchanges.py``); None (or a dispatcher left out) means not measured, priced by
    ``costmodel.fixed_costs``'s rules of thumb (the chunk floor: none). ``optimizer_seconds_per_param`` is the
    executor's optimizer step (torch's fused mixed-precision AdamW over fp32 main gradients, one GPU) in seconds
    per parameter, measured by ``foldtune calibrate``; None means not measured: the time model's byte count
    (``costmodel.step_time.OPTIMIZER_BYTES_PER_PARAM``) at the HBM rate. ``local_expert_host_s`` and
    ``expert_loop_host_s`` are host seconds one MoE layer adds per local expert per micro-batch (forward +
    backward): the executor's, and a runtime's that launches one GEMM per local expert per pass;
    ``moe_router_factor`` and ``moe_permute_factor`` scale the router's and the permutation's priced device
    seconds. All four are measured at real widths on one GPU (``bench/finegrained_moe.py``, loaded by ``foldtune
    calibrate finegrained``); None means not measured: the counts of ``costmodel/host.py`` at the per-op cost, and
    factor 1.
    """

    name: str
    gpu: GPUSpec
    gpus_per_node: int
    intra_node_bandwidth: float  # bytes/s per GPU per direction (NVLink)
    intra_node_latency: float  # seconds
    inter_node_bandwidth: float  # bytes/s per NIC per direction (IB/RoCE; one NIC per GPU unless nics_per_node)
    inter_node_latency: float  # seconds
    gemm_efficiency: MeasuredCurve | None = None
    # forward FLOPs of a GEMM shape -> achieved / peak of that linear's input- and weight-gradient GEMMs
    gemm_bwd_efficiency: MeasuredCurve | None = None
    grouped_gemm_efficiency: MeasuredCurve | None = None
    # '<hidden>x<expert ffn>' of a measured expert shape -> its curve of tokens per expert -> achieved / peak
    grouped_gemm_shape_efficiency: tuple[tuple[str, MeasuredCurve], ...] = ()
    # '<hidden>x<expert ffn>' -> tokens per expert -> the fp8 grouped GEMM's speed over bf16's at that shape
    # (torch's scaled grouped GEMM, operands quantised beforehand; `calibrate --precision fp8`)
    grouped_gemm_fp8_over_bf16: tuple[tuple[str, MeasuredCurve], ...] = ()
    # forward FLOPs of a dense linear -> bf16 seconds / the executor's fp8 seconds of its forward + backward,
    # quantisation included (`calibrate --precision fp8`)
    dense_fp8_over_bf16: MeasuredCurve | None = None
    # key length -> achieved / 16-bit peak of causal attention (time model's FLOPs), forward and backward
    attention_fwd_efficiency: MeasuredCurve | None = None
    attention_bwd_efficiency: MeasuredCurve | None = None
    # the same for attention whose query/key heads are wider than its value heads (MLA, 192/128): SDPA's flash
    # kernel takes one width only, so these run on another kernel (None: priced with the curves above)
    attention_mla_fwd_efficiency: MeasuredCurve | None = None
    attention_mla_bwd_efficiency: MeasuredCurve | None = None
    collective_efficiency: tuple[tuple[str, MeasuredCurve], ...] = ()
    hbm_efficiency: float | None = None  # measured copy bandwidth / datasheet
    # memory-bound op class (MEMORY_OP_CLASSES) -> curve of bytes per kernel (as the time model counts them) ->
    # achieved / datasheet bandwidth, fixed costs included (empty: not measured, priced from hbm_efficiency and
    # the time model's fixed kernel overhead)
    memory_bound_efficiency: tuple[tuple[str, MeasuredCurve], ...] = ()
    source: str = "datasheet"
    op_launch_s: float | None = None  # seconds per eager op launch, measured (None: not measured)
    collective_launch_s: float | None = None  # seconds per near-empty collective, measured
    moe_layer_host_s: float | None = None  # seconds of one executor MoE layer fwd+bwd on tiny shapes, measured
    # host seconds one activation-checkpoint region adds per micro-batch beyond re-running its forward (torch's
    # non-reentrant checkpoint: saving its inputs, packing and unpacking what the region saves, starting the
    # re-run in backward), measured on a tiny norm (executor/microbench/launch.py); None: not measured, not priced
    recompute_region_s: float | None = None
    # host seconds one MoE layer adds per LOCAL expert per micro-batch (fwd+bwd), measured at real widths by
    # bench/finegrained_moe.py (costmodel.calibrate.finegrained): the executor's grouped path, and a runtime that
    # launches one GEMM per local expert per pass (Transformer Engine's GroupedLinear on Hopper); None: not measured
    local_expert_host_s: float | None = None
    expert_loop_host_s: float | None = None
    # measured / priced device seconds of the MoE router (GEMM, scores, top-k, aux loss) and of the permutation
    # (permute, sort by expert, unpermute), at real widths (bench/finegrained_moe.py); None: priced as 1
    moe_router_factor: float | None = None
    moe_permute_factor: float | None = None
    overlap_slowdown: float | None = None  # fraction of hidden DP collective seconds still paid, measured
    sustained_clock_factor: float | None = None  # sustained / burst tensor-core throughput, measured
    allocator_fragmentation: float | None = None  # reserved / allocated - 1 at a proxy's peak, measured
    host_link_bandwidth: float | None = None  # bytes/s per direction, pinned host<->GPU copy, measured
    cpu_adam_bandwidth: float | None = None  # bytes of optimizer state per second of CPU Adam, measured
    # seconds per call beyond the bandwidth/FLOP price, fwd+bwd, measured on >= 2 ranks (None: not measured)
    cp_exchange_fixed_s: float | None = None  # one CP K/V exchange of an attention layer
    cp_chunk_floor_s: float | None = None  # least seconds of one CP chunk attention call (a floor, not added)
    dispatcher_fixed_s: tuple[tuple[str, float], ...] = ()  # dispatcher name -> one dispatch + combine
    optimizer_seconds_per_param: float | None = None  # the executor's optimizer step on one GPU, measured
    # CPU ranks only: the cores the node's ranks share, where calibration timed each rank's own work alone (in
    # turns); the time model then prices each layout's contention for them (costmodel.step_time.cpu_contention).
    # None: GPUs, or a CPU profile timed in lockstep (its rates already hold one level of contention)
    cpu_cores: int | None = None
    # the network between nodes, separate from NVLink: NICs per node (None: one per GPU, as DGX/HGX H100 with
    # ConnectX-7) and where its figures come from ('datasheet ...' until calibrate measures across nodes)
    nics_per_node: int | None = None
    network_source: str = "datasheet (not measured here)"
    # '<model name>@seq<S>' -> ((term, measured/predicted), ...): executor components timed at that shape
    component_factors: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()

    def __post_init__(self) -> None:
        for name in ("collective_efficiency", "grouped_gemm_shape_efficiency", "grouped_gemm_fp8_over_bf16",
                     "dispatcher_fixed_s", "memory_bound_efficiency"):
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, tuple(sorted(getattr(self, name).items())))
        if isinstance(self.component_factors, dict):  # kept as sorted tuples: the profile must stay hashable
            object.__setattr__(self, "component_factors", tuple(sorted(
                (str(k), tuple(sorted((str(t), float(f)) for t, f in dict(v).items())))
                for k, v in self.component_factors.items())))
        p: list[str] = []
        positive_ints(p, self, ("gpus_per_node",))
        for name in ("grouped_gemm_shape_efficiency", "grouped_gemm_fp8_over_bf16"):
            bad = [k for k, _ in getattr(self, name) if expert_shape(k) is None]
            require(p, not bad, f"{name} keys must read '<hidden>x<expert ffn>' with positive integers, got {bad}")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            require(p, getattr(self, name) > 0, f"{name} must be > 0 bytes/s, got {getattr(self, name)}")
        for name in ("intra_node_latency", "inter_node_latency"):
            require(p, getattr(self, name) >= 0, f"{name} must be >= 0 s, got {getattr(self, name)}")
        for name in ("op_launch_s", "collective_launch_s", "moe_layer_host_s", "host_link_bandwidth",
                     "cpu_adam_bandwidth", "optimizer_seconds_per_param", "moe_router_factor", "moe_permute_factor"):
            value = getattr(self, name)
            require(p, value is None or (math.isfinite(value) and value > 0),
                    f"{name} must be None or a finite number > 0, got {value}")
        fixed = [("cp_exchange_fixed_s", self.cp_exchange_fixed_s), ("cp_chunk_floor_s", self.cp_chunk_floor_s),
                 ("local_expert_host_s", self.local_expert_host_s), ("expert_loop_host_s", self.expert_loop_host_s),
                 ("recompute_region_s", self.recompute_region_s),
                 *((f"dispatcher_fixed_s[{k}]", v) for k, v in self.dispatcher_fixed_s)]
        for name, value in fixed:  # 0 is a measurement (nothing beyond the price); negative is not
            require(p, value is None or (math.isfinite(value) and value >= 0),
                    f"{name} must be None or a finite number >= 0 s, got {value}")
        unknown = [k for k, _ in self.memory_bound_efficiency if k not in MEMORY_OP_CLASSES]
        require(p, not unknown, f"memory_bound_efficiency keys must be memory-bound op classes "
                                f"({', '.join(MEMORY_OP_CLASSES)}), got {unknown}")
        require(p, self.overlap_slowdown is None or 0.0 <= self.overlap_slowdown <= 1.0,
                f"overlap_slowdown must be None or a fraction in [0, 1], got {self.overlap_slowdown}")
        require(p, self.sustained_clock_factor is None or 0.0 < self.sustained_clock_factor <= 1.0,
                f"sustained_clock_factor must be None or a fraction in (0, 1], got {self.sustained_clock_factor}")
        require(p, self.cpu_cores is None or (isinstance(self.cpu_cores, int) and self.cpu_cores >= 1),
                f"cpu_cores must be None or a positive integer, got {self.cpu_cores!r}")
        require(p, self.nics_per_node is None or (isinstance(self.nics_per_node, int) and self.nics_per_node >= 1),
                f"nics_per_node must be None or a positive integer, got {self.nics_per_node!r}")
        require(p, self.allocator_fragmentation is None or 0.0 <= self.allocator_fragmentation <= 1.0,
                f"allocator_fragmentation must be None or a fraction in [0, 1], got {self.allocator_fragmentation}")
        require(p, all(math.isfinite(f) and f > 0 for _, v in self.component_factors for _, f in v),
                "component_factors must be finite numbers > 0")
        raise_if(p, f"hardware profile {self.name!r}")

    def component_corrections(self, model_name: str, seq_length: int, micro_batch_size: int | None = None,
                              tokens_divisor: int = 1) -> dict[str, float] | None:
        """Term factors measured for ``model_name`` (``foldtune calibrate --model``): entries of that exact
        name, else (a proxy 'NAME@<n>L' or the full model) of any entry of the same base model; None when
        the profile has none for the model.

        With a micro-batch size, the entry whose tokens per micro-batch (seq x mbs) are nearest (log scale)
        to this rank's, ``seq_length x micro_batch_size / tokens_divisor`` (pass tp x cp: each rank's MoE
        block and elementwise work see that share), wins; ties go to the nearest sequence length, and keys
        without '@mbs<M>' come last. Without one, the nearest sequence length, preferring keys without a size.
        """
        if not self.component_factors:
            return None
        entries = [(*parse_component_key(k), dict(v)) for k, v in self.component_factors]
        base = model_name.split("@")[0]
        for same in (lambda n: n == model_name, lambda n: n.split("@")[0] == base):
            if micro_batch_size is None:
                hits = [(abs(seq - seq_length), _mbs_distance(mbs, None), -seq, f)
                        for n, seq, mbs, f in entries if same(n)]
            else:
                tokens = math.log2(seq_length * micro_batch_size / max(1, tokens_divisor))
                hits = [(abs(math.log2(seq * mbs) - tokens) if mbs else 1e9, abs(seq - seq_length), -seq, f)
                        for n, seq, mbs, f in entries if same(n)]
            if hits:
                return min(hits, key=lambda h: h[:3])[3]
        return None

    @property
    def nic_bandwidth_per_gpu(self) -> float:
        """Bytes/s per direction of network one GPU drives when every GPU of its node sends at once: the
        node's NICs (``nics_per_node``, else one per GPU) times ``inter_node_bandwidth`` over its GPUs."""
        nics = self.nics_per_node if self.nics_per_node is not None else self.gpus_per_node
        return self.inter_node_bandwidth * nics / self.gpus_per_node

    @property
    def op_launch_seconds(self) -> float:
        """Seconds the host needs to issue one eager op: measured, else ``DEFAULT_OP_LAUNCH_S``."""
        return self.op_launch_s if self.op_launch_s is not None else DEFAULT_OP_LAUNCH_S

    @property
    def collective_launch_seconds(self) -> float:
        """Seconds of one collective moving ~no bytes: measured, else ``DEFAULT_COLLECTIVE_LAUNCH_S``."""
        return self.collective_launch_s if self.collective_launch_s is not None else DEFAULT_COLLECTIVE_LAUNCH_S

    @property
    def host_link_bytes_per_s(self) -> float:
        """Bytes/s per direction of a pinned host<->GPU copy: measured, else ``DEFAULT_HOST_LINK_BANDWIDTH``."""
        return self.host_link_bandwidth if self.host_link_bandwidth is not None else DEFAULT_HOST_LINK_BANDWIDTH

    @property
    def cpu_adam_bytes_per_s(self) -> float:
        """Bytes of fp32 optimizer state the CPU Adam steps per second: measured, else ``DEFAULT_CPU_ADAM_BANDWIDTH``."""
        return self.cpu_adam_bandwidth if self.cpu_adam_bandwidth is not None else DEFAULT_CPU_ADAM_BANDWIDTH

    def collective_curve(self, collective: str, scope: str) -> MeasuredCurve | None:
        """The measured curve for ``collective`` over an 'intra' or 'inter' node link, if any."""
        return dict(self.collective_efficiency).get(f"{collective}:{scope}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "gpu": self.gpu.to_dict(), "gpus_per_node": self.gpus_per_node,
            "intra_node_bandwidth": self.intra_node_bandwidth, "intra_node_latency": self.intra_node_latency,
            "inter_node_bandwidth": self.inter_node_bandwidth, "inter_node_latency": self.inter_node_latency,
            "gemm_efficiency": list(self.gemm_efficiency.points) if self.gemm_efficiency else None,
            "gemm_bwd_efficiency": list(self.gemm_bwd_efficiency.points) if self.gemm_bwd_efficiency else None,
            "grouped_gemm_efficiency": (list(self.grouped_gemm_efficiency.points)
                                        if self.grouped_gemm_efficiency else None),
            **({"dense_fp8_over_bf16": list(self.dense_fp8_over_bf16.points)} if self.dense_fp8_over_bf16 else {}),
            "attention_fwd_efficiency": (list(self.attention_fwd_efficiency.points)
                                         if self.attention_fwd_efficiency else None),
            "attention_bwd_efficiency": (list(self.attention_bwd_efficiency.points)
                                         if self.attention_bwd_efficiency else None),
            **({"attention_mla_fwd_efficiency": list(self.attention_mla_fwd_efficiency.points),
                "attention_mla_bwd_efficiency": list(self.attention_mla_bwd_efficiency.points)}
               if self.attention_mla_fwd_efficiency and self.attention_mla_bwd_efficiency else {}),
            "collective_efficiency": {k: list(c.points) for k, c in self.collective_efficiency},
            **({"grouped_gemm_shape_efficiency": {k: list(c.points) for k, c in self.grouped_gemm_shape_efficiency}}
               if self.grouped_gemm_shape_efficiency else {}),
            **({"grouped_gemm_fp8_over_bf16": {k: list(c.points) for k, c in self.grouped_gemm_fp8_over_bf16}}
               if self.grouped_gemm_fp8_over_bf16 else {}),
            "hbm_efficiency": self.hbm_efficiency, "source": self.source,
            "op_launch_s": self.op_launch_s, "collective_launch_s": self.collective_launch_s,
            "moe_layer_host_s": self.moe_layer_host_s, "overlap_slowdown": self.overlap_slowdown,
            "sustained_clock_factor": self.sustained_clock_factor,
            **({"allocator_fragmentation": self.allocator_fragmentation}
               if self.allocator_fragmentation is not None else {}),
            **({"nics_per_node": self.nics_per_node} if self.nics_per_node is not None else {}),
            **({"cpu_cores": self.cpu_cores} if self.cpu_cores is not None else {}),
            **{k: getattr(self, k) for k in ("host_link_bandwidth", "cpu_adam_bandwidth", "cp_exchange_fixed_s",
                                             "cp_chunk_floor_s", "optimizer_seconds_per_param",
                                             "local_expert_host_s", "expert_loop_host_s", "moe_router_factor",
                                             "moe_permute_factor", "recompute_region_s")
               if getattr(self, k) is not None},
            **({"dispatcher_fixed_s": dict(self.dispatcher_fixed_s)} if self.dispatcher_fixed_s else {}),
            **({"memory_bound_efficiency": {k: list(c.points) for k, c in self.memory_bound_efficiency}}
               if self.memory_bound_efficiency else {}),
            "network_source": self.network_source,
            **({"component_factors": {k: dict(v) for k, v in self.component_factors}}
               if self.component_factors else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        d = dict(data)
        d["gpu"] = GPUSpec(**d["gpu"]) if isinstance(d["gpu"], dict) else d["gpu"]
        for key in ("gemm_efficiency", "gemm_bwd_efficiency", "grouped_gemm_efficiency", "attention_fwd_efficiency",
                    "attention_bwd_efficiency", "attention_mla_fwd_efficiency", "attention_mla_bwd_efficiency",
                    "dense_fp8_over_bf16"):
            if d.get(key) is not None and not isinstance(d[key], MeasuredCurve):
                d[key] = MeasuredCurve(tuple(tuple(pt) for pt in d[key]))
        if isinstance(d.get("dispatcher_fixed_s"), dict):
            d["dispatcher_fixed_s"] = tuple(sorted((str(k), float(v)) for k, v in d["dispatcher_fixed_s"].items()))
        for key in ("collective_efficiency", "grouped_gemm_shape_efficiency", "grouped_gemm_fp8_over_bf16",
                    "memory_bound_efficiency"):
            curves = d.get(key) or {}
            if isinstance(curves, dict):
                d[key] = tuple(sorted(
                    (k, v if isinstance(v, MeasuredCurve) else MeasuredCurve(tuple(tuple(pt) for pt in v)))
                    for k, v in curves.items()))
        return cls(**d)


def expert_shape(key: str) -> tuple[int, int] | None:
    """(hidden, expert FFN) of a ``grouped_gemm_shape_efficiency`` key such as '4096x14336'; None if malformed."""
    match = re.fullmatch(r"([0-9]+)x([0-9]+)", str(key))  # ASCII digits: str.isdigit() passes '²', int() fails
    if match is None or int(match[1]) <= 0 or int(match[2]) <= 0:
        return None
    return int(match[1]), int(match[2])


def component_key(model_name: str, seq_length: int, micro_batch_size: int | None = None) -> str:
    """The ``component_factors`` key of a model shape, e.g. 'mixtral-8x7b@2L@seq4096@mbs2'."""
    return f"{model_name}@seq{seq_length}" + (f"@mbs{micro_batch_size}" if micro_batch_size else "")


def parse_component_key(key: str) -> tuple[str, int, int | None]:
    """(model name, sequence length, micro-batch size or None) of a ``component_factors`` key."""
    name, _, rest = key.rpartition("@seq")
    seq, _, mbs = rest.partition("@mbs")
    return name, int(seq) if seq.isdigit() else 0, int(mbs) if mbs.isdigit() else None


def _mbs_distance(measured: int | None, wanted: int | None) -> float:
    if measured is None or wanted is None:
        return 0.0 if measured == wanted else 1e9  # an entry naming its size wins over one that does not
    return abs(math.log2(measured) - math.log2(wanted))


#: Bytes per GPU outside the PyTorch allocator (``ClusterSpec.hbm_reserved_bytes``): CUDA context, NCCL's buffers,
#: and with the EP overlap the copy-engine all-to-all's 256 MiB of symmetric inboxes
#: (executor/parallel/copy_engine_alltoall.py).
DEFAULT_HBM_RESERVED = int(1.5 * GIB)
#: Share of each GPU's memory the planner keeps free by default (``ClusterSpec.min_headroom``): the memory
#: model's own error (its bar: within 5 % of the measured peak) must not turn a planned layout into an OOM.
DEFAULT_MIN_HEADROOM = 0.05
#: A fractional ``min_headroom`` must stay below this (a larger one leaves nothing to plan with).
MAX_HEADROOM_FRACTION = 0.9


def headroom_bytes(min_headroom: float, hbm_bytes: int) -> int:
    """Bytes a ``min_headroom`` keeps free on a GPU of ``hbm_bytes``: a value below 1 is a fraction of the
    GPU's memory, 1 or more a byte count."""
    return int(min_headroom * hbm_bytes) if min_headroom < 1 else int(min_headroom)


def headroom_problem(min_headroom: float, hbm_bytes: int, reserved_bytes: int) -> str | None:
    """Why ``min_headroom`` cannot be kept on a GPU of ``hbm_bytes`` (``reserved_bytes`` already set aside),
    or None when it can."""
    if isinstance(min_headroom, bool) or not isinstance(min_headroom, (int, float)) or not min_headroom >= 0:
        return f"min_headroom must be a number >= 0 (a fraction below 1 or bytes), got {min_headroom!r}"
    if min_headroom < 1 and min_headroom > MAX_HEADROOM_FRACTION:
        return f"min_headroom as a fraction must be <= {MAX_HEADROOM_FRACTION}, got {min_headroom}"
    if min_headroom >= 1 and headroom_bytes(min_headroom, hbm_bytes) >= hbm_bytes - reserved_bytes:
        return (f"min_headroom of {int(min_headroom)} bytes leaves nothing of the "
                f"{hbm_bytes - reserved_bytes} bytes usable per GPU")
    return None


@dataclass(frozen=True)
class ClusterSpec:
    """``num_gpus`` GPUs of one hardware profile, filled node by node (rank r lives on node r // gpus_per_node).

    ``min_headroom``: memory per GPU the planner keeps free beyond ``hbm_reserved_bytes`` (a fraction of the
    GPU's memory below 1, else bytes; default :data:`DEFAULT_MIN_HEADROOM`): layouts whose predicted peak
    leaves less are pruned as not fitting.
    """

    hardware: HardwareProfile
    num_gpus: int
    hbm_reserved_bytes: int = field(default=DEFAULT_HBM_RESERVED)  # CUDA context, NCCL
    min_headroom: float = DEFAULT_MIN_HEADROOM

    def __post_init__(self) -> None:
        p: list[str] = []
        bound_problems(p, self, CLUSTER_BOUNDS)
        positive_ints(p, self, ("num_gpus",))
        problem = headroom_problem(self.min_headroom, self.gpu.hbm_bytes, self.hbm_reserved_bytes)
        if problem:
            p.append(problem)
        if not p and self.num_gpus > self.hardware.gpus_per_node:
            require(p, self.num_gpus % self.hardware.gpus_per_node == 0,
                    f"num_gpus ({self.num_gpus}) must be a multiple of gpus_per_node "
                    f"({self.hardware.gpus_per_node}) when it spans several nodes")
        raise_if(p, "cluster")

    @property
    def gpu(self) -> GPUSpec:
        return self.hardware.gpu

    @property
    def gpus_per_node(self) -> int:
        return min(self.hardware.gpus_per_node, self.num_gpus)

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.hardware.gpus_per_node)

    @property
    def min_headroom_bytes(self) -> int:
        """Bytes per GPU kept free by ``min_headroom``."""
        return headroom_bytes(self.min_headroom, self.gpu.hbm_bytes)

    @property
    def usable_hbm_bytes(self) -> int:
        """Bytes of device memory a training process may plan to use: the GPU's memory less what CUDA, NCCL
        and the allocator reserve and less the headroom kept free."""
        return self.gpu.hbm_bytes - self.hbm_reserved_bytes - self.min_headroom_bytes
