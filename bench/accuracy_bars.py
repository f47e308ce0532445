"""Issue 16's accuracy bars over a proxy's stored 1- and 2-GPU layout tables together (no device needed).

Each table is priced on its own cluster (its GPU count) with each given profile, then the rows are pooled:
step-time MAPE and Spearman over all layouts (the bar: >= 20 layouts on 1-2 GPUs), and, because pooling 1-
and 2-GPU layouts ranks mostly by GPU count, the 2-GPU rows' Spearman beside it; peak memory within 5 % and
never under by more than 5 %.

    python -m bench.accuracy_bars --model mixtral-8x7b --tables T1[,T1b],T2 \\
        --profile calibrated=P.json --profile components=Pc.json --gpu h200
"""

from __future__ import annotations

import argparse
import json
import sys

from planner.accuracy import merge_tables, pooled


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tables", required=True, help="comma list of layout tables; shards of one GPU count merge")
    p.add_argument("--profile", action="append", default=[], metavar="NAME=FILE", help="a profile to price with")
    p.add_argument("--gpu", help="also price with this catalog (datasheet) profile")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--gbs", type=int, default=8)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--out", help="JSON of the summaries")
    args = p.parse_args()
    by_size: dict[int, list[dict]] = {}
    for path in args.tables.split(","):
        table = json.load(open(path))
        by_size.setdefault(table["world_size"], []).append(table)
    tables = [ts[0] if len(ts) == 1 else merge_tables(ts, ts[0]["model"], "merged shards") for ts in by_size.values()]
    pricings = [(name, {"profile": path}) for name, path in (x.split("=", 1) for x in args.profile)]
    if args.gpu:
        pricings.append((f"datasheet {args.gpu}", {"gpu": args.gpu}))
    out = {}
    for name, hardware in pricings:
        s = pooled(args.model, args.layers, tables, args.seq, args.gbs, args.precision, **hardware)
        out[name] = {k: v for k, v in s.items() if k != "rows"}
        out[name]["rows"] = [{k: r[k] for k in ("layout", "gpus", "measured_s", "predicted_s", "error")}
                             | ({"memory_error": r["memory_error"]} if "memory_error" in r else {})
                             for r in s["rows"]]
        mem = ("" if s["memory_mape"] is None else
               f"; memory MAPE {100 * s['memory_mape']:.1f} %, worst under {100 * s['memory_worst_under']:+.1f} %")
        print(f"{args.model}@{args.layers}L {name}: {s['layouts']} layouts, step-time MAPE {100 * s['mape']:.1f} % "
              f"(max {100 * s['max_error']:.1f} %), Spearman {s['spearman']:.3f}"
              + (f"; 2-GPU rows MAPE {100 * s['mape_2gpu']:.1f} %, Spearman {s['spearman_2gpu']:.3f}"
                 if s["mape_2gpu"] is not None else "") + mem)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
