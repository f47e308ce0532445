"""Component factors from a stored 1-GPU layout table's phases (no device needed).

Takes the row of one 1-GPU layout (default: no recompute, mbs 1) of a layout table (``executor.profile_table``) /
``bench.costmodel_accuracy`` table, reads its per-phase step times as component seconds
(:mod:`costmodel.calibrate.step_phases`), compares them with ``--profile``'s prediction and writes a
component-run file that ``foldtune calibrate merge`` takes, as a ``calibrate --model`` run would:

    python -m bench.instep_components --model deepseek-v2-lite --tables T1-shard0.json,T1-shard1.json \\
        --profile h200-calibrated.json --out comp-deepseek-v2-lite.json
    foldtune calibrate merge --profile h200-calibrated.json --components comp-*.json --out merged.json
"""

from __future__ import annotations

import argparse
import json
import sys

from planner.accuracy import merge_tables
from costmodel.calibrate.step_phases import report_from_phases
from spec.catalog import get_model
from spec.profile_io import load_profile

DEFAULT_LAYOUT = "tp1 cp1 pp1 vpp1 ep1 etp1 dp1 edp1 mbs1"


def report_from_row(spec, row: dict, training: dict, hardware, device: str | None = None):
    """The component report of one measured 1-GPU table ``row`` (its ``config`` and ``phases``) priced on
    ``hardware``; ``training`` is the table's training dict (seq_length, global_batch_size, precision)."""
    config = row["config"]
    if config["world_size"] != 1 or config["recompute_granularity"] != "none":
        raise ValueError(f"{row['layout']}: in-step components need a 1-GPU layout without recomputation")
    mbs = config["micro_batch_size"]
    return report_from_phases(spec, training["seq_length"], mbs, training["precision"],
                              device or row.get("device", "?"), row["phases"], training["global_batch_size"] // mbs,
                              hardware)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tables", required=True, help="comma list of 1-GPU table shards")
    p.add_argument("--profile", required=True, help="profile whose prediction the factors correct")
    p.add_argument("--layout", default=DEFAULT_LAYOUT, help=f"the row to read (default {DEFAULT_LAYOUT!r})")
    p.add_argument("--out", required=True, help="component-run JSON for foldtune calibrate merge")
    args = p.parse_args()
    spec = get_model(args.model).with_layers(args.layers)
    tables = [json.load(open(path)) for path in args.tables.split(",")]
    table = merge_tables(tables, spec.name, args.tables)
    rows = [r for r in table["rows"] if r["layout"] == args.layout and r["ok"]]
    if not rows:
        raise SystemExit(f"no measured row {args.layout!r} in {args.tables}")
    profile = load_profile(args.profile)
    report = report_from_row(spec, rows[0], table["training"], profile)
    for c in report.components:
        scale = 1e3 if c.name != "optimizer" else 1e9
        print(f"  {c.name:<10} measured {c.measured_s * scale:8.3f}  predicted {c.predicted_s * scale:8.3f}  "
              f"ratio {c.ratio:.3f}" + ("  (ms per 1M parameters)" if c.name == "optimizer" else "  ms"))
    print(f"{report.key} factors: " + ", ".join(f"{t} {f:.3f}" for t, f in report.factors.items()))
    with open(args.out, "w") as f:
        json.dump({"raw": {"components": report.to_dict(), "source": {"tables": args.tables, "layout": args.layout}}},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
