"""The executor's one refusal: before any rank builds its slice, the rule book judges the layout.

Every layout condition the executor depends on is a rule of :func:`spec.validity.check` (Megatron-LM's rules,
the rules on a config alone and the executor's own, :data:`spec.validity.EXECUTOR_RULES`); the run entries
(:func:`executor.profile.profile_layout`, the training loop, :func:`executor.verify.run_scenario`) call
:func:`check_buildable` once and refuse with one error listing every rule broken. The few guards left deeper
in the executor (the router, the pipeline schedule, the overlapped schedule) name the rule they re-check.
"""

from __future__ import annotations

from spec.errors import InvalidConfigError
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from spec.validity import check, refusal


def check_buildable(model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> None:
    """Raise InvalidConfigError naming every rule (id and reason) that ``config`` breaks for ``model``
    trained as ``training``; return when the executor builds it."""
    rejections = check(model, training, config)
    if rejections:
        raise InvalidConfigError(refusal(model, config, rejections))


def training_for(seq_length: int, global_batch_size: int, capacity_factor: float | None,
                 pad_to_capacity: bool = False) -> TrainingSpec:
    """The TrainingSpec the rule book judges a run by when the executor is given its parts (tokens per
    sequence, sequences per step, the router's capacity factor: None for dropless routing; whether the experts'
    input is padded to capacity)."""
    return TrainingSpec(seq_length=seq_length, global_batch_size=global_batch_size,
                        routing_mode="dropless" if capacity_factor is None else "capacity",
                        moe_expert_capacity_factor=capacity_factor,
                        moe_pad_expert_input_to_capacity=pad_to_capacity)
