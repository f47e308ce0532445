"""The copy-engine all-to-all (executor/parallel/copy_engine_alltoall.py) on 2 GPUs: equal to NCCL's, its speed,
and what each all-to-all costs the grouped GEMMs that run beside it.

Per rank (2 processes, one GPU each):
1. equality: exchanges of random split sizes (empty chunks included; with 1 MiB inboxes, chunks of several
   rounds; 40 of them queued back to back) against ``all_to_all_single`` on the same rows, bit for bit;
2. the Mixtral-8x7B EP2 dispatch of one micro-batch (8192 bf16 rows of 4096, about half to the peer) alone:
   milliseconds per exchange, NCCL and copy engines;
3. contention: a loop of ``torch._grouped_mm`` (4 local experts, the Mixtral up-projection shape) alone, then
   with the same exchange repeated beside it on another stream, once over NCCL and once over the copy engines.
   ``slowdown`` is the GEMM loop's extra time: what an overlapped exchange takes from the compute.

Usage: python -m bench.ce_alltoall_probe [--out ce_alltoall_probe.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from executor.launch_local import launch
from executor.microbench.timing import time_device
from executor.parallel.copy_engine_alltoall import CopyEngineAllToAll
from executor.parallel.groups import Group

HIDDEN, FFN, EXPERTS_LOCAL, ROWS = 4096, 14336, 4, 8192


def _nccl(x, out_splits, in_splits):
    out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, out_splits, in_splits)
    return out


def _splits(gen, rows: int) -> list[int]:
    a = int(torch.randint(0, rows + 1, (1,), generator=gen))
    return [a, rows - a]


def _exchange_splits(rank: int, send: list[int]) -> list[int]:
    """The receive splits that match every rank's ``send`` (one small all-gather)."""
    t = torch.tensor(send, device="cuda")
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    return [int(e[rank]) for e in every]


