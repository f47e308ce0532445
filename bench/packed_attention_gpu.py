"""Attention within packed documents on one GPU: flex attention's block mask (executor.documents) against the
masked SDPA, bf16, b=1, 32 query / 8 KV heads of 128, documents of 1024 tokens. Per sequence length: the block
mask's build (once per micro-batch, shared by the layers) and each path's forward + backward, median ms over
10 runs after 3 warm-ups (the block mask: 5 after 3). Run from the repository root on a CUDA machine."""

from __future__ import annotations

import argparse

import torch

from executor.documents import Documents, _flex, block_mask, check_flex
from executor.attention_core import special_attention


def _median_ms(fn, runs: int = 10, warm: int = 3) -> float:
    times = []
    for i in range(warm + runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warm:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _fwd_bwd(attend, tensors):
    def run():
        leaves = [t.clone().requires_grad_() for t in tensors[:3]]
        attend(*leaves).backward(tensors[3])
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384], help="sequence lengths")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    check_flex(torch.bfloat16, 128, "cuda")  # raises if flex disagrees with the masked path
    for s in args.seq:
        tensors = [torch.randn(1, h, s, 128, device="cuda", dtype=torch.bfloat16) for h in (32, 8, 8, 32)]
        segments = (torch.arange(s, device="cuda") // 1024).view(1, s)
        docs = Documents(segments)
        block, mask = docs.block_mask(), docs.whole(None)
        build = _median_ms(lambda: block_mask(segments), runs=5)
        flex = _median_ms(_fwd_bwd(lambda q, k, v: _flex(q, k, v, segments, block), tensors))
        masked = _median_ms(_fwd_bwd(lambda q, k, v: special_attention(q, k, v, mask, None), tensors))
        print(f"s {s}: block mask {build:.3f} ms, flex fwd+bwd {flex:.3f} ms, masked SDPA fwd+bwd {masked:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
