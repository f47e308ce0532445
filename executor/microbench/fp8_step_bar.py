"""The fp8 training-step bar's arithmetic: fp8 against bf16 from the same initialisation and data, as
``bench/fp8_step.py`` runs them: tokens/s quotient (bar :data:`BAR_SPEEDUP`) and the largest relative loss
difference step for step (bar :data:`BAR_LOSS`), with how far bf16's own loss climbs back above an earlier
low (a loss that rises on its own says the steps are too few to judge the difference)."""

from __future__ import annotations

BAR_SPEEDUP = 1.25  # fp8 tokens/s over bf16's
BAR_LOSS = 0.01  # largest relative loss difference over the steps


def max_rel_diff(losses: list[float], reference: list[float]) -> float:
    """The largest |loss − reference| / |reference| over the steps, step for step (nan: no steps)."""
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    return max(diffs) if diffs else float("nan")


def max_rise(losses: list[float]) -> float:
    """The largest relative rise of a loss above its lowest earlier value (0: it never rose)."""
    rises = [(loss - min(losses[:i])) / abs(min(losses[:i])) for i, loss in enumerate(losses) if i]
    return max([0.0, *rises])


def compare(bf16: dict, fp8_run: dict) -> dict:
    """fp8's tokens/s over bf16's and the largest relative loss difference, step for step, with the bars;
    ``bf16_max_rise``: how far bf16's own loss climbed back (:func:`max_rise`)."""
    ratio = fp8_run["tokens_per_s"] / bf16["tokens_per_s"]
    loss_diff = max_rel_diff(fp8_run["losses"], bf16["losses"])
    return {"speedup": ratio, "max_rel_loss_diff": loss_diff, "speedup_ok": ratio >= BAR_SPEEDUP,
            "loss_ok": loss_diff <= BAR_LOSS, "bf16_max_rise": max_rise(bf16["losses"])}
