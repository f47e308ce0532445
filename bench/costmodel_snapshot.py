"""The cost model's outputs for a fixed set of models and layouts, as sorted JSON: run it before and after a
refactor that must not change a number and compare.

Covers DeepSeek-V3 (MLA, MTP, dense-first, 256 GPUs), its tiny proxy (8 GPUs) and Qwen3-30B-A3B (GQA, no MTP,
64 GPUs) over 17 layouts (TP, CP, PP with virtual stages, EP, ETP, the allgather dispatcher, SP, full
recomputation): each layout's ``Estimate.to_dict()`` (time terms, memory details, explanation), the parameters
and the once-per-step collectives of its first and last pipeline ranks, a single-stage layout's micro-batch
collectives, and each model's FLOPs per token and parameter totals. A layout a model refuses is recorded as
its error.

    python -m bench.costmodel_snapshot > before.json      # on the old tree
    python -m bench.costmodel_snapshot --check before.json  # on the new one: exit 1 when anything differs
"""

from __future__ import annotations

import argparse
import json
import sys

from costmodel import collective_inventory as inv
from costmodel.estimate import estimate
from costmodel.params import stage_param_counts, total_param_counts
from spec.catalog import get_hardware, get_model
from spec.errors import SpecError
from spec.flops import flops_per_token
from spec.hardware import ClusterSpec
from spec.parallel_config import ParallelConfig
from spec.proxy import tiny_proxy
from spec.training_spec import TrainingSpec

V3 = get_model("deepseek-v3")
CASES = [
    (V3, TrainingSpec(seq_length=4096, global_batch_size=1024), 256, [
        dict(tp=1, pp=16, ep=16), dict(tp=2, pp=8, ep=8, cp=2), dict(tp=1, pp=8, vpp=2, ep=32, etp=1),
        dict(tp=4, pp=4, ep=16, etp=2), dict(tp=1, pp=16, ep=8, moe_token_dispatcher_type="allgather"),
        dict(tp=1, pp=8, ep=16, recompute_granularity="full")]),
    (tiny_proxy(V3), TrainingSpec(seq_length=256, global_batch_size=16), 8, [
        dict(), dict(tp=2), dict(pp=2), dict(pp=2, vpp=2, ep=2), dict(ep=4, etp=2), dict(cp=2, ep=2),
        dict(tp=2, pp=2, ep=2, sequence_parallel=True)]),
    (get_model("qwen3-30b-a3b"), TrainingSpec(seq_length=4096, global_batch_size=256), 64, [
        dict(tp=2, pp=2, ep=8), dict(tp=1, pp=4, vpp=2, ep=16, etp=1), dict(tp=4, cp=2, ep=4, etp=2),
        dict(tp=2, ep=32, etp=1)]),
]


def snapshot() -> dict:
    """Output name -> value (reprs for the typed results), for every case of :data:`CASES`."""
    out = {}
    for model, training, gpus, layouts in CASES:
        cluster = ClusterSpec(get_hardware("h100-sxm"), gpus)
        out[f"{model.name}/flops"] = flops_per_token(model, training.seq_length)
        out[f"{model.name}/total"] = total_param_counts(model)
        for fields in layouts:
            try:
                config = ParallelConfig(gpus, **fields)
                key = f"{model.name}/{config.label()}"
                out[key] = estimate(model, training, cluster, config).to_dict()
            except SpecError as exc:
                out[f"{model.name}/{fields}"] = repr(exc)
                continue
            for stage in (0, config.pp - 1):
                out[f"{key}/params{stage}"] = repr(stage_param_counts(model, config, stage))
                out[f"{key}/inv{stage}"] = repr(inv.step_inventory(model, training, config, stage))
            if config.pp == 1:
                out[f"{key}/micro"] = repr(inv.micro_batch_inventory(model, training, config))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="JSON",
                        help="compare with a snapshot written before; exit 1 on a difference")
    args = parser.parse_args()
    text = json.dumps(snapshot(), sort_keys=True, indent=1, default=repr)
    if args.check is None:
        print(text)
        return 0
    with open(args.check, encoding="utf-8") as f:
        same = f.read().rstrip("\n") == text
    print("identical" if same else "different")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
