"""foldtune's grouped fp8 GEMM candidates compiled for a Hopper GPU on a machine without one: what each tuning
candidate (executor/kernels/fp8/grouped_gemm.py ``CONFIGS``) costs in registers, spill stack and shared memory,
and whether its main loop was software-pipelined, before any GPU time is spent on it.

Each distinct compiled kernel (a config's tile, warps, stages, TMA or pointer loads and flattening; programs an
SM change only the grid) is compiled by Triton for sm90 (``triton.compile`` to a cubin with the ptxas Triton
ships; ``cuobjdump -res-usage`` reads its registers and stack), with integer arguments marked divisible by 16
as Triton's launcher specialises the strides and widths of real expert shapes. Columns: registers a thread
(255 is the cap: more spills), spill stack bytes a thread (0: none), shared memory (bytes a program; 227 KiB
an SM on an H100/H200), async loads in the main loop (0: loads not pipelined), and the loop structure
(``for``: loops in the TTGIR; a flattened m-grouped kernel keeps the nested loop only as the guard for K = 0).

No timing: this says which candidates can be fast (no spills, pipelined, two programs fit an SM), not which
is. The numbers are the installed Triton's; the GPU machine's Triton may differ.

Usage (CPU, from the repository root; about a minute):
    python3 -m bench.fp8_grouped_compile
    python3 -m bench.fp8_grouped_compile --kinds k --flat-only --out /tmp/compile.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from executor.kernels.fp8 import grouped_gemm as gg
from executor.kernels.fp8.grouped_quant import QBLOCK, SCALINGS, g_pad

SM90_SMEM = 227 * 1024  # bytes of shared memory a program may use on an H100/H200 SM
REGISTERS_PER_SM = 65536


def _signature(kind: str, cfg: gg.Config) -> dict[str, str]:
    if cfg.tma:
        a = f"tensordesc<fp8e4nv[{cfg.block_m}, {cfg.block_k}]>"
        b = f"tensordesc<fp8e4nv[{cfg.block_n}, {cfg.block_k}]>"
    else:
        a = b = "*fp8e4nv"
    head = {"a": a, "b": b, "c_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "offs_ptr": "*i32"}
    if kind == "m":
        ints = ("M", "N", "K", "G", "programs", "s_am", "s_bg", "s_bn", "s_cm", "s_sbg", "s_sbn", "s_sbk")
    else:
        ints = ("P", "Q", "G", "programs", "s_a", "s_b")
    return head | {name: "i32" for name in ints}


def compile_candidate(kind: str, scaling: str, cfg: gg.Config) -> dict:
    """Compile ``cfg``'s kernel for sm90; its registers, spill stack, shared memory, pipelined loads, loops."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(G_PAD=g_pad(128), BLOCKWISE=scaling == "blockwise", TMA=cfg.tma, QB=QBLOCK, BM=cfg.block_m,
                      BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m)
    if kind == "m":
        fn = gg._m_grouped_kernel
        constexprs |= dict(FAST_ACCUM=False, EVEN_K=True, FLATTEN=cfg.flatten)
    else:
        fn = gg._k_grouped_flat_kernel if cfg.flatten else gg._k_grouped_kernel
    signature = _signature(kind, cfg) | {name: "constexpr" for name in constexprs}
    # what the launcher specialises at real expert shapes: 16-byte aligned pointers, widths and strides
    # divisible by 16 (not M, the routed rows, nor the counts)
    aligned = [n for n, t in signature.items() if t.startswith("*") or n in ("N", "K", "P", "Q") or n.startswith("s_")]
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    start = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg.warps, "num_stages": cfg.stages})
    seconds = time.perf_counter() - start
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    ttgir = compiled.asm["ttgir"]
    regs = int(found.group(1))
    smem = int(compiled.metadata.shared)
    return {"kind": kind, "scaling": scaling, "config": cfg.label(), "registers": regs,
            "stack_bytes": int(found.group(2)), "shared_bytes": smem,
            "async_loads": len(re.findall(r"async_tma_copy_global_to_local|async_copy_global_to_local", ttgir)),
            "loops": len(re.findall(r"scf\.for ", ttgir)),
            "fit_per_sm": min(REGISTERS_PER_SM // max(1, regs * 32 * cfg.warps), SM90_SMEM // max(1, smem)),
            "compile_s": seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="m,k", help="m (forward/dgrad), k (wgrad) (default: %(default)s)")
    ap.add_argument("--scalings", default=",".join(SCALINGS), help="(default: %(default)s)")
    ap.add_argument("--flat-only", action="store_true", help="only the flattened candidates")
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    if gg.triton is None:
        print("fp8_grouped_compile: Triton is not installed", file=sys.stderr)
        return 2
    rows, failed = [], 0
    for kind in args.kinds.split(","):
        for scaling in args.scalings.split(","):
            seen = set()
            for cfg in gg.CONFIGS[(kind, scaling)]:
                compiled_as = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.warps, cfg.stages, cfg.tma,
                               cfg.flatten)
                if compiled_as in seen or (args.flat_only and not cfg.flatten):
                    continue
                seen.add(compiled_as)
                try:
                    rows.append(compile_candidate(kind, scaling, cfg))
                except Exception as exc:  # noqa: BLE001 (a candidate that does not compile is reported, not fatal)
                    failed += 1
                    rows.append({"kind": kind, "scaling": scaling, "config": cfg.label(),
                                 "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    import triton

    print(f"sm90 compile of the grouped fp8 GEMM candidates (Triton {triton.__version__}; programs an SM share one "
          f"kernel, so x2 candidates are not listed)\n")
    print("| kernel | scaling | config | regs | spill stack (B) | shared (KiB) | async loads | loops | programs an SM fit |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kind']} | {r['scaling']} | {r['config']} | FAILED: {r['error'][:120]} |")
            continue
        print(f"| {r['kind']} | {r['scaling']} | {r['config']} | {r['registers']} | {r['stack_bytes']} | "
              f"{r['shared_bytes'] / 1024:.0f} | {r['async_loads']} | {r['loops']} | {r['fit_per_sm']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
