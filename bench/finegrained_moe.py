"""Fine-grained MoE at scale, measured on one GPU (issue 37): what a rank holding many small experts pays.

For DeepSeek-V3 (hidden 7168, 256 experts of FFN 2048, top-8, sigmoid group routing) and Qwen3-30B-A3B (hidden
2048, 128 experts of FFN 768, top-8) at their real widths (one MoE layer, no shared expert), for ranks holding 4,
8, 16, 32 and 64 local experts (EP = experts / local: the rank of an EP layout on a one-rank slice, router over
all experts, even routing) and a few token counts, this measures (``executor/microbench/finegrained.py``):

* the host's seconds to issue one MoE layer forward + backward against its local experts, for the executor
  (grouped GEMMs) and for one GEMM launch per expert and pass (as TE's GroupedLinear): the per-expert slope;
* the router alone (GEMM over all experts, scores, top-k, aux loss), device time;
* the layer's phases in a step: permutation (dispatch + combine), experts (grouped GEMMs + SwiGLU), the
  exchange stub (split-size sync, receive buffers; no bytes move on one GPU), and the steady step;

and prints each against the cost model's prediction term by term (``costmodel/finegrained.py``, on the detected
GPU's catalog profile or ``--profile``), with the top-8 exchange's per-peer message sizes at EP 8/16/32/64 and the
seconds the model prices for them. The exchange's latency between GPUs needs two or more GPUs and is not
measured here. It also derives the profile fields ``foldtune calibrate finegrained`` loads
(``costmodel/calibrate/finegrained.py``).

Usage (one H200, about 1-3 minutes; torch and this repository only):
    PYTHONPATH=. python3 bench/finegrained_moe.py --out $OUT/finegrained_h200.json
    PYTHONPATH=. python3 bench/finegrained_moe.py --quick --out $OUT/finegrained_h200_quick.json
then, on any machine:
    foldtune calibrate finegrained --profile P.json --from-file bench/results/finegrained_h200.json --out P2.json
    PYTHONPATH=. python3 bench/finegrained_moe.py --render bench/results/finegrained_h200.json --doc
(``--render`` prints the tables of a stored run, ``--doc`` writes them into docs/benchmarks.md.)
``--tiny``: the tiny proxies at a few tokens on the CPU: a smoke test of the script, no timing claim.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.report import ROOT, machine, replace_section, utc_now
from costmodel.calibrate import finegrained as calib
from costmodel.finegrained import EXCHANGE_EPS, LOCAL_EXPERTS, MODELS, exchange_messages, routed_proxy
from costmodel.host import seconds_per_op
from spec.catalog import get_hardware
from spec.profile_io import load_profile

HEADING = "## Fine-grained MoE on one GPU: per-expert host cost, router, permutation, top-8 exchange sizes"
METHOD = (
    "What a GPU holding many small experts pays, at real widths on one GPU (`bench/finegrained_moe.py`, "
    "`executor/microbench/finegrained.py`; priced by `costmodel/finegrained.py`). DeepSeek-V3 and Qwen3-30B-A3B MoE "
    "layers (no shared expert); a rank holding L local experts is the rank of an EP = experts / L layout on a "
    "one-rank slice (router over all experts, even top-8 routing, collectives moving nothing). Router: the router "
    "alone, forward + backward, device time with the host ahead. Permutation, experts, exchange stub: the layer's "
    "phase markers in a forward + backward queued behind 3 ms of GPU sleep (median of 5); the exchange stub is the "
    "split-size read (a host sync) and the receive buffers, no bytes cross a link. Host: the host's seconds to issue "
    "one forward + backward at 128 tokens of the executor layer with L experts on one rank (grouped GEMMs) and of a "
    "loop of one GEMM launch per expert and pass (6 per expert, as TE's GroupedLinear); their slopes over L are the "
    "seconds per local expert. The exchange between GPUs is priced only (message sizes per peer under uniform "
    "routing): measuring its latency needs two or more GPUs. `foldtune calibrate finegrained --from-file` loads the "
    "derived fields into a profile (docs/component-calibration.md).")
TOKENS = (1024, 4096, 16384)
QUICK_LOCAL = (4, 16, 64)
QUICK_TOKENS = (4096,)
HOST_TOKENS = 128
EXCHANGE_TOKENS = 4096
TINY_LOCAL = (2, 4)
TINY_TOKENS = (16, 64)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma list of catalog models")
    p.add_argument("--local-experts", default=None, help=f"comma list (default {LOCAL_EXPERTS}; quick {QUICK_LOCAL})")
    p.add_argument("--tokens", default=None,
                   help=f"tokens per rank, comma list (default {TOKENS}; quick {QUICK_TOKENS})")
    p.add_argument("--host-tokens", type=int, default=HOST_TOKENS, help="tokens of the host probe (few)")
    p.add_argument("--quick", action="store_true", help="local experts 4, 16, 64 at 4096 tokens")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny proxies, a few tokens")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--profile", default=None, help="price against this profile file (default: the detected GPU's "
                                                   "catalog profile)")
    p.add_argument("--budget-s", type=float, default=150.0,
                   help="stop starting new points after this many seconds (the rest are listed as skipped)")
    p.add_argument("--out", default=None, help="write the JSON here (default bench/results/finegrained.json)")
    p.add_argument("--render", default=None, metavar="JSON", help="no measurement: print a stored run's tables")
    p.add_argument("--doc", action="store_true", help="with --render: write the section of docs/benchmarks.md")
    return p.parse_args(argv)


def _ints(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return default if not text else tuple(int(v) for v in text.split(","))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def measure(args: argparse.Namespace) -> dict:
    """Run the plan on the device; the JSON record (``costmodel.calibrate.finegrained.RECORD_KIND``)."""
    import torch

    from executor.microbench.finegrained import FinePlan, run_plan

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = [n + "@tiny" if args.tiny else n for n in args.models.split(",")]
    local = _ints(args.local_experts, TINY_LOCAL if args.tiny else QUICK_LOCAL if args.quick else LOCAL_EXPERTS)
    tokens = _ints(args.tokens, TINY_TOKENS if args.tiny else QUICK_TOKENS if args.quick else TOKENS)
    host_tokens = min(args.host_tokens, 16) if args.tiny else args.host_tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    plan = FinePlan(tuple(routed_proxy(n) for n in names), local, tokens, host_tokens,
                    steps=3 if args.tiny else 5, host_repeats=3 if args.tiny else 7)
    started = time.perf_counter()
    record: dict = {"kind": calib.RECORD_KIND, "measured_at": utc_now(), "machine": machine(),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
                    or "cpu", "torch": torch.__version__, "commit": _commit(), "argv": sys.argv[1:],
                    "precision": "bf16" if dtype == torch.bfloat16 else "fp32",
                    "plan": {"models": names, "local_experts": list(local), "tokens": list(tokens),
                             "host_tokens": host_tokens}}
    print(f"fine-grained MoE on {record['device']}: {', '.join(names)}; local experts {list(local)}; tokens "
          f"{list(tokens)}; host probe at {host_tokens} tokens; budget {args.budget_s:.0f} s", flush=True)
    record.update(run_plan(plan, device, dtype, lambda line: print(line, flush=True), args.budget_s))
    record["seconds"] = time.perf_counter() - started
    return record


def _profile(args: argparse.Namespace, record: dict):
    if args.profile:
        return load_profile(args.profile)
    if record.get("priced_on_catalog"):
        return get_hardware(record["priced_on_catalog"])
    from api.cli._shape_args import guess_gpu

    device = record.get("device", "cpu")
    return get_hardware("cpu" if record.get("precision") == "fp32" else guess_gpu(device))


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def tables(record: dict, hardware) -> list[str]:
    """Markdown tables of a record against ``hardware``: points, host, exchange sizes, derived fields."""
    cmp = calib.comparison(record, hardware)
    lines = ["| model | local experts | EP | tokens | router meas./priced (ms) | permutation meas./priced (ms) | "
             "experts meas./priced (ms) | exchange stub (ms) | step (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in cmp["points"]:
        lines.append(f"| {r['model']} | {r['local_experts']} | {r['ep']} | {r['tokens']} | {_ms(r['router_s'])} / "
                     f"{_ms(r['router_priced_s'])} | {_ms(r['permutation_s'])} / {_ms(r['permutation_priced_s'])} | "
                     f"{_ms(r['experts_s'])} / {_ms(r['experts_priced_s'])} | {_ms(r['exchange_stub_s'])} | "
                     f"{_ms(r['step_s'])} |")
    lines += ["", "| model | local experts | host tokens | executor layer host meas./priced (ms) | "
                  "per-expert launches host (ms) | priced per expert: executor / per-expert launches (ms) |",
              "|---|---:|---:|---:|---:|---:|"]
    for h in cmp["host"]:
        lines.append(f"| {h['model']} | {h['local_experts']} | {h['tokens']} | {_ms(h['layer_host_s'])} / "
                     f"{_ms(h['layer_host_priced_s'])} | {_ms(h['loop_host_s'])} | {_ms(h['per_expert_priced_s'])} / "
                     f"{_ms(h['loop_per_expert_priced_s'])} |")
    lines += ["", f"Top-k exchange (top-8 for the real models) at {EXCHANGE_TOKENS} tokens per rank, uniform "
                  f"routing, bf16 rows; priced on {hardware.name} ({hardware.gpus_per_node} GPUs per node; one "
                  "all-to-all of the dispatch, a layer issues four; one flex pass), not measured: the latency "
                  "between GPUs needs two or more GPUs.", "",
              "| model | EP | nodes | alltoall per peer (MiB) | alltoall sent (MiB) | alltoall priced (ms) | "
              "flex per peer (MiB) | flex pass priced (ms) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in record["plan"]["models"]:
        for row in exchange_messages(name, EXCHANGE_TOKENS, hardware, EXCHANGE_EPS):
            lines.append(f"| {name} | {row.ep} | {row.nodes} | {row.alltoall_peer_bytes / 2**20:.2f} | "
                         f"{row.alltoall_send_bytes / 2**20:.1f} | {_ms(row.alltoall_dispatch_s)} | "
                         f"{row.flex_peer_bytes / 2**20:.2f} | {_ms(row.flex_dispatch_s)} |")
    factors = calib.derive(record, hardware)
    lines += ["", "Derived for `foldtune calibrate finegrained` (against this profile): " + ", ".join(
        f"{k} {'-' if v is None else f'{v:.4g}'}" for k, v in factors.fields().items())
        + f" (host slopes as fitted: executor {factors.basis['local_expert_host_s_fit']}, per-expert launches "
          f"{factors.basis['expert_loop_host_s_fit']} s per local expert"
        + ("" if factors.expert_loop_host_s is None else
           f", {factors.expert_loop_host_s / 6 * 1e6:.2f} us per GEMM launch of the loop, 6 per expert")
        + f"; the model's per-op cost on this profile: {seconds_per_op(hardware) * 1e6:.2f} us)."]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.doc and not args.render:
        print("--doc writes a stored run only: pass --render FILE (numbers in the docs come from a named file)")
        return 2
    if args.render:
        record = calib.check_record(json.loads(Path(args.render).read_text()), args.render)
        hardware = _profile(args, record)
    else:
        record = measure(args)
        out = Path(args.out) if args.out else ROOT / "bench" / "results" / "finegrained.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")  # the raw seconds first: pricing cannot lose them
        print(f"wrote {out} (raw seconds)", flush=True)
        hardware = _profile(args, record)
        derived = calib.derive(record, hardware)
        record["priced_on"] = hardware.name
        record["exchange"] = [asdict(row) for name in record["plan"]["models"]
                              for row in exchange_messages(name, EXCHANGE_TOKENS, hardware, EXCHANGE_EPS)]
        record["derived"] = {**derived.fields(), **derived.basis}
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out} (with the prices on {hardware.name})")
    text = tables(record, hardware)
    print("\n".join(text))
    if record.get("skipped"):
        print("skipped: " + "; ".join(record["skipped"]))
    if args.doc:
        head = (f"`PYTHONPATH=. python3 bench/finegrained_moe.py {' '.join(record.get('argv') or [])}` on "
                f"{record.get('machine')} ({record.get('device')}), {record.get('measured_at')}, commit "
                f"{record.get('commit')}, torch {record.get('torch')}, {record.get('seconds', 0):.0f} s; file "
                f"`{args.render}`; priced on `{hardware.name}`.")
        replace_section(HEADING, "\n".join([HEADING, "", METHOD, "", head, "", *text]))
        print(f"wrote the section {HEADING!r} of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
