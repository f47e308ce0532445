"""FP8 training GEMMs (executor/kernels/fp8/) on a GPU: kernels against their emulation, speed, a profile.

Parts (``--parts agree,speed,profile``, all by default):
- ``agree``: ``torch._scaled_grouped_mm`` / ``torch._scaled_mm`` against the emulation (same quantisation,
  fp32 matmul of the dequantised operands) and both against the fp32 product of the unquantised operands:
  the expert GEMM (h 4096, 2·f 28672 — Mixtral's fused gate/up — 8 experts, 8192 rows with random
  routing, group sizes no multiples of 16) forward, dgrad and wgrad, and a dense linear (8192×4096 ·
  14336×4096) forward, dgrad and wgrad. "beyond" is the fraction of elements differing by more than the
  self-check's tolerance (2^-7 relative + 1e-3 of the largest);
- ``speed``: forward and forward+backward of the expert FFN (w13 grouped GEMM, SwiGLU, w2 grouped GEMM;
  8192 rows, balanced routing) and of the dense linear, steady state (back-to-back iterations between two
  CUDA events), in bf16 ('torch') and four fp8 ('torch-fp8') variants: ``fp8_torch_quant`` (torch-op
  quantisation, no weight cache: the code before the Triton quantisation and the cache,
  FOLDTUNE_FP8_TRITON=0 FOLDTUNE_FP8_WEIGHT_CACHE=0), ``fp8_uncached`` (Triton quantisation, weights
  quantised on every call: what a step of one micro-batch pays), ``fp8`` (Triton and the weight cache,
  which in this loop serves every call: a later micro-batch of a step) and ``fp8_fp8_wgrad`` (``fp8``
  with FOLDTUNE_FP8_WGRAD=fp8: the expert wgrad in fp8 too; the default runs it in bf16); plus each quantisation alone by the torch ops, by Triton (one kernel for
  row-contiguous operands) and by Triton's two-pass path (torch's amax, then the Triton cast), both forms of
  w13 and of the dense dy as two rowwise quantisations against one ``quantize_both``, the w13
  forward GEMM alone (bf16 vs fp8 on quantised operands), and the FFN fwd+bwd at 1, 2 and 4 times the rows;
- ``profile``: ``executor.profile`` of mixtral-8x7b with 2 layers, seq 4096, 1 GPU, one micro-batch per
  step (global batch 1) in bf16, fp8 and fp8_torch_quant, and four micro-batches (global batch 4, where the
  cache saves three of every four weight quantisations) in bf16 and fp8 (step time, MFU against the
  precision's peak, peak memory); ``--profile-runs`` picks among them. The JSON is saved after each run.
``--device cpu --tiny``: the same at toy sizes on CPU (emulated fp8, tiny-moe profile): a smoke test.
The JSON (--out) is rewritten after every part; a short table is printed at the end.

Usage (GPU): python3 -m bench.fp8_check --out fp8.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import warnings

import torch

from executor.microbench.timing import time_steady_window
from executor.kernels import fp8, get_backend
from executor.kernels.fp8 import quantize
from executor.kernels.torch_backend import TorchBackend
from executor.moe import expert_swiglu
from executor.options import ExecutorOptions
from executor.profile import profile_layout
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

BF16 = torch.bfloat16
# speed variants: (label, kernel backend, environment while it runs)
VARIANTS = (("bf16", "torch", {}),
            ("fp8_torch_quant", "torch-fp8", {"FOLDTUNE_FP8_TRITON": "0", "FOLDTUNE_FP8_WEIGHT_CACHE": "0"}),
            ("fp8_uncached", "torch-fp8", {"FOLDTUNE_FP8_WEIGHT_CACHE": "0"}),
            ("fp8", "torch-fp8", {}),
            ("fp8_fp8_wgrad", "torch-fp8", {"FOLDTUNE_FP8_WGRAD": "fp8"}))
QUANTISERS = {"torch": {"rowwise": lambda t, _: quantize._quantize_rowwise_torch(t),
                        "groups": quantize._quantize_groups_colwise_torch},
              "triton": {"rowwise": lambda t, _: quantize._quantize_rowwise_triton(t),
                         "groups": quantize._quantize_groups_colwise_triton}}
# profile runs: (label, precision, global batch, environment of the ranks)
PROFILE_RUNS = (("bf16", "bf16", 1, {}), ("fp8", "fp8", 1, {}),
                ("fp8_torch_quant", "fp8", 1, {"FOLDTUNE_FP8_TRITON": "0", "FOLDTUNE_FP8_WEIGHT_CACHE": "0"}),
                ("bf16_gb4", "bf16", 4, {}), ("fp8_gb4", "fp8", 4, {}))
# (hidden, 2·ffn of the fused gate/up GEMM, experts, rows, dense linear's out features)
SHAPES = {"mixtral": (4096, 2 * 14336, 8, 8192, 14336), "tiny": (64, 2 * 96, 4, 200, 96)}


def _rand(*shape, device, seed):
    return torch.randn(*shape, device=device, generator=torch.Generator(device=device).manual_seed(seed)).to(BF16)


def _random_counts(rows: int, groups: int, device) -> torch.Tensor:
    """Routed rows per expert, uneven and (almost surely) no multiples of 16; they sum to ``rows``."""
    gen = torch.Generator().manual_seed(3)
    counts = torch.bincount(torch.randint(0, groups, (rows,), generator=gen), minlength=groups)
    return counts.to(device)


def _compare(kernel, emulated, exact) -> dict:
    k, e = kernel.float(), emulated.float()
    diff = (k - e).abs()
    top = float(e.abs().max())
    out = {"max_diff_over_max": float(diff.max()) / top,
           "beyond": float((diff > 2**-7 * e.abs() + 1e-3 * top).float().mean()),
           "rel_diff": float((k - e).norm() / e.norm()),
           "kernel_rel_err_vs_fp32": float((k - exact).norm() / exact.norm()),
           "emulated_rel_err_vs_fp32": float((e - exact).norm() / exact.norm())}
    out["ok"] = out["beyond"] == 0.0
    return out


def part_agree(dev: torch.device, shape) -> dict:
    """Kernel vs emulation vs fp32, per GEMM (kernel entries None where the device has no kernels)."""
    h, n2f, g, m, ffn = shape
    kernel = fp8.emulation_reason(dev) is None
    counts = _random_counts(m, g, dev)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x, w, dy = _rand(m, h, device=dev, seed=1), _rand(g, n2f, h, device=dev, seed=2), _rand(m, n2f, device=dev, seed=3)
    fp32 = TorchBackend()
    with warnings.catch_warnings(record=True) as said:  # the quantisation's first-use self-check speaks here
        warnings.simplefilter("always")
        triton_quantise = quantize._use_triton(dev)
    res = {"kernels": kernel, "emulated_because": fp8.emulation_reason(dev), "counts": counts.tolist(),
           "triton_quantise": triton_quantise, "triton_quantise_warnings": [str(msg.message) for msg in said]}

    def case(name, run, exact):
        emulated = run(False)
        try:
            got = run(True) if kernel else emulated
        except Exception as exc:  # noqa: BLE001 - a refused kernel is a result here, not the end of the run
            res[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600],
                         "emulated_rel_err_vs_fp32": float((emulated.float() - exact).norm() / exact.norm())}
            return
        res[name] = _compare(got, emulated, exact)
        if not kernel:
            res[name].update(ok=None, beyond=None, rel_diff=None, max_diff_over_max=None)

    case("grouped_fwd", lambda k: fp8.scaled_grouped_nt(x, w, offs, k), fp32.grouped_mm(x.float(), w.float(), offs))
    wt = w.transpose(-2, -1)
    case("grouped_dgrad", lambda k: fp8.scaled_grouped_nt(dy, wt, offs, k),
         fp32.grouped_mm(dy.float(), wt.float(), offs))
    bounds = [0, *offs.tolist()]
    exact_wgrad = torch.stack([dy[lo:hi].float().t() @ x[lo:hi].float() for lo, hi in zip(bounds, bounds[1:])])
    case("grouped_wgrad", lambda k: fp8.scaled_grouped_wgrad(dy, x, offs, k), exact_wgrad)
    del exact_wgrad, w, wt
    wd, dyd = _rand(ffn, h, device=dev, seed=4), _rand(m, ffn, device=dev, seed=5)
    case("linear_fwd", lambda k: fp8.scaled_mm_nt(x, wd, k), x.float() @ wd.float().t())
    case("linear_dgrad", lambda k: fp8.scaled_mm_nt(dyd, wd.t(), k), dyd.float() @ wd.float())
    case("linear_wgrad", lambda k: fp8.scaled_mm_nt(dyd.t(), x.t(), k), dyd.float().t() @ x.float())
    return res


def _timer(dev: torch.device):
    """seconds per call of fn(): ``warmup`` calls, a sync, then ``iters`` back to back between two CUDA events
    (:func:`executor.microbench.timing.time_steady_window` with no lead calls: the first call starts on an idle GPU)."""

    def run(fn, iters: int, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time_steady_window(fn, dev, iters, lead=0)

    return run


def _rows_sweep(dev, shape, w13, w2, timed, iters) -> dict:
    """Expert FFN fwd+bwd at 1, 2 and 4 times the rows (balanced) in bf16, fp8 with the weights quantised
    per call and fp8 with them cached: how the fp8 GEMMs' saving grows against the weights' quantisation
    passes, whose cost does not grow with the rows."""
    h, g, m = shape[0], shape[2], shape[3]
    out = {}
    for rows in (m, 2 * m, 4 * m):
        offs = torch.cumsum(torch.full((g,), rows // g, device=dev), 0, dtype=torch.int32)
        x = _rand(offs[-1].item(), h, device=dev, seed=1).requires_grad_()
        dy = _rand(x.shape[0], h, device=dev, seed=4)
        out[rows] = {}
        for label, backend_name, cache in (("bf16", "torch", "1"), ("fp8_uncached", "torch-fp8", "0"),
                                           ("fp8", "torch-fp8", "1")):
            be = get_backend(backend_name)
            os.environ["FOLDTUNE_FP8_WEIGHT_CACHE"] = cache

            def step():
                y = be.grouped_mm(expert_swiglu(be.grouped_mm(x, w13, offs)), w2, offs)
                torch.autograd.grad(y, (x, w13, w2), dy)

            out[rows][label] = timed(step, iters)
            os.environ.pop("FOLDTUNE_FP8_WEIGHT_CACHE")
            fp8.clear_weight_cache()
        del x, dy
    return out


def part_speed(dev: torch.device, shape, iters: int) -> dict:
    h, n2f, g, m, ffn = shape
    f = n2f // 2
    timed = _timer(dev)
    counts = torch.full((g,), m // g, device=dev)
    counts[-1] += m - int(counts.sum())
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = _rand(m, h, device=dev, seed=1).requires_grad_()
    w13 = _rand(g, n2f, h, device=dev, seed=2).mul_(0.02).requires_grad_()
    w2 = _rand(g, h, f, device=dev, seed=3).mul_(0.02).requires_grad_()
    dy = _rand(m, h, device=dev, seed=4)
    wd = _rand(ffn, h, device=dev, seed=5).mul_(0.02).requires_grad_()
    dyd = _rand(m, ffn, device=dev, seed=6)
    res = {}
    for label, backend_name, env in VARIANTS:
        os.environ.update(env)
        be = get_backend(backend_name)

        def ffn_fwd():
            return be.grouped_mm(expert_swiglu(be.grouped_mm(x, w13, offs)), w2, offs)

        def ffn_fwd_bwd():
            torch.autograd.grad(ffn_fwd(), (x, w13, w2), dy)

        def lin_fwd_bwd():
            torch.autograd.grad(be.linear(x, wd), (x, wd), dyd)

        try:
            with torch.no_grad():
                fwd = timed(ffn_fwd, iters)
                lin_fwd = timed(lambda: be.linear(x, wd), iters)
            res[label] = {"ffn_fwd_s": fwd, "ffn_fwd_bwd_s": timed(ffn_fwd_bwd, iters),
                          "linear_fwd_s": lin_fwd, "linear_fwd_bwd_s": timed(lin_fwd_bwd, iters)}
        except Exception as exc:  # noqa: BLE001 - recorded; the other variants still run
            res[label] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
        finally:
            for key in env:
                os.environ.pop(key)
            fp8.clear_weight_cache()
    groups = fp8.padded_groups(offs, m)
    big = _rand(m, n2f, device=dev, seed=7)
    cases = {"rowwise x [M, h]": ("rowwise", x), "rowwise w13 [G, 2f, h]": ("rowwise", w13),
             "rowwise w13ᵀ [G, h, 2f]": ("rowwise", w13.transpose(-2, -1)),
             "groups colwise dy [M, 2f]": ("groups", big)}
    with torch.no_grad():
        res["quantise_s"] = {"torch": {name: timed(lambda k=kind, t=t: QUANTISERS["torch"][k](t, groups), iters)
                                       for name, (kind, t) in cases.items()}}
        if quantize._use_triton(dev):
            res["quantise_s"]["triton"] = {
                name: timed(lambda k=kind, t=t: QUANTISERS["triton"][k](t, groups), iters)
                for name, (kind, t) in cases.items()}
            res["quantise_s"]["triton two-pass"] = {  # torch's amax, then the Triton cast
                name: timed(lambda t=t: quantize._quantize_rowwise_two_pass(t), iters)
                for name, (kind, t) in cases.items() if kind == "rowwise"}
            both = {"w13 [G, 2f, h]": w13, "dense dy [M, ffn]": dyd}  # forward + dgrad / dgrad + wgrad forms
            res["quantise_s"]["both forms: two rowwise"] = {
                name: timed(lambda t=t: (quantize._quantize_rowwise_triton(t),
                                         quantize._quantize_rowwise_triton(t.transpose(-2, -1))), iters)
                for name, t in both.items()}
            if quantize._both_ok(dev):
                res["quantise_s"]["both forms: quantize_both"] = {
                    name: timed(lambda t=t: quantize._quantize_both_triton(t), iters) for name, t in both.items()}
        if fp8.emulation_reason(dev) is None:  # the w13 forward GEMM alone, operands already quantised
            (qx, sx), (qw, sw) = fp8.quantize_rowwise(x), fp8.quantize_rowwise(w13)
            res["gemm_only_s"] = {
                "bf16 _grouped_mm": timed(lambda: torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs), iters),
                "fp8 _scaled_grouped_mm": timed(lambda: torch._scaled_grouped_mm(
                    qx, qw.transpose(-2, -1), sx, sw, offs=offs, out_dtype=BF16), iters)}
    res["rows_sweep_ffn_fwd_bwd_s"] = _rows_sweep(dev, shape, w13, w2, timed, iters)
    flops = {"ffn_fwd": 2 * m * h * (n2f + f), "linear_fwd": 2 * m * h * ffn}
    res["flops"] = flops
    return res


class _Lines(logging.Handler):
    """Keeps the messages logged while it is attached (executor.profile says how fp8 GEMMs ran)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def part_profile(dev: torch.device, tiny: bool, runs: list[str], save) -> dict:
    """``executor.profile`` of each run in ``runs`` (labels of :data:`PROFILE_RUNS`, in that order); ``save(part)``
    after each."""
    said = _Lines()
    profile_log = logging.getLogger("executor.profile")
    profile_log.addHandler(said)
    profile_log.setLevel(logging.INFO)
    spec = get_model("tiny-moe") if tiny else get_model("mixtral-8x7b").with_layers(2)
    seq = 64 if tiny else 4096
    out = {"model": spec.name, "layers": spec.num_layers, "seq": seq, "fp8_log": said.lines}
    by_label = {run[0]: run[1:] for run in PROFILE_RUNS}
    for label in runs:  # in the order asked: a run cut off by a time limit loses only the later ones
        precision, global_batch, env = by_label[label]
        os.environ.update(env)  # the ranks' processes inherit it
        m = profile_layout(spec, TrainingSpec(seq_length=seq, global_batch_size=global_batch, precision=precision),
                           ParallelConfig(world_size=1), ExecutorOptions(), warmup_steps=2, timed_steps=5,
                           timeout_s=150, device=dev.type)
        for key in env:
            os.environ.pop(key)
        keep = ("ok", "failure_reason", "device", "precision", "step_time", "step_times", "tflops_per_gpu", "mfu",
                "peak_allocated_bytes", "peak_reserved_bytes", "phases", "losses")
        out[label] = {"global_batch": global_batch, **{k: v for k, v in m.to_dict().items() if k in keep}}
        save(out)
    profile_log.removeHandler(said)
    return out


