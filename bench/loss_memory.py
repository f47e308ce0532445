"""Memory and time of the output layer + cross-entropy, unfused (whole logits) against fused and blocked.

For each case (a model's hidden size and vocabulary at a sequence length and micro-batch size, one GPU, so
the whole vocabulary on one rank as at tp 1) and each path — ``unfused`` (ExecutorOptions
``cross_entropy_chunk_logits=0``: [s, b, V] logits, then fp32 copies), ``fused`` (the executor's
default, or ``--chunk-logits``: on CUDA each block's element-wise work in the Triton kernels of
executor/kernels/triton_cross_entropy.py) and, on CUDA only, ``fused-torch`` (the same blocks with those
kernels off, FOLDTUNE_FUSED_CROSS_ENTROPY=0: the torch ops on an fp32 copy of each block) — it runs ``executor.parallel.vocab.output_cross_entropy(...).mean()``
forward and backward from hidden states [s, b, h] and reports:

- ``held_after_forward_mib``: memory allocated after the forward beyond the inputs (what the loss keeps for
  its backward: under a pipeline, per micro-batch in flight) — CUDA only;
- ``peak_extra_mib``: peak memory during forward + backward beyond the inputs and the two gradients the
  layer must produce anyway (input [s, b, h] and weight [V, h]): the logits, their copies and the
  workspace — CUDA only (``torch.cuda.max_memory_allocated`` deltas);
- ``saved_mib``: what autograd saves for backward beyond the inputs (saved-tensor hooks; every device);
- ``forward_ms`` and ``forward_backward_ms``: steady state, ``--iters`` calls back to back after two
  warm-up calls (CUDA events on a GPU, wall clock on the CPU);
- for ``fused`` and ``fused-torch``: ``loss_abs_diff`` and the max |difference| of each gradient relative to the unfused path's
  largest |value| (both paths see the same inputs).

Cases: Qwen3-30B-A3B (h 2048, V 151936) at seq 4096, mbs 1 and 2, DeepSeek-V3 (h 7168, V 129280) and
DeepSeek-V2-Lite (h 2048, V 102400) at seq 4096, mbs 1, in bf16. ``--device cpu --tiny``: toy shapes on the CPU (a smoke test).

Usage (GPU): python3 -m bench.loss_memory          (JSON to $OUT/loss_memory.json, or --out)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.microbench.timing import synchronize, time_steady_window
from executor.kernels import triton_cross_entropy as ce_kernels
from executor.options import DEFAULT_CHUNK_LOGITS
from executor.parallel.groups import single_process_state
from executor.parallel.vocab import output_cross_entropy
from executor.saved_tensors import saved_storage_bytes
from executor.scoped_env import scoped_env
from spec.catalog import get_model

MIB = 2**20
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    name: str
    hidden_size: int
    vocab_size: int
    padded_vocab: int
    seq_length: int
    micro_batch_size: int


def _model_case(model: str, seq_length: int, micro_batch_size: int) -> Case:
    spec = get_model(model)
    return Case(f"{model} seq{seq_length} mbs{micro_batch_size}", spec.hidden_size, spec.vocab_size,
                spec.padded_vocab_size(1), seq_length, micro_batch_size)


def cases(tiny: bool) -> list[Case]:
    """The measured shapes: the issue's models, or toy ones (a padded vocabulary, several blocks)."""
    if tiny:
        return [Case("tiny seq64 mbs1", 64, 1000, 1024, 64, 1), Case("tiny seq64 mbs2", 64, 1000, 1024, 64, 2)]
    return [_model_case("qwen3-30b-a3b", 4096, 1), _model_case("qwen3-30b-a3b", 4096, 2),
            _model_case("deepseek-v3", 4096, 1), _model_case("deepseek-v2-lite", 4096, 1)]


def _seconds_per_call(fn, dev: torch.device, iters: int) -> float:
    """Seconds per call in steady state after two warm-up calls (executor.microbench.timing.time_steady_window)."""
    fn()
    synchronize(dev)
    return time_steady_window(fn, dev, iters, lead=2)


def _inputs(case: Case, dev: torch.device, dtype: torch.dtype):
    gen = torch.Generator(device=dev).manual_seed(0)
    s, b, h = case.seq_length, case.micro_batch_size, case.hidden_size
    weight = torch.randn(case.padded_vocab, h, device=dev, dtype=dtype, generator=gen) * 0.02
    weight[case.vocab_size:] = 0  # padded rows, as the executor initialises them
    hidden = torch.randn(s, b, h, device=dev, dtype=dtype, generator=gen)
    labels = torch.randint(0, case.vocab_size, (s, b), device=dev, generator=gen)
    return hidden.requires_grad_(True), weight.requires_grad_(True), labels


