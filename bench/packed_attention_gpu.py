"""Attention within packed documents on one GPU: flex attention's block mask (executor.documents) against the
masked SDPA, forward + backward, bf16, b=1, 32 query / 8 KV heads of 128, documents of 1024 tokens.
Prints one line per sequence length: median ms of each path over 10 runs after 3 warm-ups."""

from __future__ import annotations

import torch

from executor.documents import _flex, _masked, check_flex


def _time(fn, *args) -> float:
    times = []
    for i in range(13):
        leaves = [t.clone().requires_grad_() for t in args[:3]]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*leaves, args[3]).sum().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    check_flex(torch.bfloat16, 128, "cuda")
    for s in (4096, 8192):
        q = torch.randn(1, 32, s, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 8, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        segments = (torch.arange(s, device="cuda") // 1024).view(1, s)
        print(f"s {s}: flex {_time(_flex, q, k, v, segments):.3f} ms, masked {_time(_masked, q, k, v, segments):.3f} ms")


if __name__ == "__main__":
    main()
