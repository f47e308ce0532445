"""A kernel self-check first triggered inside an activation-checkpointed forward must not change what
the checkpoint saves (a GPU run with full recomputation failed that way: CheckpointError)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from executor.kernels.first_use import checked_once


def _autograd_check(n: int, device: str) -> None:
    x = torch.randn(n, device=device, requires_grad=True)
    (g,) = torch.autograd.grad((x * x).sum(), x)
    torch.testing.assert_close(g, 2 * x)


def test_check_inside_checkpointed_forward_leaves_the_recomputation_alone():
    cache: dict = {}

    def block(x):
        assert checked_once(cache, (16, "cpu"), _autograd_check, "test kernel")
        return torch.tanh(x) * x

    x = torch.randn(8, requires_grad=True)
    y = checkpoint(block, x, use_reentrant=False)
    y.sum().backward()  # recomputation runs block again; the cached check adds nothing then
    torch.testing.assert_close(x.grad, torch.tanh(x) + x * (1 - torch.tanh(x) ** 2))
    assert cache == {(16, "cpu"): True}


def test_failing_check_warns_and_caches_false():
    cache: dict = {}

    def bad(n, device):
        raise AssertionError("kernel disagrees")

    import pytest

    with pytest.warns(UserWarning, match="test kernel off .*kernel disagrees"):
        assert not checked_once(cache, (1, "cpu"), bad, "test kernel")
    assert not checked_once(cache, (1, "cpu"), bad, "test kernel")  # cached: no second warning needed
