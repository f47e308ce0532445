"""The training loop of one rank, and a local launcher for a whole run.

Each step: the schedule's learning rate, this DP rank's rows of global batch ``step`` (the data position is
the step), forward/backward over micro-batches, gradient reduction, clipping by the global gradient norm,
AdamW (all through :class:`executor.train_step.Trainer`, whose optimizer gets a pre-step hook for the
clipping). Loss is CE plus the MoE router losses (aux and z-loss per :class:`ExecutorOptions`) plus, for models
with ``mtp_num_layers``, ``mtp_loss_scaling_factor`` times the MTP loss (logged unscaled as ``mtp_loss``). Every
``eval_every`` steps and at the end the mean CE over fixed held-out batches is measured; every
``checkpoint_every`` steps and at the end a checkpoint is saved (the newest ``keep_last`` kept); a run whose
checkpoint directory holds one resumes from it, under whatever layout it is launched with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import torch

from spec.errors import FoldtuneError, SpecError
from spec.flops import flops_per_step, tflops_per_gpu
from spec.hf_config import load_hf_model
from spec.limits import MAX_KEEP_LAST
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.recipe import DEFAULT_RECIPE
from executor.buildable import check_buildable, training_for
from executor.data import micro_batches, packed_micro_batches
from executor.documents import check_packed, loss_tokens
from executor.dataset.sampler import BatchSampler, TokenDataset
from executor.hf.weights import export_hf, load_hf_weights
from executor.launch_local import launch
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.collectives import all_reduce_
from executor.parallel.groups import ParallelState, build_parallel_state
from executor.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from executor.train.grad_norm import GradClipper
from executor.train.metrics_log import MetricsLog
from executor.train.optim_state import set_lr
from executor.train.retention import prune_checkpoints
from executor.train.schedule import LRSchedule
from executor.train_step import Trainer


@dataclass(frozen=True)
class TrainConfig:
    """One training run's recipe (the layout and model are separate; the defaults are spec.recipe's). Steps
    are optimizer steps; sizes in sequences and tokens; ``eval_every``/``checkpoint_every`` 0 means only at
    the end."""

    data_path: str
    steps: int
    seq_length: int
    global_batch_size: int
    lr: float = DEFAULT_RECIPE.lr
    min_lr: float = DEFAULT_RECIPE.min_lr
    warmup_steps: int = DEFAULT_RECIPE.warmup_steps
    weight_decay: float = DEFAULT_RECIPE.weight_decay
    max_grad_norm: float = DEFAULT_RECIPE.max_grad_norm
    eval_every: int = DEFAULT_RECIPE.eval_every
    eval_batches: int = DEFAULT_RECIPE.eval_batches
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_last: int = 0  # complete checkpoints kept (the newest); 0 keeps every one
    data_seed: int = DEFAULT_RECIPE.data_seed
    # Hugging Face model directory whose safetensors a fresh run starts from (a resume ignores it), and the
    # directory the trained model is exported to at the end with ``hf_export_config`` as its config.json (the
    # source's, or spec.hf_config.hf_config_from_spec's); docs/huggingface.md
    hf_init_dir: str | None = None
    hf_export_dir: str | None = None
    hf_export_config: dict | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.steps < 1:
            problems.append(f"steps must be >= 1, got {self.steps}")
        if self.seq_length < 1 or self.global_batch_size < 1:
            problems.append(f"seq_length ({self.seq_length}) and global_batch_size ({self.global_batch_size}) "
                            f"must be >= 1")
        if not 0 <= self.keep_last <= MAX_KEEP_LAST:
            problems.append(f"keep_last must be in 0..{MAX_KEEP_LAST} (0 keeps every checkpoint), got "
                            f"{self.keep_last}")
        if self.eval_every < 0 or self.checkpoint_every < 0 or self.eval_batches < 1:
            problems.append(f"eval_every ({self.eval_every}) and checkpoint_every ({self.checkpoint_every}) must "
                            f"be >= 0, eval_batches ({self.eval_batches}) >= 1")
        if self.checkpoint_every and not self.checkpoint_dir:
            problems.append("checkpoint_every needs a checkpoint_dir")
        if self.hf_export_dir and not self.hf_export_config:
            problems.append("hf_export_dir needs hf_export_config (the Hugging Face config of the model)")
        if problems:
            raise SpecError("; ".join(problems))
        self.schedule()  # validates the learning rates

    def schedule(self) -> LRSchedule:
        return LRSchedule(self.lr, self.min_lr, min(self.warmup_steps, self.steps), self.steps)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepMetrics:
    """One optimizer step as seen by every rank (values are global: equal on all ranks, except timing).
    ``expert_load_max``/``expert_load_mean``: routed tokens of the busiest and the mean expert, summed over the
    MoE layers; ``expert_tokens``: the routed tokens of each expert in each MoE layer (rows: the decoder layer
    numbers in ``moe_layers``, 0-based, head blocks such as MTP numbered on from the last decoder layer), each
    row summing to global batch tokens × top-k."""

    step: int
    loss: float
    ce: float
    router_loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    expert_load_max: float
    expert_load_mean: float
    eval_loss: float | None = None
    peak_memory_bytes: int | None = None
    mtp_loss: float = 0.0  # mean over MTP depths of their CE, before mtp_loss_scaling_factor (0: no MTP)
    moe_layers: list[int] = field(default_factory=list)
    expert_tokens: list[list[int]] = field(default_factory=list)


#: StepMetrics fields that are not one number per step: kept out of metrics.csv and the TensorBoard scalars
PER_LAYER_FIELDS = ("moe_layers", "expert_tokens")


@dataclass
class TrainReport:
    """What one rank returns: per-step metrics of the steps it ran (the per-layer expert counts of the last
    one only; ``on_step`` sees every step's), the step it started at and where it resumed from (None: fresh),
    and the checkpoints it saved."""

    start_step: int
    resumed_from: str | None
    resumed_layout: str | None
    metrics: list[StepMetrics] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    initial_eval_loss: float | None = None


def evaluate(trainer, sampler: BatchSampler, batches: int, state: ParallelState, micro_batch_size: int,
             device: torch.device) -> float:
    """Mean cross-entropy (nats/token) over the first ``batches`` global batches of ``sampler``.

    Under pipeline parallelism the model's forward runs only inside the trainer's schedule, so evaluation
    runs that schedule and discards the gradients (a backward more than needed, no forward-only schedule).
    """
    model, dp, dp_cp = trainer.model, state.dp, state["dp_cp"]  # CP ranks share batches, split sequences
    pipelined = state["pp"].size > 1
    trainer.finish_param_gather()  # the last step's overlapped parameter all-gathers
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for position in range(batches):
        micro = rank_micro_batches(sampler, position, dp, micro_batch_size, device)
        if pipelined:
            trainer.optimizer.zero_grad()
            stats = trainer.forward_backward(micro)  # [ce, router] means over micro-batches, last stage only
            trainer.reducer.reduce()  # finish any overlapped reduction the schedule started
            trainer.optimizer.zero_grad()
            total += all_reduce_(stats[0].detach().double(), state["pp"])
        else:
            with torch.no_grad():  # packed: the per-token mean over the global batch, as training's
                tokens = loss_tokens(micro, dp) if any(len(m) > 2 for m in micro) else None
                total += sum((model(*m, loss_tokens=tokens) if len(m) > 2 else model(*m)).ce.double()
                             for m in micro) / len(micro)
    model.train()
    with torch.no_grad():
        total = all_reduce_(total / batches, dp_cp) / dp_cp.size
    return float(total)


def rank_micro_batches(sampler: BatchSampler, position: int, dp, micro_batch_size: int,
                       device: torch.device) -> list[tuple]:
    """This DP rank's micro-batches of global batch ``position``: (ids, labels), or from a packed dataset
    (ids, labels, segment ids) (:func:`executor.data.packed_micro_batches`)."""
    if sampler.packed:
        return packed_micro_batches(*sampler.packed_batch(position, dp.size, dp.rank), micro_batch_size, device)
    return micro_batches(sampler.batch(position, dp.size, dp.rank), 1, 0, micro_batch_size, device)


def step_metrics(step: int, result, lr: float, grad_norm: float, elapsed: float, cfg: TrainConfig, flops: float,
                 world_size: int, moe_layers: list[int], peak_memory_bytes: int | None = None) -> StepMetrics:
    """The metrics of one optimizer step from the trainer's StepResult ``result`` (``elapsed`` seconds,
    ``flops`` per step)."""
    counts = [float(c) for c in result.tokens_per_expert] or [0.0]
    return StepMetrics(step=step, loss=result.loss, ce=result.ce, router_loss=result.router_loss, lr=lr,
                       grad_norm=grad_norm, step_time_s=elapsed,
                       tokens_per_s=cfg.global_batch_size * cfg.seq_length / elapsed,
                       tflops_per_gpu=tflops_per_gpu(flops, elapsed, world_size),
                       expert_load_max=max(counts), expert_load_mean=sum(counts) / len(counts),
                       peak_memory_bytes=peak_memory_bytes, mtp_loss=result.mtp_loss, moe_layers=moe_layers,
                       expert_tokens=result.tokens_per_expert_by_layer)


def _check(model: ModelSpec, config: ParallelConfig, options: ExecutorOptions, cfg: TrainConfig,
           dataset: TokenDataset) -> None:
    """Refuse a run the executor cannot build (the rule book, :mod:`executor.buildable`) or whose data does not
    fit the model, before any rank builds its slice."""
    if dataset.vocab_size > model.vocab_size:
        raise SpecError(f"dataset {dataset.path!r} has vocab_size {dataset.vocab_size}, model {model.name!r} "
                        f"only {model.vocab_size}")
    if dataset.packed_seq_length is not None:
        check_packed(model, config, options)
        if dataset.packed_seq_length != cfg.seq_length:
            raise SpecError(f"dataset {dataset.path!r} is packed for seq_length {dataset.packed_seq_length}, not "
                            f"{cfg.seq_length}: prepare it again with `foldtune data prepare --pack --seq "
                            f"{cfg.seq_length}`")
    check_buildable(model, training_for(cfg.seq_length, cfg.global_batch_size, options.moe_expert_capacity_factor,
                                        options.moe_pad_expert_input_to_capacity), config)


def train_worker(rank: int, world_size: int, model: ModelSpec, config: ParallelConfig, options: ExecutorOptions,
                 cfg: TrainConfig, on_step: Callable[[int, StepMetrics], None] | None = None,
                 use_cuda: bool = False) -> TrainReport:
    """One rank of a run (fp32 on CPU, bf16 on CUDA). ``on_step(rank, metrics)`` is called after each step."""
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dtype = torch.bfloat16 if use_cuda else torch.float32
    dataset = TokenDataset(cfg.data_path)
    _check(model, config, options, cfg, dataset)
    train_sampler = BatchSampler(dataset.splits["train"], cfg.seq_length, cfg.global_batch_size, cfg.data_seed)
    eval_sampler = BatchSampler(dataset.splits["heldout"], cfg.seq_length, cfg.global_batch_size, shuffle=False)
    eval_batches = min(cfg.eval_batches, eval_sampler.batches_per_epoch())
    if eval_batches < 1:
        raise SpecError(f"the held-out split ({dataset.splits['heldout'].tokens} tokens) holds no global batch of "
                        f"{cfg.global_batch_size} × {cfg.seq_length + 1} tokens")
    state = build_parallel_state(config, rank)
    dp = state.dp  # CP ranks share their micro-batches (each keeps its part of the sequence)
    net = MoEGPT(model, state, options, cfg.seq_length, device, dtype)
    latest = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if latest is None and cfg.hf_init_dir:  # before the optimizer takes (and copies) the parameters
        load_hf_weights(net, state, cfg.hf_init_dir, load_hf_model(cfg.hf_init_dir, model.name))
    trainer = Trainer(net, lr=cfg.lr, weight_decay=cfg.weight_decay)
    clipper = GradClipper(net, state, trainer.reducer)
    norms: list[float] = []
    optimizer_step = trainer.optimizer.step

    def clipped_step(*args, **kwargs):  # the trainer calls this right after the gradient reduction
        norms.append(clipper.clip(cfg.max_grad_norm))
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = clipped_step
    schedule = cfg.schedule()
    report = TrainReport(0, None, None)
    if latest is not None:
        resumed = load_checkpoint(latest, net, trainer.optimizer, state, model.name)
        report.start_step, report.resumed_from, report.resumed_layout = resumed.step, resumed.path, resumed.saved_layout
    else:
        report.initial_eval_loss = evaluate(trainer, eval_sampler, eval_batches, state, config.micro_batch_size, device)
    flops = flops_per_step(model, cfg.seq_length, cfg.global_batch_size)
    # rank 0 keeps metrics.csv and TensorBoard events beside the checkpoints (executor/train/metrics_log.py)
    log = (MetricsLog(cfg.checkpoint_dir, report.start_step,
                      [f.name for f in fields(StepMetrics) if f.name not in PER_LAYER_FIELDS])
           if cfg.checkpoint_dir and rank == 0 else None)
    try:
        for step in range(report.start_step, cfg.steps):
            lr = schedule.at(step)
            set_lr(trainer.optimizer, lr)
            micro = rank_micro_batches(train_sampler, step, dp, config.micro_batch_size, device)
            if use_cuda:  # this stream only: the device would also finish the last step's overlapped param gathers
                torch.cuda.current_stream(device).synchronize()
            start = time.perf_counter()
            result = trainer.step(micro)  # ends with a host read of the loss
            elapsed = time.perf_counter() - start
            metrics = step_metrics(step, result, lr, norms[-1], elapsed, cfg, flops, world_size,
                                   list(net.moe_layer_numbers),
                                   torch.cuda.max_memory_allocated(device) if use_cuda else None)
            last = step + 1 == cfg.steps
            if last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                metrics.eval_loss = evaluate(trainer, eval_sampler, eval_batches, state, config.micro_batch_size,
                                             device)
            if report.metrics:  # a long run of a wide model would hold steps × layers × experts counts
                report.metrics[-1].moe_layers, report.metrics[-1].expert_tokens = [], []
            report.metrics.append(metrics)
            if log is not None:
                log.write(metrics)
            if on_step is not None:
                on_step(rank, metrics)
            if cfg.checkpoint_dir and (last or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)):
                path = save_checkpoint(cfg.checkpoint_dir, step + 1, net, trainer.optimizer, state, model.name)
                report.checkpoints.append(str(path))
                if rank == 0:  # after the save: `latest` names the new checkpoint on every rank's return
                    prune_checkpoints(cfg.checkpoint_dir, cfg.keep_last)
    finally:
        if log is not None:
            log.close()
    trainer.finish_param_gather()  # no collective left running when the rank leaves
    if cfg.hf_export_dir:
        export_hf(net, state, cfg.hf_export_dir, cfg.hf_export_config["model_type"], cfg.hf_export_config)
    return report


def train_local(model: ModelSpec, config: ParallelConfig, cfg: TrainConfig, options: ExecutorOptions | None = None,
                on_step: Callable[[int, StepMetrics], None] | None = None, device: str = "cpu",
                timeout_s: float = 3600.0, start_method: str = "spawn") -> TrainReport:
    """Run (or resume) a training on ``config.world_size`` local processes; rank 0's report. A rank that fails
    raises :class:`executor.train.loop.TrainingFailed` with its reason."""
    options = options or ExecutorOptions()
    _check(model, config, options, cfg, TokenDataset(cfg.data_path))  # fail here, before starting any process
    use_cuda = device == "cuda"
    if use_cuda and torch.cuda.device_count() < config.world_size:
        raise SpecError(f"layout {config.label()} needs {config.world_size} GPUs, this machine has "
                        f"{torch.cuda.device_count()}")
    launched = launch(train_worker, config.world_size, (model, config, options, cfg, on_step, use_cuda),
                      backend="nccl" if use_cuda else "gloo", timeout_s=timeout_s, start_method=start_method)
    if not launched.ok:
        raise TrainingFailed(f"training {config.label()} failed: {launched.failure_reason}")
    return launched.results[0]


class TrainingFailed(FoldtuneError):
    """A rank of a training run failed (the reason names the rank and the error)."""
