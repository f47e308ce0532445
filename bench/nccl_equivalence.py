"""Numerical equivalence of folded layouts that need more than two ranks, on NCCL (or gloo on CPU).

Each layout trains a tiny MoE for a few fp32 steps in one launched world (one process per GPU) and is
compared with the single-process CPU run of the same global batch (``executor.verify``): the loss of
every step, every gradient after the first step (gathered to full shape) and the routed tokens per
expert. The layouts are the ones the Parallel Folding paper needs more than two GPUs for; on a 4-GPU
machine the 8-rank ones are replaced by their 4-rank counterparts (listed in ``MATRIX``).

GPU kernels and reduction orders differ from the CPU reference, so the tolerance is rtol 2e-3 (the CPU
suite uses 1e-4 between gloo processes); parameters after Adam are reported, not judged, because Adam
divides by sqrt(v) and turns ~1e-9 gradient noise into visible parameter differences.

    python -m bench.nccl_equivalence                 # every GPU; writes $OUT or bench/results JSON
    python -m bench.nccl_equivalence --device cpu --world 4 --only "ep4"    # same matrix on gloo ranks
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

from executor.launch_local import launch
from executor.options import ExecutorOptions
from executor.verify import Scenario, compare, layout_worker, reference
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig

TINY = get_model("tiny-moe")
SHARED = get_model("tiny-moe-shared")  # shared experts, first layer dense
LOSSES = ExecutorOptions(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
SCENARIOS = {
    "base": (TINY, LOSSES),
    "shared": (SHARED, LOSSES),
    "capacity": (TINY, dataclasses.replace(LOSSES, moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs")),
    "deep8": (SHARED.with_layers(8), LOSSES),  # 8 layers: PP4 x VPP2 chunks of one layer
    "deep6": (SHARED.with_layers(6), LOSSES),  # 6 layers + embedding + loss: PP4 x VPP2 slots of one
}
# Megatron's pipeline placements (spec.pipeline_layout): the model's first chunk holds only the embedding and
# its last only the loss (both accounted as layers), and a first stage holding nothing but the embedding
PLACEMENTS = [("pp4 vpp2 pp_account=embedding+loss", [("alltoall", "deep6")]),
              ("pp2 layout=E|t*4L", [("alltoall", "shared")])]

# world size -> [(layout, [(dispatcher, scenario)])]
MATRIX: dict[int, list[tuple[str, list[tuple[str, str]]]]] = {
    8: [
        ("tp2 ep4 etp1", [("alltoall", "base"), ("allgather", "shared")]),
        ("tp2 cp2 pp2 ep4 etp1", [("alltoall", "shared")]),
        ("ep8", [("alltoall", "base"), ("alltoall", "capacity")]),
        ("etp2 ep4", [("alltoall", "base"), ("allgather", "shared")]),
        ("pp4 vpp2", [("alltoall", "deep8")]),
        # the CP communication types (spec.cp_comm_types): the ring across TP and EP, both over 8
        ("tp2 cp4 ep8 etp1 cp_comm=p2p", [("alltoall", "base")]),
        ("cp8 cp_comm=a2a+p2p:2x4", [("alltoall", "base")]),
        *PLACEMENTS,
    ],
    4: [
        ("tp2 ep4 etp1", [("alltoall", "base"), ("allgather", "shared")]),  # EP spans the TP x DP ranks
        ("cp2 pp2 ep2 etp1", [("alltoall", "shared")]),                     # 8-GPU TP2 CP2 PP2 EP4, halved
        ("ep4", [("alltoall", "base"), ("alltoall", "capacity")]),          # stands in for EP8
        ("etp2 ep2", [("alltoall", "base"), ("allgather", "shared")]),      # stands in for ETP2 EP4
        ("pp4 vpp2", [("alltoall", "deep8")]),
        ("tp2 pp2 ep2 etp1", [("alltoall", "shared")]),
        ("cp4 cp_comm=p2p", [("alltoall", "base")]),
        ("cp4 cp_comm=a2a+p2p:2x2", [("alltoall", "base")]),
        ("tp2 cp2 ep4 etp1 cp_comm=p2p", [("alltoall", "shared")]),
        ("cp2 pp2 ep2 etp1 cp_comm=a2a", [("alltoall", "shared")]),
        *PLACEMENTS,
    ],
}


def matrix_for(world: int) -> list[tuple[str, list[tuple[str, str]]]]:
    """The layouts for ``world`` ranks: the 8-rank matrix on >= 8, the 4-rank one on 4..7."""
    if world >= 8:
        return MATRIX[8]
    if world >= 4:
        return MATRIX[4]
    raise SystemExit(f"--world {world}: this matrix needs at least 4 ranks (2-rank layouts run in the CPU suite "
                     "and bench/executor_gpu.py --parts check)")


def run_layout(label: str, world: int, runs: list[tuple[str, str]], device: str, rtol: float) -> dict:
    """Launch one world for ``label`` and compare each run with its single-process reference."""
    configs, scenarios = [], []
    for dispatcher, name in runs:
        model, options = SCENARIOS[name]
        configs.append(ParallelConfig.parse(label, world_size=world).replace(moe_token_dispatcher_type=dispatcher))
        scenarios.append(Scenario(name, model, options, device=device, steps=3, global_batch_size=8))  # dp <= 8
    start = time.monotonic()
    launched = launch(layout_worker, world, (list(zip(configs, scenarios)),),
                      backend="nccl" if device == "cuda" else "gloo", timeout_s=300)
    out = {"layout": label, "world": world, "seconds": None, "runs": []}
    if not launched.ok:
        out.update(ok=False, reason=launched.failure_reason)
        return out
    out["seconds"] = round(time.monotonic() - start, 1)
    for (dispatcher, name), config, scenario, got in zip(runs, configs, scenarios, launched.results[0]["results"]):
        ref = reference(config, scenario)
        problems = compare(ref, got, rtol=rtol, atol=1e-5)
        judged = [p for p in problems if not p.startswith("params")]
        out["runs"].append({"dispatcher": dispatcher, "scenario": name, "ok": not judged, "problems": judged[:6],
                            "params_beyond_tolerance": len(problems) - len(judged),
                            "loss": got["loss"], "reference_loss": ref["loss"]})
    out["ok"] = all(r["ok"] for r in out["runs"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world", type=int, help="ranks (default: every GPU; 4 on CPU)")
    parser.add_argument("--only", help="comma list of layouts of the matrix to run")
    parser.add_argument("--rtol", type=float, default=2e-3)
    parser.add_argument("--out", help="JSON file (default: $OUT/nccl_equivalence.json or bench/results/...)")
    args = parser.parse_args()
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 4)
    matrix = matrix_for(world)
    if args.only:
        wanted = {w.strip() for w in args.only.split(",")}
        unknown = wanted - {label for label, _ in matrix}
        if unknown:
            raise SystemExit(f"--only: {sorted(unknown)} not in the {world}-rank matrix {[lb for lb, _ in matrix]}")
        matrix = [(label, runs) for label, runs in matrix if label in wanted]
    device_name = (f"{world}x {torch.cuda.get_device_name(0)}" if args.device == "cuda"
                   else f"{world} CPU ranks (gloo)")
    report = {"device": device_name, "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(sys.argv), "rtol": args.rtol, "layouts": []}
    path = Path(args.out) if args.out else (Path(os.environ["OUT"]) / "nccl_equivalence.json" if os.environ.get("OUT")
                                            else Path(__file__).parent / "results" / "nccl_equivalence.json")
    print(f"{'layout':<24} {'dispatcher/scenario':<22} {'result':<6} loss (step 1..3) vs reference", flush=True)
    for label, runs in matrix:
        result = run_layout(label, world, runs, args.device, args.rtol)
        report["layouts"].append(result)
        if "runs" in result and result["runs"]:
            for r in result["runs"]:
                losses = " ".join(f"{a:.6f}/{b:.6f}" for a, b in zip(r["loss"], r["reference_loss"]))
                print(f"{label:<24} {r['dispatcher'] + '/' + r['scenario']:<22} {'ok' if r['ok'] else 'FAIL':<6} "
                      f"{losses}" + ("" if r["ok"] else f"  {r['problems'][:2]}"), flush=True)
        else:
            print(f"{label:<24} {'-':<22} FAIL   {result.get('reason')}", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
    report["ok"] = all(layout["ok"] for layout in report["layouts"])
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'all equal' if report['ok'] else 'SOME LAYOUTS DIFFER'}; wrote {path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