def _time_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after one untimed (CUDA events), both ranks
    starting together."""
    dist.barrier()
    return 1e3 * time_device(fn, torch.device("cuda", torch.cuda.current_device()), warmup=1, repeats=repeats)


def probe_worker(rank: int, world_size: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    group = Group("ep", tuple(range(world_size)), rank, dist.group.WORLD)
    report: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                    "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    ce = CopyEngineAllToAll(group, device)
    small = CopyEngineAllToAll(group, device, slot_bytes=1 << 20)
    gen = torch.Generator().manual_seed(11 + rank)
    mismatches, cases = 0, 0
    for rows, transport in [(r, t) for r in (0, 1, 37, 700, 5000) for t in (ce, small)]:
        send = _splits(gen, rows)
        recv = _exchange_splits(rank, send)
        x = torch.randn(sum(send), HIDDEN, device=device).to(torch.bfloat16)
        out, work = transport.start(x, recv, send)
        work.wait()
        cases += 1
        mismatches += int(not torch.equal(out.view(torch.int16), _nccl(x, recv, send).view(torch.int16)))
    # back to back, no host sync between them: each exchange's inboxes are reused only after they are read
    queued = []
    for i in range(40):
        send = _splits(gen, 3000 + 37 * i)
        recv = _exchange_splits(rank, send)
        x = torch.randn(sum(send), HIDDEN, device=device).to(torch.bfloat16)
        out, work = (ce if i % 3 else small).start(x, recv, send)
        queued.append((x, recv, send, out, work))
    for x, recv, send, out, work in queued:
        work.wait()
        cases += 1
        mismatches += int(not torch.equal(out.view(torch.int16), _nccl(x, recv, send).view(torch.int16)))
    report["equality"] = {"cases": cases, "mismatches": mismatches}

    send = [ROWS // 2 - 128 * (rank + 1), ROWS // 2 + 128 * (rank + 1)]
    recv = _exchange_splits(rank, send)
    x = torch.randn(ROWS, HIDDEN, device=device, dtype=torch.bfloat16)

    def with_ce():
        out, work = ce.start(x, recv, send)
        work.wait()

    report["exchange_ms"] = {"nccl": _time_ms(lambda: _nccl(x, recv, send), 20), "copy_engine": _time_ms(with_ce, 20)}

    tokens = torch.randn(2 * ROWS, HIDDEN, device=device, dtype=torch.bfloat16)
    weights = torch.randn(EXPERTS_LOCAL, HIDDEN, FFN, device=device, dtype=torch.bfloat16) / HIDDEN ** 0.5
    offs = torch.arange(1, EXPERTS_LOCAL + 1, device=device, dtype=torch.int32) * (2 * ROWS // EXPERTS_LOCAL)
    gemms = 30
    flops = 2 * tokens.shape[0] * HIDDEN * FFN

    def gemm_loop():
        for _ in range(gemms):
            torch._grouped_mm(tokens, weights, offs=offs)

    side = torch.cuda.Stream(device)
    nccl_out = torch.empty(sum(recv), HIDDEN, device=device, dtype=torch.bfloat16)

    def beside(transport: str, marks: dict | None = None):
        """The GEMM loop with 12 exchanges beside it; ``marks``: events at the loop's end and the exchanges'."""
        exchanges = 12

        def run():
            if transport == "nccl":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(exchanges):
                        dist.all_to_all_single(nccl_out, x, recv, send)
                    exchanged = side.record_event(torch.cuda.Event(enable_timing=True))
                gemm_loop()
                torch.cuda.current_stream().wait_stream(side)
            else:  # each starts after what the current stream holds now, i.e. beside the GEMM loop
                works = [ce.start(x, recv, send)[1] for _ in range(exchanges)]
                with torch.cuda.stream(ce.stream):
                    exchanged = ce.stream.record_event(torch.cuda.Event(enable_timing=True))
                gemm_loop()
                for work in works:
                    work.wait()
            if marks is not None:
                marks["gemms"] = torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
                marks["exchanges"] = exchanged
        return run

    def split_times(transport: str) -> dict:
        """Milliseconds from the start to the end of the GEMM loop and of the 12 exchanges, one run."""
        marks: dict = {}
        start = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        dist.barrier()
        start.record()
        beside(transport, marks)()
        torch.cuda.synchronize()
        return {k: start.elapsed_time(e) for k, e in marks.items()}

    alone = _time_ms(gemm_loop, 3)
    contention = {"gemm_loop_alone_ms": alone, "gemm_tflops": gemms * flops / alone / 1e9}
    for transport in ("nccl", "copy_engine"):
        both = _time_ms(beside(transport), 3)
        contention[transport] = {"gemm_loop_with_exchanges_ms": both, "slowdown_ms": both - alone,
                                 "ends_ms": split_times(transport)}
    # what runs a copy-engine exchange on the device: memcpy (copy engines) or kernels (SMs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, work = ce.start(x, recv, send)
        work.wait()
        torch.cuda.synchronize()
    report["copy_engine_device_ops"] = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    # the exchanges' own time beside nothing, for the record: 12 of them
    report["contention"] = contention
    dist.barrier()
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ce_alltoall_probe.json"))
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        parser.error("needs 2 GPUs")
    launched = launch(probe_worker, 2, (), backend="nccl", timeout_s=600)
    if not launched.ok:
        print(f"failed: {launched.failure_reason}", file=sys.stderr)
        return 1
    with open(args.out, "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "ranks": launched.results},
                  f, indent=1)
    for rank, r in enumerate(launched.results):
        c = r["contention"]
        print(f"rank {rank} {r['device']} torch {r['torch']} nccl {r['nccl']}: equal {r['equality']}; exchange "
              f"nccl {r['exchange_ms']['nccl']:.3f} ms, copy engines {r['exchange_ms']['copy_engine']:.3f} ms; "
              f"GEMM loop {c['gemm_loop_alone_ms']:.2f} ms ({c['gemm_tflops']:.0f} TFLOP/s), beside 12 exchanges: "
              f"nccl +{c['nccl']['slowdown_ms']:.2f} ms, copy engines +{c['copy_engine']['slowdown_ms']:.2f} ms; "
              f"ends (GEMMs, exchanges) nccl {c['nccl']['ends_ms']}, copy engines {c['copy_engine']['ends_ms']}")
        print(f"  device ops of one copy-engine exchange: {r['copy_engine_device_ops']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
