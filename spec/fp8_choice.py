"""The margin of the per-shape choice between bf16 and fp8 that the executor makes and the cost model prices.

Under precision fp8 the executor times each linear shape both ways on its first call
(``executor.kernels.fp8.expert_pick``) and keeps fp8 only where fp8 is faster by more than
:data:`FP8_CHOICE_MARGIN`: closer than that the two timings are within their noise and the choice flips from run
to run (docs/benchmarks.md, "The experts' wgrad in fp8, tried against this bound"), and bf16 keeps no quantised
weight copies. ``costmodel.step_time`` prices the same rule.
"""

from __future__ import annotations

#: fp8 must take less than (1 - FP8_CHOICE_MARGIN) of bf16's time at a shape to be chosen (a share, 0..1)
FP8_CHOICE_MARGIN = 0.03


def fp8_chosen(fp8_seconds: float, bf16_seconds: float) -> bool:
    """Whether a shape runs fp8: its fp8 seconds below bf16's by more than the margin."""
    return fp8_seconds < bf16_seconds * (1.0 - FP8_CHOICE_MARGIN)
