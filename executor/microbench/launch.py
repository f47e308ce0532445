"""Host-side overhead: seconds per eager PyTorch op launch and per small collective.

A layer of a small model (hidden a few hundred) runs hundreds of tiny kernels per micro-batch whose
device time is negligible; the step is then bounded by how fast the host issues them (Python, the
dispatcher, the CUDA launch path). These benchmarks measure that rate directly:

* ``op_launch_s``: wall seconds of one eager op on a 1-element tensor, from a loop of N such ops ended
  by one synchronisation. The device finishes each tiny kernel faster than the host queues the next,
  so the loop measures the host's issue rate (dispatch + launch), not device time.
* ``collective_launch_s``: wall seconds of one all-reduce of a 1-element tensor over the whole world,
  from a loop of N ended by one synchronisation: the fixed host + protocol cost of a collective that
  moves no meaningful bytes (None with a single rank).
* ``moe_layer_host_s``: wall seconds of one MoE decoder layer of this project's executor, forward + backward of one
  micro-batch on one rank (small-moe's layer shape: hidden 256, 8 experts, top-2; 32 tokens, so the device work is
  negligible): half the difference between a 3-layer and a 1-layer model's ``Trainer.forward_backward``. On CPU
  ranks the host is the device: small-moe's GEMMs there cost more than its Python (docs/time-model.md, ``t_op``), so
  the probe runs tiny-moe's layer, the same ops at a quarter of the width. It prices the executor's own Python
  between ops (modules, autograd Functions, gradient hooks), which a loop of bare ops does not see;
  ``costmodel/host.py`` divides it by the layer's counted ops to get seconds per executor op. The layer is the
  median over adjacent (3-layer, 1-layer) pairs of their difference: a spike of other work lengthens one pair, not
  the median. CPU ranks time it in turns, each with the cores to itself (``timing.in_turns``): how many ranks
  share the cores in training depends on the layout, and the cost model prices that contention
  (``costmodel.step_time.cpu_contention``).
* ``recompute_region_s``: the seconds one activation-checkpoint region adds per micro-batch beyond re-running its
  forward: the executor's RMSNorm on a tiny-moe activation, forward + backward, under torch's non-reentrant
  checkpoint, minus the same without it, minus its forward once more (the re-run the cost model prices from the
  module's own forward). It is host work (saving the inputs, packing and unpacking what the region saves,
  starting the re-run during backward), paid per region whatever the region holds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from executor.data import global_batch, micro_batches
from executor.kernels import get_backend
from executor.kernels.triton_rms_norm import pick_rms_norm
from executor.microbench.timing import lockstep, one_rank_at_a_time, start_together, synchronize, time_op
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.train_step import Trainer
from spec.catalog import get_model

# Loop lengths: long enough that the final synchronisation (~10-50 us) is under 1 % of the loop and
# a 5-10 us launch cost is resolved; short enough for well under a second per benchmark on a GPU.
OPS_PER_LOOP = 2000
COLLECTIVES_PER_LOOP = 200
CPU_COLLECTIVES_PER_LOOP = 20  # gloo on shared CPU cores: each call costs tens of microseconds or more


def measure_op_launch(device: torch.device, ops: int = OPS_PER_LOOP, repeats: int = 3) -> float:
    """Seconds per eager op launch (median of ``repeats`` loops of ``ops`` in-place adds on one element)."""
    x = torch.zeros(1, device=device, dtype=torch.float32)
    return time_op(lambda: x.add_(1.0), device, iters=ops, repeats=repeats, warmup=max(2, ops // 100))


def measure_collective_launch(device: torch.device, calls: int | None = None, repeats: int = 3) -> float | None:
    """Seconds per all-reduce of one element over the default group; None without a multi-rank group.

    Every rank must call this (the ranks agree on ``calls``); take the max over ranks.
    """
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    calls = calls or (COLLECTIVES_PER_LOOP if device.type == "cuda" else CPU_COLLECTIVES_PER_LOOP)
    x = torch.zeros(1, device=device, dtype=torch.float32)
    dist.barrier()
    with lockstep(device.type != "cuda"):  # a collective's ranks call it together, never in turns
        seconds = time_op(lambda: dist.all_reduce(x), device, iters=calls, repeats=repeats, warmup=3)
    dist.barrier()
    return seconds


LAYER_TOKENS = 32
LAYER_REPEATS = 5  # timed forward-backward passes per model (after two warm-up passes)
# CPU passes take milliseconds and the cores are shared: more passes, taken in turns (below)
CPU_LAYER_REPEATS = 15
# the probe's model per device type: the same MoE layer ops (counted in costmodel/host.py), at widths whose
# GEMMs the device finishes before the host issues the next op
LAYER_MODEL = {"cuda": "small-moe", "cpu": "tiny-moe"}


def layer_model(device: torch.device) -> str:
    """The catalog model whose layer the host probe times on ``device``."""
    return LAYER_MODEL.get(device.type, "small-moe")


def _pass(layers: int, device: torch.device, dtype: torch.dtype) -> Callable[[], float]:
    """A function timing one ``Trainer.forward_backward`` (wall seconds) of a ``layers``-layer
    :func:`layer_model` on one rank."""
    spec = get_model(layer_model(device)).with_layers(layers)
    net = MoEGPT(spec, single_process_state(), ExecutorOptions(), LAYER_TOKENS, device, dtype)
    trainer = Trainer(net)
    batch = global_batch(spec.vocab_size, LAYER_TOKENS, 1, 0, 0)
    micro = micro_batches(batch, 1, 0, 1, device)

    def timed() -> float:
        trainer.optimizer.zero_grad()
        synchronize(device)
        start = time.perf_counter()
        trainer.forward_backward(micro)
        synchronize(device)
        return time.perf_counter() - start
    return timed


def _forward_backward_seconds(layers: int, device: torch.device, dtype: torch.dtype) -> float:
    """Median wall seconds of ``Trainer.forward_backward`` of a ``layers``-layer :func:`layer_model` on one
    rank (after two warm-up passes)."""
    timed = _pass(layers, device, dtype)
    return statistics.median([timed() for _ in range(2 + LAYER_REPEATS)][2:])


def layer_seconds(three: list[float], one: list[float]) -> float | None:
    """Seconds of one layer from adjacent timed passes of a 3-layer and a 1-layer model (``three[i]`` right
    before ``one[i]``): half the median of their differences (a load spike lengthens one pair); None if not
    positive."""
    seconds = statistics.median(t - o for t, o in zip(three, one, strict=True)) / 2
    return seconds if seconds > 0 else None


def measure_layer_host(device: torch.device, dtype: torch.dtype) -> float | None:
    """Seconds of one executor MoE layer per micro-batch on tiny shapes (host bound); None if not positive.
    The 3-layer and 1-layer passes alternate, after two warm-up pairs; inside ``timing.lockstep`` each pass is
    started by every rank together, inside ``timing.in_turns`` one rank times all its passes at a time."""
    three, one = _pass(3, device, dtype), _pass(1, device, dtype)
    repeats = CPU_LAYER_REPEATS if device.type == "cpu" else LAYER_REPEATS

    def pairs() -> list[tuple[float, float]]:
        samples = []
        for _ in range(2 + repeats):
            start_together(device)
            t3 = three()
            start_together(device)
            samples.append((t3, one()))
        return samples[2:]
    samples = one_rank_at_a_time(pairs)
    return layer_seconds([s[0] for s in samples], [s[1] for s in samples])


REGION_CALLS = 20  # forward + backward calls per timed loop of the checkpoint probe
REGION_REPEATS = 7


def region_seconds(checkpointed: float, plain: float, forward: float) -> float:
    """Seconds a checkpoint region adds beyond its re-run forward: (checkpointed forward + backward) - (plain
    forward + backward) - (one more forward), at least 0."""
    return max(0.0, checkpointed - plain - forward)


def measure_checkpoint_region(device: torch.device, dtype: torch.dtype) -> float:
    """Seconds one activation-checkpoint region adds per micro-batch beyond re-running its forward
    (:func:`region_seconds`), on the executor's RMSNorm of a tiny-moe activation (LAYER_TOKENS x 4 rows of
    its hidden width). Each of the three timings is the median of REGION_REPEATS loops of REGION_CALLS calls,
    every rank's loops started together (inside ``timing.lockstep``) or one rank's at a time (``timing.in_turns``)."""
    width = get_model(layer_model(device)).hidden_size
    norm = pick_rms_norm(True, get_backend("torch"))
    x = torch.randn(4 * LAYER_TOKENS, width, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(width, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(4 * LAYER_TOKENS, width, device=device, dtype=dtype)

    def forward() -> torch.Tensor:
        return norm(x, w, 1e-6)

    def plain() -> None:
        x.grad = w.grad = None
        forward().backward(grad)

    def checkpointed() -> None:
        x.grad = w.grad = None
        torch.utils.checkpoint.checkpoint(forward, use_reentrant=False).backward(grad)

    def timed(call: Callable[[], object]) -> float:
        return time_op(call, device, iters=REGION_CALLS, repeats=REGION_REPEATS, warmup=2)
    return region_seconds(timed(checkpointed), timed(plain), timed(forward))


def measure_launch(device: torch.device, dtype: torch.dtype = torch.float32) -> dict:
    """``{'op_launch_s', 'collective_launch_s', 'moe_layer_host_s', 'recompute_region_s'}`` on this rank
    (every rank of a group must call it)."""
    try:
        layer = measure_layer_host(device, dtype)
    except RuntimeError as exc:  # e.g. a dtype the device's grouped GEMM refuses: the other numbers still count
        print(f"executor layer benchmark skipped: {exc}", flush=True)
        layer = None
    return {"op_launch_s": measure_op_launch(device), "collective_launch_s": measure_collective_launch(device),
            "moe_layer_host_s": layer, "recompute_region_s": measure_checkpoint_region(device, dtype)}
