"""Where a training's ranks put each step's metrics: rank 0 writes them to the service database."""

from __future__ import annotations

from db.engine import make_engine, make_sessionmaker
from db.trainings import record_expert_load, record_training_metrics


class DatabaseMetrics:
    """``on_step`` sink: rank 0 stores each step's metrics and per-layer expert load of training ``training_id``
    (db.trainings; the expert counts thinned to spec.limits.MAX_EXPERT_LOAD_CELLS there).

    Picklable (it holds only the URL), so spawned ranks open their own engine on first use. ``peak_flops``
    (per GPU, FLOP/s) turns TFLOPS into MFU; ``None`` leaves MFU empty.
    """

    def __init__(self, url: str, training_id: int, peak_flops: float | None = None):
        self.url, self.training_id, self.peak_flops = url, training_id, peak_flops
        self._sessions = None

    def row(self, m) -> dict:
        mfu = m.tflops_per_gpu * 1e12 / self.peak_flops if self.peak_flops else None
        return {"step": m.step + 1, "loss": m.loss, "eval_loss": m.eval_loss, "lr": m.lr, "grad_norm": m.grad_norm,
                "step_time_s": m.step_time_s, "tokens_per_s": m.tokens_per_s, "tflops_per_gpu": m.tflops_per_gpu,
                "mfu": mfu, "peak_memory_bytes": m.peak_memory_bytes, "expert_load_max": m.expert_load_max,
                "expert_load_mean": m.expert_load_mean}

    def __call__(self, rank: int, m) -> None:
        if rank != 0:
            return
        if self._sessions is None:
            self._sessions = make_sessionmaker(make_engine(self.url))
        with self._sessions() as session:
            record_training_metrics(session, self.training_id, [self.row(m)])
            record_expert_load(session, self.training_id, m.step + 1, m.moe_layers, m.expert_tokens)

    def __getstate__(self):
        return {"url": self.url, "training_id": self.training_id, "peak_flops": self.peak_flops, "_sessions": None}
