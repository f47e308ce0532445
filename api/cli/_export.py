"""``--format megatron-args|yaml|json|csv``: the measured best layout of a job, in a form other tools run or read.

One record (:func:`best_record`) from the job's view and its best trial, both as the API serves them; the
Megatron-LM arguments and environment come from :mod:`planner.megatron_args` for the job's own model spec and
training spec at the precision the best trial ran (a job with ``search_precision`` measures each trial at its
own: an fp8 best exports ``--fp8-format``), so what is exported is exactly what was measured.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import yaml

from api.cli.arguments import EXPORT_FORMATS, add
from planner.megatron_args import megatron_args, megatron_env, megatron_script
from spec.errors import SpecError
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.precision_search import trial_training
from spec.training_spec import TrainingSpec

FORMATS = EXPORT_FORMATS
CSV_FIELDS = ("job_id", "trial", "model", "gpu", "num_gpus", "seq_length", "global_batch_size", "precision", "layout",
              "tp", "cp", "pp", "vpp", "ep", "etp", "dp", "edp", "micro_batch_size", "recompute", "dispatcher",
              "distributed_optimizer", "measured_step_time_s", "predicted_step_time_s")


def add_format_argument(parser, note: str | None = None) -> None:
    add(parser, "--format", note)


def _specs(job: dict[str, Any], trial: dict[str, Any]) -> tuple[ParallelConfig, ModelSpec, TrainingSpec]:
    """The trial's layout, the job's model, and the job's training at the precision the trial ran; SpecError
    for a vision-language job, whose multimodal layout exports through GET /v1/jobs/{id}/megatron-args."""
    if "llm" in trial["config"]:
        raise SpecError(f"job {job['id']}'s best layout is multimodal ({trial.get('label')}): its Megatron-LM "
                        f"arguments are served by GET /v1/jobs/{job['id']}/megatron-args (the dashboard's job page)")
    return (ParallelConfig.from_dict(trial["config"]), ModelSpec.from_dict(job["model_spec"]),
            TrainingSpec.from_dict(trial_training(job["training"], trial.get("precision"))))


def best_record(job: dict[str, Any]) -> dict[str, Any]:
    """The job's measured best as one plain record (the YAML/JSON export); SpecError when it has none."""
    trial = job.get("best_trial")
    if not trial or trial.get("step_time_s") is None:
        raise SpecError(f"job {job['id']} ({job['status']}) has no measured layout to export yet")
    config, model, training = _specs(job, trial)
    return {
        "job_id": job["id"], "trial": trial["number"], "model": job["model"],
        "cluster": {"gpu": job["cluster"]["gpu"], "num_gpus": job["cluster"]["num_gpus"]},
        "training": {"seq_length": training.seq_length, "global_batch_size": training.global_batch_size,
                     "precision": training.precision},
        "layout": config.label(), "config": config.to_dict() | {"dp": config.dp, "edp": config.edp},
        "measured_step_time_s": trial["step_time_s"], "predicted_step_time_s": trial.get("predicted_step_time_s"),
        "megatron": {"environment": megatron_env(config),
                     "args": [part for flag in megatron_args(config, model, training) for part in flag]},
    }


def render(job: dict[str, Any], fmt: str) -> str:
    """The job's measured best in ``fmt`` (one of :data:`FORMATS`), ending without a newline."""
    record = best_record(job)
    if fmt == "megatron-args":
        config, model, training = _specs(job, job["best_trial"])
        return (f"# foldtune job {record['job_id']} trial {record['trial']}: {record['layout']} "
                f"({record['model']} on {record['cluster']['num_gpus']}x{record['cluster']['gpu']}, "
                f"{record['training']['precision']}, "
                f"{record['measured_step_time_s']:.4g} s/step measured)\n" + megatron_script(config, model, training))
    if fmt == "json":
        return json.dumps(record, indent=2)
    if fmt == "yaml":
        return yaml.safe_dump(record, sort_keys=False).rstrip("\n")
    if fmt == "csv":
        c = record["config"]
        row = {"job_id": record["job_id"], "trial": record["trial"], "model": record["model"],
               "gpu": record["cluster"]["gpu"], "num_gpus": record["cluster"]["num_gpus"], **record["training"],
               "layout": record["layout"], **{k: c[k] for k in ("tp", "cp", "pp", "vpp", "ep", "etp", "dp", "edp",
                                                                "micro_batch_size")},
               "recompute": ParallelConfig.from_dict(job["best_trial"]["config"]).recompute_text(),
               "dispatcher": c["moe_token_dispatcher_type"], "distributed_optimizer": c["use_distributed_optimizer"],
               "measured_step_time_s": record["measured_step_time_s"],
               "predicted_step_time_s": record["predicted_step_time_s"]}
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=CSV_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerow(row)
        return out.getvalue().rstrip("\n")
    raise SpecError(f"unknown --format {fmt!r}; one of {', '.join(FORMATS)}")
