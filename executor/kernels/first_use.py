"""The first-use check every fused kernel passes before it replaces its torch path: run once per shape
key, and a kernel that fails to compile or disagrees with torch costs speed, never the run."""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch


def checked_once(cache: dict, key: tuple, check, what: str) -> bool:
    """``check(*key)`` once per key (with grad on): True if it returns, False (with a warning saying why)
    if it raises, so a kernel that fails to compile or disagrees with torch costs speed, never the run."""
    if key not in cache:
        failure: list[BaseException] = []

        def run() -> None:
            try:
                device = next((k for k in key if isinstance(k, torch.device) or
                               (isinstance(k, str) and k.startswith("cuda"))), None)
                with torch.enable_grad(), (torch.cuda.device(torch.device(device)) if device is not None
                                           else contextlib.nullcontext()):
                    check(*key)
            except Exception as exc:  # noqa: BLE001
                failure.append(exc)

        # The first call comes from inside a forward, possibly under activation checkpointing, whose
        # saved-tensor hooks would count the check's tensors and then fail the recomputation; autograd's
        # hooks and grad mode are thread-local, so the check runs on its own thread.
        thread = threading.Thread(target=run, name=f"foldtune-check-{what}")
        thread.start()
        thread.join()
        if failure:
            exc = failure[0]
            warnings.warn(f"{what} off for {key}: {type(exc).__name__}: {exc}", stacklevel=3)
        cache[key] = not failure
    return cache[key]


def assert_agree(names, wants, gots, tol: float, what: str) -> None:
    """Raise AssertionError for the first of ``names`` whose result in ``gots`` differs from the one in ``wants``
    by more than ``tol`` times the larger of 1 and the reference's largest magnitude: a first-use check's bound,
    "``what`` ``name`` differs ... by ..."."""
    for name, want, got in zip(names, wants, gots):
        err = (got.float() - want.float()).abs().max().item()
        bound = tol * max(want.float().abs().max().item(), 1.0)
        if not err <= bound:
            raise AssertionError(f"{what.replace('{name}', name)} by {err:.3g} (> {bound:.3g})")
