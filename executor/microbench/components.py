"""Component calibration: the executor's own building blocks timed at a model's real shapes on one device.

The machine-level microbenchmarks (GEMM, grouped GEMM, HBM copy, collectives) price idealised kernels: a
balanced, pre-permuted grouped GEMM, one plain GEMM. The executor's layers do more (uneven routing from a
real router, permutation, SwiGLU, norms, rope, the fp32 loss, gradient hooks into fp32 main grads), so
the cost model under-predicts them. This module times forward + backward of each block, built from the
executor's real modules (:class:`executor.model.DecoderLayer`, the LM head + vocab-parallel cross-entropy,
:class:`executor.optimizer.MixedPrecisionAdam`) on a world-size-1 layout (TP = EP = 1), and turns the
ratio measured / predicted into one correction factor per cost-model term.

Components and the cost-model parts they are compared with (``costmodel.step_time.layer_times`` on a
1-GPU layout of the same micro-batch):

* ``attention``: input RMSNorm + Q/K/V + rope + causal SDPA + output projection + residual add
  -> part 'attention' (terms gemm, attention_core, memory_bound).
* ``moe``: pre-MLP RMSNorm + router (real, random-init routing) + permute + grouped SwiGLU experts +
  combine (+ shared experts) + residual add -> part 'moe' (grouped_gemm, memory_bound, gemm).
* ``dense_mlp`` (models with dense layers only): pre-MLP RMSNorm + SwiGLU MLP + residual -> 'dense_mlp'.
* ``head``: final RMSNorm + LM head GEMM + cross-entropy -> part 'head' (gemm, memory_bound).
* ``optimizer``: one ``MixedPrecisionAdam.step`` over a bf16/fp32 parameter buffer of known size, in
  seconds per parameter -> the time model's optimizer seconds per parameter.

Factor mapping (:func:`term_factors`): each component's ratio r_c = measured_c / predicted_c is spread
over the terms the component's prediction contains, weighted by the term's predicted seconds in that
component times how often the component occurs in the model (attention per layer, moe per MoE layer,
dense_mlp per dense layer, head once): ``f_t = sum_c n_c r_c p_ct / sum_c n_c p_ct``. With these factors
the corrected prediction of one pass through the whole model on one GPU equals the measured sum of its
components exactly; a term that only one component predicts (grouped_gemm, attention_core) takes that
component's ratio. ``optimizer`` is measured / predicted seconds per parameter. Factors are measured
device times at real shapes, never fitted to end-to-end step times.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from costmodel.hardware import ClusterSpec, HardwareProfile, component_key
from costmodel.model_spec import ModelSpec

# term groups a component factor may scale (costmodel.step_time.TERMS names)
FACTOR_TERMS = ("gemm", "grouped_gemm", "attention_core", "memory_bound", "optimizer")
# parameters in the optimizer benchmark's buffer: large enough that per-kernel overhead is < 1 % on a GPU,
# small enough for a few GiB of fp32 state
OPTIMIZER_PARAMS_GPU = 1 << 27
OPTIMIZER_PARAMS_CPU = 1 << 16
WARMUP = 2
REPEATS = 5
PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class ComponentTime:
    """One component: measured and predicted seconds (forward + backward of one micro-batch, or for
    'optimizer' seconds per parameter), and the predicted seconds per cost-model term."""

    name: str
    measured_s: float
    predicted_s: float
    predicted_terms: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s


@dataclass(frozen=True)
class ComponentReport:
    """What :func:`run_components` measured on one model shape, and the per-term factors it implies."""

    model: str
    seq_length: int
    micro_batch_size: int
    precision: str
    device: str
    components: tuple[ComponentTime, ...]
    counts: dict[str, int]  # occurrences of each component in one pass through the model
    factors: dict[str, float]  # term -> measured / predicted

    @property
    def key(self) -> str:
        return component_key(self.model, self.seq_length, self.micro_batch_size)

    def to_dict(self) -> dict:
        return {**asdict(self), "key": self.key}


# ---- timing ---------------------------------------------------------------------------------------
def time_device(op: Callable[[], object], device: torch.device, warmup: int = WARMUP,
                repeats: int = REPEATS) -> float:
    """Median seconds of ``op()`` over ``repeats`` runs after ``warmup``: CUDA events on a GPU, wall clock
    (``op`` is synchronous there) on the CPU."""
    for _ in range(warmup):
        op()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            op()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# ---- the executor's blocks ------------------------------------------------------------------------
def _blocks(spec: ModelSpec, seq_length: int, mbs: int, device: torch.device, dtype: torch.dtype, options):
    """{component name: fwd+bwd closure} built from the executor's modules on a world-size-1 layout."""
    import torch.nn.functional as F

    from costmodel.parallel_config import ParallelConfig
    from executor.attention import rope_tables
    from executor.kernels import get_backend
    from executor.model import DecoderLayer
    from executor.optimizer import attach_main_grads
    from executor.parallel.groups import single_process_state
    from executor.parallel.sharding import ShardInfo, make_param
    from executor.parallel.vocab import cross_entropy
    from executor.timing import NULL_TIMER

    state = single_process_state(ParallelConfig(world_size=1, micro_batch_size=mbs))
    kernels = get_backend(options.kernel_backend)
    h = spec.hidden_size
    pattern = spec.moe_layer_pattern()
    cos, sin = rope_tables(seq_length, spec.head_dim, options.rotary_base, device)
    gen = torch.Generator(device="cpu").manual_seed(options.seed)

    def activations():  # [s, b, h] like a layer's input, and an output gradient of the same scale
        x = (torch.randn(seq_length, mbs, h, generator=gen) * 0.5).to(device=device, dtype=dtype)
        g = (torch.randn(seq_length, mbs, h, generator=gen) * 1e-3).to(device=device, dtype=dtype)
        return x.requires_grad_(True), g

    def layer(moe: bool) -> DecoderLayer:
        built = DecoderLayer(spec, options, state, pattern.index(moe), moe, kernels, device, dtype, NULL_TIMER)
        attach_main_grads(list(built.parameters()))  # the executor's fp32 gradient hooks are part of the cost
        return built

    blocks: dict[str, Callable[[], None]] = {}
    first = layer(bool(pattern[0]))
    x_attn, g_attn = activations()

    def attention():
        out = x_attn + first.attention(x_attn, (cos, sin))
        out.backward(g_attn)
        x_attn.grad = None
    blocks["attention"] = attention

    def mlp_block(built: DecoderLayer, name: str):
        x, g = activations()

        def run():
            hidden = kernels.rms_norm(x, built.mlp_norm, options.norm_epsilon)
            if built.is_moe:
                y, router_loss = built.mlp(hidden)
                outs, grads = [x + y], [g]
                if router_loss.requires_grad:  # only with aux/z losses on (ExecutorOptions)
                    outs.append(router_loss)
                    grads.append(torch.ones_like(router_loss))
                torch.autograd.backward(outs, grads)
            else:
                (x + built.mlp(hidden)).backward(g)
            x.grad = None
        blocks[name] = run

    if any(pattern):
        mlp_block(first if pattern[0] else layer(True), "moe")
    if not all(pattern):
        mlp_block(first if not pattern[0] else layer(False), "dense_mlp")

    padded = spec.padded_vocab_size(1)
    norm = make_param(ShardInfo("final_norm.weight", (h,), tp_partial=True), state, "ones", 0.0, options.seed,
                      device, dtype)
    head = make_param(ShardInfo("lm_head.weight", (padded, h), tp_dim=0, rows=spec.vocab_size), state, "normal",
                      options.init_method_std, options.seed, device, dtype)
    attach_main_grads([norm, head])
    x_head, _ = activations()
    labels = torch.randint(0, spec.vocab_size, (seq_length, mbs), generator=gen).to(device)

    def lm_head():
        logits = F.linear(kernels.rms_norm(x_head, norm, options.norm_epsilon), head)
        cross_entropy(logits, labels, spec.vocab_size, padded, state).mean().backward()
        x_head.grad = None
    blocks["head"] = lm_head
    return blocks


