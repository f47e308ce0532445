"""Does the GPU keep its clock under sustained tensor-core work, and does that move the MoE bar's timings?

Microbenchmarks (``foldtune calibrate``) and the device-time figures of bench/moe_breakdown.py time short
bursts; a training step, and the bar's steady-state windows, keep the tensor cores busy for seconds. If the
card lowers its SM clock under that load (power or thermal limit), a burst overstates sustained throughput,
and two timings taken one after the other drift apart for no reason in the code. This probe measures it:

- ``gemm``: a bf16 and an fp8 (``torch._scaled_mm``, per-tensor scales) 8192³ GEMM run back to back for
  ``--seconds`` each by calibrate's own sustained run (executor/microbench/sustained.py: a burst timed as the
  GEMM curve is, then ~50 ms windows): TFLOP/s per window, first, median, last, settled;
- ``moe``: the Mixtral MoE layer (router, dispatch, experts, combine; random router) and the bar's ideal
  (bench/executor_gpu.py) alternated in steady-state windows of 20 fwd+bwd, ``--rounds`` times, with every
  pass's own time inside the window (events between passes, no sync), so drift and stalls show;
- nvidia-smi sampled every 100 ms throughout (SM clock, power, temperature, throttle reasons): the
  summary gives each part's clock and power.

Usage (GPU): python3 -m bench.power_probe [--parts gemm,moe] [--seconds 3] [--rounds 6] --out probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from executor.microbench.moe_bar import MOE_SHAPES, SEQ, bar_inputs, ideal_fwd_bwd, layer_fwd_bwd
from executor.microbench.sustained import WINDOW_S, measure_sustained

SMI_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


class SmiSampler:
    """nvidia-smi polled every ``period_ms`` into a temp file; :meth:`between` returns the samples of a span."""

    def __init__(self, gpu: int, period_ms: int = 100):
        self.file = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--id={gpu}", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits",
                 f"-lms={period_ms}"], stdout=self.file, stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None

    def samples(self) -> list[dict]:
        self.file.flush()
        out = []
        with open(self.file.name) as f:
            for line in f:
                parts = [p.strip() for p in line.split(",")]
                if len(parts) < 5:
                    continue
                try:
                    ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                    out.append({"t": ts, "sm_mhz": float(parts[1]), "power_w": float(parts[2]),
                                "temp_c": float(parts[3]), "reasons": parts[4]})
                except ValueError:
                    continue
        return out

    def between(self, t0: float, t1: float) -> dict:
        """Median SM clock (MHz), power (W) and last temperature over wall span [t0, t1] (time.time())."""
        time.sleep(0.25)  # let the poller write the span's last samples
        rows = [s for s in self.samples() if t0 <= s["t"] <= t1]
        if not rows:
            return {"samples": 0}
        return {"samples": len(rows), "sm_mhz_median": statistics.median(r["sm_mhz"] for r in rows),
                "sm_mhz_min": min(r["sm_mhz"] for r in rows), "power_w_median": statistics.median(r["power_w"] for r in rows),
                "temp_c_last": rows[-1]["temp_c"], "reasons": sorted({r["reasons"] for r in rows})}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=5)
        os.unlink(self.file.name)


def part_gemm(smi: SmiSampler, seconds: float) -> dict:
    n = 8192
    dev = torch.device("cuda")
    per_second = max(1, round(1 / WINDOW_S))
    result = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        time.sleep(2.0)  # an idle gap first, as a calibration's burst starts from
        t0 = time.time()
        run = measure_sustained(dev, dtype, seconds, n)  # calibrate's own sustained run, windows kept
        t1 = time.time()
        tf = [rate / 1e12 for rate in run["windows_flops_per_s"]]
        # the last 10 s (or the second half of a shorter run): where the clock has settled
        settled = tf[-max(1, min(len(tf) // 2, 10 * per_second)):]
        result[name] = {"windows": len(tf), "window_s": WINDOW_S, "burst_tflops": run["burst_flops_per_s"] / 1e12,
                        "tflops_first": tf[0], "tflops_median": statistics.median(tf),
                        "tflops_settled_median": statistics.median(settled),
                        "tflops_by_second": [round(statistics.median(tf[i:i + per_second]), 1)
                                             for i in range(0, len(tf), per_second)],
                        "tflops_last": tf[-1], "tflops_min": min(tf), "tflops_max": max(tf),
                        "tflops_by_window": [round(x, 1) for x in tf], "smi": smi.between(t0, t1),
                        "smi_settled": smi.between(max(t0, t1 - 10), t1)}
        print(f"{name:>5} GEMM {n}³ over {seconds:.0f} s: burst {result[name]['burst_tflops']:.0f}  first {tf[0]:.0f}  "
              f"median {statistics.median(tf):.0f}  last {tf[-1]:.0f}  settled {statistics.median(settled):.0f} TFLOP/s  "
              f"smi {result[name]['smi']}  settled {result[name]['smi_settled']}", flush=True)
    return result


def part_moe(smi: SmiSampler, rounds: int, iters: int = 20) -> dict:
    bar = bar_inputs(MOE_SHAPES["mixtral"].spec, SEQ, 1, torch.device("cuda"), torch.bfloat16)
    layer = bar.layer
    layer_step, ideal_step = layer_fwd_bwd(layer, bar.x, bar.gy), ideal_fwd_bwd(bar.ideal, bar.xs, bar.gs, bar.balanced)

    for fn in (layer_step, ideal_step, layer_step, ideal_step):
        fn()
    torch.cuda.synchronize()

    def window(fn) -> dict:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        for _ in range(3):  # lead calls: the GPU is busy when the first event is recorded
            fn()
        t0 = time.time()
        events[0].record()
        for i in range(iters):
            fn()
            events[i + 1].record()
        events[-1].synchronize()
        t1 = time.time()
        per = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(iters)]
        return {"mean_s": events[0].elapsed_time(events[-1]) / 1e3 / iters, "per_pass_ms": [round(p * 1e3, 3) for p in per],
                "smi": smi.between(t0, t1)}

    out = {"layer": [], "ideal": []}
    for r in range(rounds):
        order = (("layer", layer_step), ("ideal", ideal_step)) if r % 2 == 0 else (("ideal", ideal_step), ("layer", layer_step))
        for name, fn in order:
            out[name].append(window(fn))
    ratios = [i["mean_s"] / l["mean_s"] for l, i in zip(out["layer"], out["ideal"])]
    out["ratio_by_round"] = ratios
    out["ratio_median"] = statistics.median(ratios)
    out["layer_median_s"] = statistics.median(w["mean_s"] for w in out["layer"])
    out["ideal_median_s"] = statistics.median(w["mean_s"] for w in out["ideal"])
    counts = layer.last_tokens_per_expert.float()
    out["imbalance_max_over_mean"] = float(counts.max() / counts.mean())
    print(f"Mixtral MoE layer vs ideal, alternated windows of {iters}: ratio by round "
          + " ".join(f"{r:.3f}" for r in ratios) + f"; median {out['ratio_median']:.3f}", flush=True)
    for name in ("layer", "ideal"):
        for w in out[name]:
            p = w["per_pass_ms"]
            print(f"  {name:>5} mean {w['mean_s'] * 1e3:.2f} ms  passes min {min(p):.2f} med {statistics.median(p):.2f} "
                  f"max {max(p):.2f}  smi {w['smi'].get('sm_mhz_median')} MHz {w['smi'].get('power_w_median')} W", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="gemm,moe")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default="power_probe.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("power_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
    smi = SmiSampler(gpu)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    try:
        for part in args.parts.split(","):
            if part == "gemm":
                result["gemm"] = part_gemm(smi, args.seconds)
            elif part == "moe":
                result["moe"] = part_moe(smi, args.rounds)
            else:
                print(f"unknown part {part!r}; known: gemm, moe", file=sys.stderr)
                return 2
    finally:
        smi.close()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
