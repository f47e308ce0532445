"""The words of the precision-aware optimizer (Megatron's ``--use-precision-aware-optimizer``): the dtypes the
distributed optimizer may keep its state in, their widths, and the one text form of a layout's choice.

A layout names three dtypes (``ParallelConfig.exp_avg_dtype``, ``exp_avg_sq_dtype``, ``main_params_dtype``,
Megatron's ``--exp-avg-dtype``, ``--exp-avg-sq-dtype``, ``--main-params-dtype``); all three fp32 is the classic
mixed-precision recipe. Megatron's argument choices are the vocabulary here (a word outside it is refused by
the constructor); which combinations Megatron and the executor run are rules of the rule book
(``spec.layout_rules``: ``precision_aware_distopt``, ``main_params_dtype``; ``spec.validity``:
``main_params_half_params``, ``executor_optimizer_fp8``).

fp16 and fp8 states are stored scaled (Transformer Engine's FusedAdam keeps one fp32 scale per tensor; the
executor one per block of a unit, :mod:`executor.optimizer`), bf16 states are plain casts. The moments'
dtype only sets how they are stored: the update itself runs in fp32.
"""

from __future__ import annotations

#: Megatron's ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` choices, and the bytes one element takes.
OPTIMIZER_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
OPTIMIZER_STATE_DTYPES = tuple(OPTIMIZER_DTYPE_BYTES)
#: Megatron's ``--main-params-dtype`` choices (Transformer Engine's FusedAdam keeps fp32 or fp16 master weights).
MAIN_PARAMS_DTYPES = ("fp32", "fp16")
#: The state dtypes executor/ keeps (fp8 moments are Megatron's only).
EXECUTOR_STATE_DTYPES = ("fp32", "bf16", "fp16")
#: (exp_avg, exp_avg_sq, main_params): the classic recipe, fp32 everywhere.
FP32_STATES: tuple[str, str, str] = ("fp32", "fp32", "fp32")
#: (exp_avg, exp_avg_sq, main_params) of the recipe Megatron's MoE examples run: bf16 moments, fp32 master.
BF16_MOMENTS: tuple[str, str, str] = ("bf16", "bf16", "fp32")
#: ParallelConfig's fields, in the order of the triple.
FIELDS = ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype")
_SEPARATOR = "+"


def dtypes_text(dtypes: tuple[str, str, str]) -> str:
    """One word for (exp_avg, exp_avg_sq, main_params): 'bf16+bf16+fp32' (the Optuna form and the CLI's)."""
    return _SEPARATOR.join(dtypes)


def read_dtypes(text: str) -> tuple[str, str, str]:
    """The triple of :func:`dtypes_text` output; ValueError unless it names three words of the vocabulary."""
    parts = tuple(text.strip().split(_SEPARATOR))
    if len(parts) != 3 or any(p not in OPTIMIZER_DTYPE_BYTES for p in parts):
        raise ValueError(f"optimizer dtypes are EXP_AVG+EXP_AVG_SQ+MAIN_PARAMS, each one of "
                         f"{', '.join(OPTIMIZER_STATE_DTYPES)}; got {text!r}")
    return parts  # type: ignore[return-value]


def vocabulary_problems(dtypes: tuple[str, str, str]) -> list[str]:
    """What is wrong with the words alone (an unknown dtype), one line per field."""
    return [f"{name} must be one of {OPTIMIZER_STATE_DTYPES}, got {value!r}"
            for name, value in zip(FIELDS, dtypes) if value not in OPTIMIZER_DTYPE_BYTES]


def state_bytes(dtypes: tuple[str, str, str], params_are_fp32: bool) -> int:
    """Bytes of Adam state per parameter: the two moments in their dtypes plus the master weights in theirs
    (none when the parameters already are fp32: they are their own master weights)."""
    exp_avg, exp_avg_sq, main = dtypes
    return (OPTIMIZER_DTYPE_BYTES[exp_avg] + OPTIMIZER_DTYPE_BYTES[exp_avg_sq]
            + (0 if params_are_fp32 else OPTIMIZER_DTYPE_BYTES[main]))


def is_precision_aware(dtypes: tuple[str, str, str]) -> bool:
    """Whether any state leaves fp32 (Megatron then needs ``--use-precision-aware-optimizer``)."""
    return tuple(dtypes) != FP32_STATES