def measure_optimizer(device: torch.device, dtype: torch.dtype, num_params: int, seed: int = 0) -> float:
    """Seconds per parameter of one ``MixedPrecisionAdam.step`` (unsharded, world size 1) over a buffer of
    ``num_params`` parameters of ``dtype`` with fp32 main gradients (the executor's recipe)."""
    from executor.optimizer import MixedPrecisionAdam, attach_main_grads
    from executor.parallel.grad_reduce import GradReducer
    from executor.parallel.groups import single_process_state
    from executor.parallel.sharding import ShardInfo, make_param

    state = single_process_state()
    module = torch.nn.Module()
    # four tensors, as the executor's units flatten several parameters per bucket
    quarter = max(1, num_params // 4)
    for i in range(4):
        module.register_parameter(f"p{i}", make_param(ShardInfo(f"buffer.{i}", (quarter,)), state, "normal", 0.02,
                                                      seed, device, dtype))
    params = list(module.parameters())
    attach_main_grads(params)
    for p in params:  # a gradient the step reads (main_grad for 16-bit parameters, .grad for fp32 ones)
        grad = torch.full_like(p, 1e-3, dtype=torch.float32)
        if hasattr(p, "main_grad"):
            p.main_grad.copy_(grad)
        else:
            p.grad = grad.to(p.dtype)
    optimizer = MixedPrecisionAdam(params, GradReducer(module, state))
    return time_device(optimizer.step, device) / (4 * quarter)


# ---- predictions and factors ----------------------------------------------------------------------
def predicted_parts(spec: ModelSpec, seq_length: int, mbs: int, precision: str,
                    hardware: HardwareProfile) -> tuple[dict[str, dict[str, float]], float]:
    """({part: {term: seconds fwd+bwd}} of one micro-batch on one GPU, optimizer seconds per parameter)."""
    from costmodel.compute import compute_rates
    from costmodel.parallel_config import ParallelConfig
    from costmodel.step_time import OPTIMIZER_BYTES_PER_PARAM, layer_times
    from costmodel.training_spec import TrainingSpec

    training = TrainingSpec(seq_length=seq_length, global_batch_size=mbs, precision=precision)
    parts = layer_times(spec, training, ClusterSpec(hardware, 1), ParallelConfig(world_size=1, micro_batch_size=mbs))
    out = {}
    for name, part in parts.items():
        bwd = dict(part.bwd)
        out[name] = {t: v + bwd[t] for t, v in part.fwd if v + bwd[t] > 0}
    per_param = OPTIMIZER_BYTES_PER_PARAM / compute_rates(hardware, precision).hbm_bandwidth
    return out, per_param


def term_factors(components: tuple[ComponentTime, ...] | list[ComponentTime], counts: dict[str, int]) -> dict[str, float]:
    """Per-term factors: each component's ratio spread over its predicted terms (module docstring)."""
    weighted: dict[str, float] = {}
    predicted: dict[str, float] = {}
    for c in components:
        n = counts.get(c.name, 1)
        for term, seconds in c.predicted_terms.items():
            weighted[term] = weighted.get(term, 0.0) + n * c.ratio * seconds
            predicted[term] = predicted.get(term, 0.0) + n * seconds
    return {t: weighted[t] / predicted[t] for t in FACTOR_TERMS if predicted.get(t, 0.0) > 0.0}


def run_components(spec: ModelSpec, seq_length: int, micro_batch_size: int, precision: str,
                   hardware: HardwareProfile, device: torch.device | str, options=None,
                   optimizer_params: int | None = None) -> ComponentReport:
    """Time every component of ``spec`` at (``seq_length``, ``micro_batch_size``) on ``device`` and compare
    it with the cost model's prediction on ``hardware`` (the profile the factors will be stored in)."""
    from executor.options import ExecutorOptions, check_model_supported

    check_model_supported(spec)
    device = torch.device(device)
    dtype = PRECISION_DTYPES[precision]
    options = options or ExecutorOptions()
    parts, per_param = predicted_parts(spec, seq_length, micro_batch_size, precision, hardware)
    pattern = spec.moe_layer_pattern()
    counts = {"attention": spec.num_layers, "moe": sum(map(bool, pattern)),
              "dense_mlp": sum(1 for p in pattern if not p), "head": 1, "optimizer": 1}
    components = []
    blocks = _blocks(spec, seq_length, micro_batch_size, device, dtype, options)
    for name, op in blocks.items():
        measured = time_device(op, device)
        components.append(ComponentTime(name, measured, sum(parts[name].values()), parts[name]))
    del blocks
    if device.type == "cuda":
        torch.cuda.empty_cache()
    n = optimizer_params or (OPTIMIZER_PARAMS_GPU if device.type == "cuda" else OPTIMIZER_PARAMS_CPU)
    components.append(ComponentTime("optimizer", measure_optimizer(device, dtype, n), per_param,
                                    {"optimizer": per_param}))
    for c in components:
        if not (math.isfinite(c.measured_s) and c.measured_s > 0 and c.predicted_s > 0):
            raise RuntimeError(f"component {c.name}: measured {c.measured_s} s, predicted {c.predicted_s} s")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return ComponentReport(spec.name, seq_length, micro_batch_size, precision, name, tuple(components), counts,
                           term_factors(components, counts))
