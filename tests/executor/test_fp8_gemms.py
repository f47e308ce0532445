"""executor/microbench/fp8_gemms.py: the bf16 forms contract the GEMM they name."""

from dataclasses import dataclass

import torch

from executor.microbench.fp8_gemms import bf16_op


@dataclass(frozen=True)
class Shape:
    name: str
    m: int
    n: int
    k: int
    groups: int = 1
    wgrad: bool = False

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def test_bf16_ops_compute_the_gemm_they_name():
    """The grouped forms contract what they should: the wgrad over each group's rows (16 of the 64 here), one
    [m, n] per group, against a per-group product of the same operands (bf16_op draws dy [rows, m], then x)."""
    dev = torch.device("cpu")
    wgrad = Shape("w", m=32, n=48, k=64, groups=4, wgrad=True)
    torch.manual_seed(3)
    out = bf16_op(wgrad, dev)()
    torch.manual_seed(3)
    dy, x = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(64, 48, dtype=torch.bfloat16)
    assert out.shape == (4, 32, 48)
    for group in range(4):
        rows = slice(16 * group, 16 * (group + 1))
        want = dy[rows].float().t() @ x[rows].float()
        torch.testing.assert_close(out[group].float(), want, rtol=2e-2, atol=2e-2)
    fwd = Shape("f", m=64, n=32, k=48, groups=4)
    assert bf16_op(fwd, dev)().shape == (64, 32)
    assert bf16_op(Shape("d", 8, 24, 16), dev)().shape == (8, 24)
