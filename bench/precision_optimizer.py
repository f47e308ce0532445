"""The precision-aware optimizer's memory on one GPU: peak memory of a proxy trained with fp32 Adam state and with
narrower state (bf16 moments; bf16 moments and fp16 master weights), the measured saving against the cost model's
predicted one (target: within 5 %).

Each layout is trained ``--steps`` steps (``executor.profile.profile_layout``: bf16, Megatron's mixed-precision
Adam, balanced routing) on one GPU, one process per layout. Measured: the peak allocated bytes, and the bytes
allocated after the first step (the weights, gradients and Adam state left when the step's temporaries are gone);
predicted: ``costmodel.memory.estimate_memory``'s total and its optimizer bytes. The saving of a narrower layout
is its difference from the fp32 one, measured and predicted.

GPU (the lead): python3 -m bench.precision_optimizer --model mixtral-8x7b --layers 2 --gpu h200
CPU smoke test: python3 -m bench.precision_optimizer --tiny  (tiny-moe; no CUDA, so the measured bytes are the
optimizer's own count, ``state_bytes``, which the table then compares with the predicted optimizer bytes)
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.report import machine, replace_section, save_json, utc_now
from costmodel.memory import estimate_memory
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.profile import profile_layout
from executor.train_step import Trainer
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.optimizer_dtypes import FIELDS, FP32_STATES, dtypes_text, read_dtypes
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

GIB = 2**30
MIB = 2**20
BAR = 0.05
HEADING = "## Precision-aware optimizer: memory saved, measured vs predicted"


def _config(dtypes: tuple[str, str, str], recompute: str) -> ParallelConfig:
    granularity, _, modules = recompute.partition(":")
    fields = {"recompute_granularity": granularity}
    if modules:
        fields["recompute_modules"] = tuple(modules.split("+"))
    return ParallelConfig(world_size=1, **fields, **dict(zip(FIELDS, dtypes)))


def _cpu_state_bytes(model, config: ParallelConfig) -> int:
    """The optimizer's own count of its state on CPU (no CUDA allocator to read): what the smoke test measures."""
    trainer = Trainer(MoEGPT(model, single_process_state(config), ExecutorOptions(), 64, dtype=torch.bfloat16))
    return trainer.optimizer.state_bytes()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mixtral-8x7b")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the proxy")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--gbs", type=int, default=2)
    parser.add_argument("--recompute", default="selective:layernorm+moe_act",
                        help="the proxy's recompute (label form): none, full, selective:MODULES")
    parser.add_argument("--gpu", default="h200", help="catalog hardware the prediction is made for")
    parser.add_argument("--dtypes", default="bf16+bf16+fp32,bf16+bf16+fp16",
                        help="narrower EXP_AVG+EXP_AVG_SQ+MAIN_PARAMS triples compared with fp32+fp32+fp32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=540.0)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test on tiny-moe")
    parser.add_argument("--no-doc", action="store_true", help="do not write the docs/benchmarks.md section")
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and not args.tiny
    unit, unit_name = (GIB, "GiB") if not args.tiny else (MIB, "MiB")
    if args.tiny:
        model, training, gpu = get_model("tiny-moe"), TrainingSpec(seq_length=64, global_batch_size=2), "cpu"
    else:
        model = get_model(args.model).with_layers(args.layers)
        training = TrainingSpec(seq_length=args.seq, global_batch_size=args.gbs, precision="bf16")
        gpu = args.gpu
    cluster = ClusterSpec(get_hardware(gpu), 1)
    triples = [FP32_STATES] + [read_dtypes(t) for t in args.dtypes.split(",") if t.strip()]
    options = ExecutorOptions(moe_router_force_load_balancing=True)
    rows = []
    for dtypes in triples:
        config = _config(dtypes, args.recompute)
        predicted = estimate_memory(model, training, cluster, config)
        row = {"dtypes": dtypes_text(dtypes), "layout": config.label(), "predicted_total": predicted.total,
               "predicted_optimizer": predicted.optimizer}
        if cuda:
            m = profile_layout(model, training, config, options, warmup_steps=args.warmup,
                               timed_steps=args.steps, timeout_s=args.timeout, device="cuda", hardware=gpu)
            row["ok"], row["failure"] = m.ok, m.failure_reason
            if m.ok:
                row["measured_peak"] = m.peak_allocated_bytes
                row["measured_static"] = (m.memory_by_rank or [{}])[0].get("static_after_step")
        else:
            row["ok"], row["measured_peak"] = True, _cpu_state_bytes(model, config)
        rows.append(row)
        measured = (f"{row['measured_peak'] / unit:.2f} {unit_name}" if row.get("measured_peak")
                    else f"FAILED: {row.get('failure')}")
        print(f"[{row['dtypes']}] predicted {row['predicted_total'] / unit:.2f} {unit_name} (optimizer "
              f"{row['predicted_optimizer'] / unit:.2f}); measured {measured}", flush=True)

    base = rows[0]
    key = "predicted_total" if cuda else "predicted_optimizer"
    lines = [f"| state (exp_avg+exp_avg_sq+main) | predicted {'peak' if cuda else 'optimizer'} {unit_name} | "
             f"measured {unit_name} | predicted saving {unit_name} | measured saving {unit_name} | "
             "measured / predicted |",
             "|---|---|---|---|---|---|"]
    within = True
    for row in rows:
        saved_pred = base[key] - row[key]
        saved_meas = (base["measured_peak"] - row["measured_peak"]
                      if base.get("measured_peak") and row.get("measured_peak") else None)
        row["predicted_saving"], row["measured_saving"] = saved_pred, saved_meas
        ratio = saved_meas / saved_pred if saved_meas is not None and saved_pred else None
        row["ratio"] = ratio
        if ratio is not None:
            within = within and abs(ratio - 1.0) <= BAR
        measured = f"{row['measured_peak'] / unit:.2f}" if row.get("measured_peak") else "failed"
        lines.append(f"| {row['dtypes']} | {row[key] / unit:.2f} | {measured} | {saved_pred / unit:.2f} | "
                     + (f"{saved_meas / unit:.2f} | {ratio:.3f} |" if ratio is not None else "– | – |"))
    table = "\n".join(lines)
    print(table)
    verdict = f"saving within ±{BAR:.0%} of the prediction: {'yes' if within else 'NO'}"
    print(verdict)
    report = {"date": utc_now(), "machine": machine(), "model": model.name, "seq": training.seq_length,
              "gbs": training.global_batch_size, "recompute": args.recompute, "gpu_profile": gpu,
              "cuda": cuda, "rows": rows, "within_bar": within}
    save_json(report, "precision_optimizer" + ("" if cuda else "_cpu") + ".json")
    if cuda and not args.no_doc:
        replace_section(HEADING, f"{HEADING}\n\n{model.name}, seq {training.seq_length}, global batch "
                                 f"{training.global_batch_size}, recompute {args.recompute}, one GPU; {machine()}, "
                                 f"{utc_now()} (`python3 -m bench.precision_optimizer`). Peak allocated bytes over "
                                 f"{args.steps} steps; the saving is the fp32 row's minus each row's.\n\n{table}\n\n"
                                 f"{verdict}.\n")
    return 0 if all(r["ok"] for r in rows) and within else 1


if __name__ == "__main__":
    sys.exit(main())
