"""Entering and leaving a tensor-parallel region under sequence parallelism.

Between layers each TP rank holds a 1/tp slice of the sequence ([s/tp, b, h]). A column-parallel linear
needs the whole sequence: :func:`enter_tp` all-gathers it (backward: reduce-scatter). A row-parallel
linear leaves partial sums: :func:`leave_tp` reduce-scatters them back to sequence slices (backward:
all-gather). Without sequence parallelism (tp == 1 only, see :func:`check_layout`) both are identities.
"""

from __future__ import annotations

import torch

from spec.errors import InvalidConfigError
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from executor.parallel.collectives import all_gather, reduce_scatter
from executor.parallel.groups import ParallelState


def enter_tp(x_SBH: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Full-sequence input of a column-parallel linear from this rank's sequence slice."""
    return all_gather(x_SBH, state.tp)


def leave_tp(y_SBH: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This rank's sequence slice of the sum of the row-parallel partial outputs."""
    return reduce_scatter(y_SBH, state.tp)


def check_layout(model: ModelSpec, config: ParallelConfig, seq_length: int) -> None:
    """Raise InvalidConfigError for layouts this executor cannot run, naming the offending values."""
    problems = []
    if config.tp > 1 and not config.sequence_parallel:
        problems.append("tp > 1 needs sequence_parallel (as Megatron requires for MoE)")
    if seq_length % (2 * config.cp):
        problems.append(f"seq_length ({seq_length}) must be divisible by 2·cp ({2 * config.cp})")
    if model.num_layers < config.pp * config.vpp:
        problems.append(f"num_layers ({model.num_layers}) must be at least pp·vpp ({config.pp}·{config.vpp})")
    if config.vpp > 1 and config.pp == 1:
        problems.append(f"vpp={config.vpp} needs pp > 1")
    if config.pp > 1 and not model.untie_embeddings_and_output_weights:
        problems.append("pp > 1 needs untied embedding and output weights")
    if model.num_attention_heads % config.tp or model.num_kv_heads % config.tp:
        problems.append(f"attention heads ({model.num_attention_heads}) and kv heads ({model.num_kv_heads}) "
                        f"must be divisible by tp ({config.tp})")
    if model.ffn_hidden_size % config.tp:
        problems.append(f"ffn_hidden_size ({model.ffn_hidden_size}) must be divisible by tp ({config.tp})")
    if model.shared_expert_ffn_hidden_size % config.tp:
        problems.append(f"moe_shared_expert_intermediate_size ({model.shared_expert_ffn_hidden_size}) must be "
                        f"divisible by tp ({config.tp})")
    if seq_length % (config.tp * config.cp):
        problems.append(f"seq_length ({seq_length}) must be divisible by tp·cp ({config.tp}·{config.cp})")
    if model.is_moe:
        if model.num_experts % config.ep:
            problems.append(f"num_experts ({model.num_experts}) must be divisible by ep ({config.ep})")
        if model.expert_ffn_hidden_size % config.etp:
            problems.append(f"expert ffn ({model.expert_ffn_hidden_size}) must be divisible by etp ({config.etp})")
    elif config.ep > 1 or config.etp > 1:
        problems.append(f"ep={config.ep}, etp={config.etp} need a MoE model")
    if problems:
        raise InvalidConfigError(f"layout {config.label()} for {model.name}: " + "; ".join(problems))
