"""Component calibration: the executor's own building blocks timed at a model's real shapes on one device.

The machine-level microbenchmarks (GEMM, grouped GEMM, HBM copy, collectives) price idealised kernels: a
balanced, pre-permuted grouped GEMM, one plain GEMM. The executor's layers do more (uneven routing from a
real router, permutation, SwiGLU, norms, rope, the fp32 loss, gradient hooks into fp32 main grads), so
the cost model under-predicts them. This module times forward + backward of each block, built from the
executor's real modules (:class:`executor.model.DecoderLayer`, the LM head + vocab-parallel cross-entropy,
:class:`executor.optimizer.MixedPrecisionAdam`) on a world-size-1 layout (TP = EP = 1), for
:mod:`costmodel.calibrate.component_factors` to compare with the cost model.

Components and the cost-model parts they are compared with (``costmodel.step_time.layer_times`` on a
1-GPU layout of the same micro-batch):

* ``attention``: input RMSNorm + Q/K/V + rope + causal SDPA + output projection + residual add
  -> part 'attention' (terms gemm, attention_core, memory_bound).
* ``moe``: pre-MLP RMSNorm + router (real, random-init routing) + permute + grouped SwiGLU experts +
  combine (+ shared experts) + residual add -> part 'moe' (grouped_gemm, memory_bound, gemm).
* ``dense_mlp`` (models with dense layers only): pre-MLP RMSNorm + SwiGLU MLP + residual -> 'dense_mlp'.
* ``head``: final RMSNorm + LM head GEMM + cross-entropy, fused or not as ``options.cross_entropy_chunk_logits``
  says (the executor's path) -> part 'head' (gemm, memory_bound).
* ``optimizer``: one ``MixedPrecisionAdam.step`` over a bf16/fp32 parameter buffer of known size, in
  seconds per parameter -> the time model's optimizer seconds per parameter.

The measured seconds go to :func:`costmodel.calibrate.component_factors.build_report`, which compares them with the
cost model's prediction of the same work and turns the ratios into per-term factors; this module only
measures (device times at real shapes, never end-to-end step times).

Timing: each block is issued COMPONENT_CALLS times back to back per window and its device time is taken with the
host ahead of the GPU (:func:`executor.microbench.timing.time_host_ahead`), as in a step, where the host queues
the next block while the GPU runs the current one; the host's issue time is priced separately by the time model
(costmodel/host.py). The optimizer is torch's fused AdamW over 2^27 parameters: milliseconds of memory-bound device
work against tens of microseconds of issue, so CUDA events around one call (:func:`time_device`) are device time
already and the sleep would change nothing.
:func:`measure_components` says per component which method gave its number.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.attention import rope_tables
from executor.kernels import get_backend
from executor.microbench.timing import EVENTS_ONE_CALL, WALL_CLOCK, time_device, time_host_ahead
from executor.model import DecoderLayer
from executor.optimizer import MixedPrecisionAdam, attach_main_grads
from executor.options import ExecutorOptions, check_model_supported
from executor.parallel.grad_reduce import GradReducer
from executor.parallel.groups import single_process_state
from executor.parallel.sharding import ShardInfo, make_param
from executor.parallel.vocab import output_cross_entropy
from executor.timing import NULL_TIMER
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig

# parameters in the optimizer benchmark's buffer: large enough that per-kernel overhead is < 1 % on a GPU,
# small enough for a few GiB of fp32 state
# calls of a block issued back to back per timed window (as a step runs them); fewer where the launch queue is
# too short for 8 (time_host_ahead halves the window and says so)
COMPONENT_CALLS = 8
OPTIMIZER_PARAMS_GPU = 1 << 27
OPTIMIZER_PARAMS_CPU = 1 << 16
PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---- the executor's blocks ------------------------------------------------------------------------
def _blocks(spec: ModelSpec, seq_length: int, mbs: int, device: torch.device, dtype: torch.dtype, options):
    """{component name: fwd+bwd closure} built from the executor's modules on a world-size-1 layout."""
    state = single_process_state(ParallelConfig(world_size=1, micro_batch_size=mbs))
    kernels = get_backend(options.kernel_backend)
    h = spec.hidden_size
    pattern = spec.moe_layer_pattern()
    cos, sin = rope_tables(seq_length, spec.rotary_head_dim, options.rotary_base, device)
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
        x = kernels.rms_norm(x_head, norm, options.norm_epsilon)
        output_cross_entropy(x, head, labels, spec.vocab_size, padded, state,
                             options.cross_entropy_chunk_logits,
                             options.cross_entropy_keep_logits).mean().backward()
        x_head.grad = None
    blocks["head"] = lm_head
    return blocks


def measure_optimizer(device: torch.device, dtype: torch.dtype, num_params: int, seed: int = 0) -> float:
    """Seconds per parameter of one ``MixedPrecisionAdam.step`` (unsharded, world size 1) over a buffer of
    ``num_params`` parameters of ``dtype`` with fp32 main gradients (the executor's recipe)."""
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


# ---- all components -----------------------------------------------------------------------------
def measure_components(spec: ModelSpec, seq_length: int, micro_batch_size: int, precision: str,
                       device: torch.device | str, options=None,
                       optimizer_params: int | None = None) -> tuple[str, dict[str, float], dict[str, str]]:
    """(device name, {component: seconds}, {component: timing method}) for every component of ``spec`` at
    (``seq_length``, ``micro_batch_size``) on ``device``: fwd+bwd of one micro-batch, 'optimizer' in seconds per
    parameter; the methods are the strings of :mod:`executor.microbench.timing` (e.g. 'device time, host ahead')."""
    check_model_supported(spec)
    device = torch.device(device)
    dtype = PRECISION_DTYPES[precision]
    options = options or ExecutorOptions()
    measured, methods = {}, {}
    blocks = _blocks(spec, seq_length, micro_batch_size, device, dtype, options)
    for name, op in blocks.items():
        # device time with the host ahead: wall clock around a window of MLA's many small kernels measured the
        # host (3.17 ms against 1.45 priced on an H200), and those factors over-priced 1-GPU steps by
        # layers x micro-batches x the excess (docs/benchmarks.md)
        measured[name], methods[name] = time_host_ahead(op, device, calls=COMPONENT_CALLS)
    del blocks
    if device.type == "cuda":
        torch.cuda.empty_cache()
    n = optimizer_params or (OPTIMIZER_PARAMS_GPU if device.type == "cuda" else OPTIMIZER_PARAMS_CPU)
    measured["optimizer"] = measure_optimizer(device, dtype, n)
    methods["optimizer"] = EVENTS_ONE_CALL if device.type == "cuda" else WALL_CLOCK
    return (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"), measured, methods