def measure_path(case: Case, chunk_logits: int, dev: torch.device, dtype: torch.dtype, iters: int,
                 inputs, name: str) -> tuple[dict, tuple]:
    """One path (called ``name`` in the report) on one case: the report's row and (loss, grad hidden, grad
    weight) of one fwd+bwd."""
    hidden, weight, labels = inputs
    state = single_process_state()

    def loss():
        return output_cross_entropy(hidden, weight, labels, case.vocab_size, case.padded_vocab, state,
                                    chunk_logits).mean()

    def clear():
        hidden.grad = weight.grad = None

    row = {"path": name, "chunk_logits": chunk_logits}
    clear()
    row["saved_mib"] = saved_storage_bytes(loss, [hidden, weight]) / MIB
    synchronize(dev)
    if dev.type == "cuda":
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        value = loss()
        synchronize(dev)
        row["held_after_forward_mib"] = (torch.cuda.memory_allocated(dev) - base) / MIB
        value.backward()
        synchronize(dev)
        grads = hidden.grad.nbytes + weight.grad.nbytes
        row["peak_extra_mib"] = (torch.cuda.max_memory_allocated(dev) - base - grads) / MIB
        del value
    else:
        row["held_after_forward_mib"] = row["peak_extra_mib"] = None
    clear()
    value = loss()
    value.backward()
    result = (value.detach().float(), hidden.grad.detach().clone(), weight.grad.detach().clone())
    clear()

    def forward_only():
        with torch.no_grad():
            loss()

    def forward_backward():
        loss().backward()
        clear()

    row["forward_ms"] = _seconds_per_call(forward_only, dev, iters) * 1e3
    row["forward_backward_ms"] = _seconds_per_call(forward_backward, dev, iters) * 1e3
    return row, result


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def run_case(case: Case, chunk_logits: int, dev: torch.device, dtype: torch.dtype, iters: int) -> dict:
    """Every path on one case (unfused first; an out-of-memory path is recorded, the others still run)."""
    inputs = _inputs(case, dev, dtype)
    report = {"case": case.__dict__, "paths": []}
    reference = None
    paths = [("unfused", 0, {}), ("fused", chunk_logits, {})]
    if dev.type == "cuda":  # the kernels run on CUDA only: elsewhere "fused" is the torch path already
        paths.append(("fused-torch", chunk_logits, {"FOLDTUNE_FUSED_CROSS_ENTROPY": "0"}))
    for name, chunk, env in paths:
        try:
            with scoped_env(env):
                row, result = measure_path(case, chunk, dev, dtype, iters, inputs, name)
        except torch.OutOfMemoryError as error:
            report["paths"].append({"path": name, "chunk_logits": chunk,
                                    "error": f"out of memory: {str(error).splitlines()[0]}"})
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            continue
        if chunk == 0:
            reference = result
        elif reference is not None:
            row["loss_abs_diff"] = float((result[0] - reference[0]).abs())
            row["grad_hidden_rel_diff"] = _relative(result[1], reference[1])
            row["grad_weight_rel_diff"] = _relative(result[2], reference[2])
        report["paths"].append(row)
        del result
    if dev.type == "cuda":
        report["fused_kernel_checks"] = {str(k): ok for k, ok in ce_kernels._CHECKED.items()}
    return report


def _fmt(value, digits=1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(reports: list[dict]) -> str:
    lines = [f"{'case':<30} {'path':<11} {'held MiB':>9} {'peak+ MiB':>10} {'saved MiB':>10} "
             f"{'fwd ms':>8} {'fwd+bwd ms':>11} {'loss diff':>10}"]
    for report in reports:
        for row in report["paths"]:
            if "error" in row:
                lines.append(f"{report['case']['name']:<30} {row['path']:<11} {row['error']}")
                continue
            diff = row.get("loss_abs_diff")
            lines.append(f"{report['case']['name']:<30} {row['path']:<11} {_fmt(row['held_after_forward_mib']):>9} "
                         f"{_fmt(row['peak_extra_mib']):>10} {_fmt(row['saved_mib']):>10} "
                         f"{_fmt(row['forward_ms'], 2):>8} {_fmt(row['forward_backward_ms'], 2):>11} "
                         f"{'-' if diff is None else f'{diff:.1e}':>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--tiny", action="store_true", help="toy shapes (CPU smoke test)")
    parser.add_argument("--chunk-logits", type=int, default=DEFAULT_CHUNK_LOGITS,
                        help=f"the fused path's logits per block (default {DEFAULT_CHUNK_LOGITS})")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per path (default 10; --tiny 2)")
    parser.add_argument("--out", help="JSON file (default: $OUT/loss_memory.json or ./loss_memory.json)")
    args = parser.parse_args(argv)
    if args.chunk_logits <= 0:
        parser.error("--chunk-logits must be > 0 (the unfused path always runs)")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --tiny", file=sys.stderr)
        return 2
    # toy sizes fit one default block: 37 vocabulary rows per block at 64 tokens instead, unless asked
    chunk = 64 * 37 if args.tiny and args.chunk_logits == DEFAULT_CHUNK_LOGITS else args.chunk_logits
    iters = args.iters or (2 if args.tiny else 10)
    reports = [run_case(case, chunk, dev, DTYPES[args.dtype], iters) for case in cases(args.tiny)]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": args.dtype, "iters": iters, "cases": reports,
    }
    path = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "loss_memory.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(table(reports))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
