"""Hugging Face directory → foldtune under a folded layout → a few training steps → Hugging Face directory.

:func:`roundtrip_worker` is a launched-world entry point (``executor.launch_local.launch``): for each job it
builds the model of an HF directory under the job's layout, loads the weights (each rank its slice), trains
``steps`` AdamW steps on synthetic batches (:mod:`executor.data`), computes the logits of a probe batch
(pp = 1 only: :mod:`executor.hf.logits`) and exports the trained model as a new HF directory. Several jobs
share one world (one process start). Rank 0 returns, per job, the probe logits [b, s, vocab] (None under
pp > 1) and the losses; the other ranks None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from spec.hf_config import load_hf_model
from spec.parallel_config import ParallelConfig
from executor.buildable import check_buildable, training_for
from executor.data import global_batch, micro_batches
from executor.hf.logits import model_logits
from executor.hf.weights import export_hf, load_hf_weights
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.train_step import Trainer


@dataclass(frozen=True)
class RoundTrip:
    """One model's trip under layout ``config``: ``source`` HF directory in, ``target`` out, ``probe`` ids [b, s]
    to compare logits on."""

    config: ParallelConfig
    source: str
    target: str
    probe: torch.Tensor
    steps: int = 5
    seq_length: int = 16
    global_batch_size: int = 4
    lr: float = 1e-3


def roundtrip_worker(rank: int, world_size: int, jobs: list[RoundTrip]) -> list | None:
    out = []
    for job in jobs:
        config = job.config
        hf = load_hf_model(job.source)
        options = ExecutorOptions(**hf.executor_options())
        check_buildable(hf.spec, training_for(job.seq_length, job.global_batch_size,
                                              options.moe_expert_capacity_factor), config)
        state = build_parallel_state(config, rank)
        model = MoEGPT(hf.spec, state, options, job.seq_length)
        load_hf_weights(model, state, job.source, hf)
        trainer = Trainer(model, lr=job.lr, eps=1e-6)
        losses = []
        for step in range(job.steps):
            batch = global_batch(hf.spec.vocab_size, job.seq_length, job.global_batch_size, options.seed, step)
            losses.append(trainer.step(micro_batches(batch, state.dp.size, state.dp.rank,
                                                     config.micro_batch_size)).loss)
        trainer.finish_param_gather()
        logits = model_logits(model, job.probe) if config.pp == 1 else None
        export_hf(model, state, job.target, hf.family, json.loads((Path(job.source) / "config.json").read_text()))
        out.append({"logits": logits, "losses": losses})
    return out if rank == 0 else None