def _table(res: dict) -> str:
    lines = []
    agree = res.get("agree")
    if agree:
        lines.append(f"agree (kernels: {agree['kernels']}; {agree['emulated_because'] or 'sm90 kernels'})")
        lines.append(f"  {'GEMM':<14}{'ok':>6}{'beyond':>10}{'rel diff':>11}{'kernel err':>12}{'emul err':>10}")
        for name in ("grouped_fwd", "grouped_dgrad", "grouped_wgrad", "linear_fwd", "linear_dgrad", "linear_wgrad"):
            r = agree[name]
            if "error" in r:
                lines.append(f"  {name:<14} kernel FAILED: {r['error'][:200]}")
                continue
            fmt = (lambda v, spec: "-" if v is None else format(v, spec))
            lines.append(f"  {name:<14}{str(r['ok']):>6}{fmt(r['beyond'], '.2e'):>10}{fmt(r['rel_diff'], '.2e'):>11}"
                         f"{r['kernel_rel_err_vs_fp32']:>12.4f}{r['emulated_rel_err_vs_fp32']:>10.4f}")
    speed = res.get("speed")
    if speed:
        lines.append("speed, ms per call (steady state)")
        lines.append(f"  {'variant':<16}{'ffn fwd':>9}{'ffn f+b':>9}{'lin fwd':>9}{'lin f+b':>9}")
        for label, _, _ in VARIANTS:
            r = speed[label]
            if "error" in r:
                lines.append(f"  {label:<16} FAILED: {r['error'][:200]}")
                continue
            lines.append(f"  {label:<16}{r['ffn_fwd_s'] * 1e3:>9.2f}{r['ffn_fwd_bwd_s'] * 1e3:>9.2f}"
                         f"{r['linear_fwd_s'] * 1e3:>9.2f}{r['linear_fwd_bwd_s'] * 1e3:>9.2f}")
        for path, times in speed["quantise_s"].items():
            lines.append(f"  quantise ({path}) ms: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in times.items()))
        if "gemm_only_s" in speed:
            lines.append("  gemm_only ms: " + ", ".join(f"{k} {v * 1e3:.2f}"
                                                        for k, v in speed["gemm_only_s"].items()))
        lines.append("  expert FFN fwd+bwd ms by rows (bf16 / fp8 uncached / fp8 cached): " + ", ".join(
            f"{rows}: {r['bf16'] * 1e3:.2f} / {r['fp8_uncached'] * 1e3:.2f} / {r['fp8'] * 1e3:.2f}"
            for rows, r in speed["rows_sweep_ffn_fwd_bwd_s"].items()))
    prof = res.get("profile")
    if prof:
        lines.append(f"profile {prof['model']} ({prof['layers']} layers, seq {prof['seq']}, 1 device)")
        for label in (run[0] for run in PROFILE_RUNS if run[0] in prof):
            r = prof[label]
            if not r["ok"]:
                lines.append(f"  {label}: FAILED {r['failure_reason']}")
                continue
            mem = f"{r['peak_allocated_bytes'] / 2**30:.1f} GiB" if r.get("peak_allocated_bytes") else "-"
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
            lines.append(f"  {label} (global batch {r['global_batch']}): step {r['step_time'] * 1e3:.1f} ms  "
                         f"MFU {mfu} (of the {r['precision']} peak)  peak mem {mem}  "
                         f"losses {[round(v, 3) for v in r['losses']]}")
        lines.extend(f"  log: {line}" for line in prof["fp8_log"])
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="agree,speed,profile")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="toy shapes and tiny-moe (a smoke test)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per speed case")
    parser.add_argument("--profile-runs", default=",".join(run[0] for run in PROFILE_RUNS),
                        help="which profile runs (labels: " + ", ".join(run[0] for run in PROFILE_RUNS) + ")")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fp8_check.json"))
    args = parser.parse_args()
    dev = torch.device(args.device) if args.device == "cpu" else torch.device("cuda", 0)
    shape = SHAPES["tiny" if args.tiny else "mixtral"]
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "shape": dict(zip(("hidden", "n_gate_up", "experts", "rows", "dense_out"), shape)),
           "command": " ".join(sys.argv)}
    torch.backends.cuda.matmul.allow_tf32 = False  # the emulation's fp32 matmuls must be fp32

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    parts = args.parts.split(",")
    if "agree" in parts:
        res["agree"] = part_agree(dev, shape)
        save()
    if "speed" in parts:
        res["speed"] = part_speed(dev, shape, args.iters)
        save()
    if "profile" in parts:
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the profile's own process needs the memory

        def save_profile(part):
            res["profile"] = part
            save()

        part_profile(dev, args.tiny, args.profile_runs.split(","), save_profile)
    res["fp8_gemm_calls_here"] = fp8.gemm_counts()
    res["fp8_weight_quantisations_here"] = fp8.weight_counts()
    save()
    print(_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
