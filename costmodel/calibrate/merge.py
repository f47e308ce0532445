"""Put the component measurements of several ``foldtune calibrate --model`` runs into one machine profile.

A component run (one GPU, one model shape) saves its measured seconds beside a profile of its own. Its
factors are ratios against *that* profile's prediction. This script recomputes every shape's factors
against the target profile (the machine calibration the planner will use) from the stored measured
seconds, so the factors and the curves they correct come from the same profile. Nothing end-to-end goes in.

    python3 bench/merge_components.py --profile machine.json --components a.json,b.json --out merged.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec.catalog import get_model  # noqa: E402
from costmodel.component_factors import build_report  # noqa: E402
from spec.hardware import HardwareProfile  # noqa: E402
from spec.profile_io import load_profile, save_profile  # noqa: E402


def model_of(name: str):
    """The catalog model of a report's name: 'mixtral-8x7b' or a proxy 'mixtral-8x7b@2L'."""
    base, _, layers = name.partition("@")
    spec = get_model(base)
    return spec.with_layers(int(layers[:-1])) if layers.endswith("L") and layers[:-1].isdigit() else spec


def merged_profile(target: HardwareProfile, reports: list[dict]) -> tuple[HardwareProfile, list]:
    """``target`` with one component-factor entry per report, each recomputed against ``target``."""
    factors = {k: dict(v) for k, v in target.component_factors}
    rebuilt = []
    for r in reports:
        measured = {c["name"]: c["measured_s"] for c in r["components"]}
        report = build_report(model_of(r["model"]), r["seq_length"], r["micro_batch_size"], r["precision"],
                              r["device"], measured, target)
        factors[report.key] = report.factors
        rebuilt.append(report)
    return replace(target, component_factors=factors), rebuilt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="target machine profile (JSON from foldtune calibrate)")
    parser.add_argument("--components", required=True, help="comma list of component-run profile files")
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", help="name of the merged profile (default: the target's name)")
    args = parser.parse_args(argv)
    reports = []
    for path in args.components.split(","):
        raw = json.loads(Path(path).read_text()).get("raw") or {}
        if "components" not in raw:
            print(f"{path}: no component measurements (run foldtune calibrate --model ...)", file=sys.stderr)
            return 2
        reports.append(raw["components"])
    target = load_profile(args.profile)
    profile, rebuilt = merged_profile(replace(target, name=args.name or target.name), reports)
    for report in rebuilt:
        print(f"{report.key}: " + ", ".join(f"{c.name} {c.measured_s * 1e3:.3f}/{c.predicted_s * 1e3:.3f} ms"
                                            for c in report.components if c.name != "optimizer")
              + " | factors " + ", ".join(f"{t} {f:.3f}" for t, f in report.factors.items()))
    save_profile(profile, args.out)
    print(f"wrote {args.out} ({len(profile.component_factors)} component shapes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
