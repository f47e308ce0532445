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
        device = next((k for k in key if isinstance(k, torch.device) or
                       (isinstance(k, str) and k.startswith("cuda"))), None)
        try:
            run_apart(lambda: check(*key), device, f"check-{what}")
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"{what} off for {key}: {type(exc).__name__}: {exc}", stacklevel=3)
            cache[key] = False
        else:
            cache[key] = True
    return cache[key]


def run_apart(fn, device=None, what: str = "check", stream=None):
    """``fn()`` on a thread of its own with grad on (on CUDA ``device`` and ``stream`` where given), its result
    returned and its exception raised here. The first call of a kernel comes from inside a forward, possibly
    under activation checkpointing, whose saved-tensor hooks would count the tensors of a check (or of a
    timing) and then fail the recomputation; autograd's hooks and grad mode are thread-local."""
    result: list = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            with torch.enable_grad(), (torch.cuda.device(torch.device(device)) if device is not None
                                       else contextlib.nullcontext()), \
                    (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
                result.append(fn())
        except Exception as exc:  # noqa: BLE001
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"foldtune-{what}")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def assert_agree(names, wants, gots, tol: float, what: str) -> None:
    """Raise AssertionError for the first of ``names`` whose result in ``gots`` differs from the one in ``wants``
    by more than ``tol`` times the larger of 1 and the reference's largest magnitude: a first-use check's bound,
    "``what`` ``name`` differs ... by ..."."""
    for name, want, got in zip(names, wants, gots):
        err = (got.float() - want.float()).abs().max().item()
        bound = tol * max(want.float().abs().max().item(), 1.0)
        if not err <= bound:
            raise AssertionError(f"{what.replace('{name}', name)} by {err:.3g} (> {bound:.3g})")
