"""executor/microbench/stack_variants.py: the variants share one set of parameters and handle gradients as
told; the GEMM loop counts every product of its step."""

from __future__ import annotations

import torch

from executor.microbench.stack_variants import GemmLoop, build_stack
from spec.catalog import get_model


def test_variants_share_parameters_and_set_grads_as_told():
    spec = get_model("tiny-moe").with_layers(1)
    dev = torch.device("cpu")
    before = build_stack("before", spec, 16, 1, dev, torch.float32, None)
    after = build_stack("after", spec, 16, 1, dev, torch.float32, before.layers)
    assert all(p is q for p, q in zip(before.layers.parameters(), after.layers.parameters()))
    before.step()
    first = before.layers[0].attention.wq.grad.clone()
    before.step()  # accumulates in place
    torch.testing.assert_close(before.layers[0].attention.wq.grad, 2 * first)
    after.step()  # starts from None: one step's gradient (the fused path computes the same)
    torch.testing.assert_close(after.layers[0].attention.wq.grad, first, rtol=1e-5, atol=1e-6)


def test_the_gemm_loop_counts_every_product_of_its_step():
    a = torch.ones(4, 4)
    loop = GemmLoop("g", a, a, reps=3)
    loop.step()
    assert loop.tflops(1e-12) == 3 * 2 * 64 / 1e-12 / 1e12  # 3 products of 2·4³ FLOPs in 1e-12 s
