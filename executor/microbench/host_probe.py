"""The host probe of ``foldtune calibrate --model``: a model's host seconds per micro-batch on one GPU.

The model's 1-GPU step runs at a short sequence, where every kernel ends before the host has queued the next, so
the step's wall time is the host's; adjacent steps of two lengths give the host seconds per micro-batch, without
and with full recomputation (costmodel.calibrate.host_factors turns them into the model's host factors).
:func:`host_probe_worker` also serves bench/host_probe_gpu.py for any stored layout.
"""

from __future__ import annotations

import statistics
import time

import torch

from executor.data import global_batch
from executor.data import micro_batches as micro_batches_of
from executor.launch_local import launch
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.profile import DTYPES, options_for_precision
from executor.timing import PhaseTimer
from executor.train_step import Trainer
from spec.errors import FoldtuneError
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

# the host probe: at 256 tokens per micro-batch the 2-layer proxies' kernels should take a fifth of the host's
# time to issue them (estimated from their FLOPs and bytes, about 4-5 ms against the 20-40 ms per micro-batch the
# H200 probe measured; the device time itself was not measured); HOST_TIMED adjacent pairs of steps of M and 2M
# micro-batches
HOST_PROBE_SEQ = 256
HOST_PROBE_MICRO_BATCHES = 8
HOST_TIMED = 5


def host_probe_worker(rank: int, world_size: int, model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                      micro_batches: int, repeats: int) -> dict:
    """One rank of the host probe: ``config`` built once (phase timer on, as the layout tables run), two warm-up
    steps of each length, then ``repeats`` adjacent pairs of steps of ``micro_batches`` and ``2 *
    micro_batches`` micro-batches per rank. Returns the median step seconds of each length (``steps_s``, keyed by
    micro-batches per rank) and ``host_s``: the median over pairs of (long - short) / micro_batches, the host
    seconds per micro-batch. Pairs rather than two separate runs: the host's speed differs between processes
    and drifts within one (on 2 x H200 separate processes gave full recomputation a smaller
    increment than none), and adjacent steps of one process share both."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    options = options_for_precision(ExecutorOptions.for_training(training, model=model), training.precision)
    state = build_parallel_state(config, rank)
    net = MoEGPT(model, state, options, training.seq_length, device, DTYPES[training.precision],
                 PhaseTimer(enabled=True, device=device))
    trainer = Trainer(net)
    dp = state.dp
    lengths = (micro_batches, 2 * micro_batches)

    def step(micro: int, index: int) -> float:
        batch = global_batch(model.vocab_size, training.seq_length, micro * config.micro_batch_size * dp.size,
                             options.seed, index)
        mbs = micro_batches_of(batch, dp.size, dp.rank, config.micro_batch_size, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if world_size > 1:
            torch.distributed.barrier()
        net.timer.start_step()
        start = time.perf_counter()
        trainer.step(mbs)  # ends with a host read of the loss: the step is complete
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        net.timer.end_step()
        return elapsed

    for i in range(2):
        for m in lengths:
            step(m, i)
    walls: dict[int, list[float]] = {m: [] for m in lengths}
    per_micro = []
    for i in range(repeats):
        pair = []
        for m in lengths:
            pair.append(step(m, 2 + i))
            walls[m].append(pair[-1])
        per_micro.append((pair[1] - pair[0]) / micro_batches)
    trainer.finish_param_gather()
    return {"rank": rank, "steps_s": {m: statistics.median(v) for m, v in walls.items()},
            "host_s": statistics.median(per_micro)}


def measure_host(spec: ModelSpec, precision: str, micro_batch_size: int = 1, seq_length: int = HOST_PROBE_SEQ,
                 micro_batches: int = HOST_PROBE_MICRO_BATCHES, repeats: int = HOST_TIMED,
                 timeout_s: float = 600.0) -> tuple[float, float, dict[str, float]]:
    """Host seconds per micro-batch of ``spec``'s 1-GPU step on CUDA: (without recomputation, with full
    recomputation, the median step seconds by '<recompute>@<micro-batches>'), each from
    :func:`host_probe_worker` in its own spawned rank. FoldtuneError when a run fails or no GPU is present (on
    CPU ranks every op runs before the next is issued: there is no host floor to see)."""
    if not torch.cuda.is_available():
        raise FoldtuneError("the host probe needs a CUDA GPU")
    training = TrainingSpec(seq_length=seq_length, global_batch_size=micro_batch_size * micro_batches,
                            precision=precision)
    out, steps_s = [], {}
    for recompute in ("none", "full"):
        config = ParallelConfig(world_size=1, micro_batch_size=micro_batch_size, recompute_granularity=recompute)
        launched = launch(host_probe_worker, 1, (spec, training, config, micro_batches, repeats), timeout_s=timeout_s)
        if not launched.ok:
            raise FoldtuneError(f"host probe of {spec.name}: {config.label()} at seq {seq_length} failed: "
                                f"{launched.failure_reason}")
        report = launched.results[0]
        out.append(report["host_s"])
        steps_s.update({f"{recompute}@{m}": v for m, v in report["steps_s"].items()})
    if not all(v > 0 for v in out):
        raise FoldtuneError(f"host probe of {spec.name}: a longer step was not slower ({out}); the machine is "
                            f"too busy to measure")
    return out[0], out[1], steps_s
