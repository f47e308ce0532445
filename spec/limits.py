"""The largest sizes foldtune accepts: every count or width a user can send (model, training, cluster,
search budget) has its bound here, and only here.

The bounds sit far above any published model so that no real request meets them; they exist because the
specs drive per-layer lists, per-expert loads and layout enumerations whose size follows these numbers, and
a request naming a billion layers must be refused in microseconds instead of building a billion-entry list.
Each bound's error names the field, the limit and the value sent (:func:`bound_problems`).
"""

from __future__ import annotations

from collections.abc import Mapping

from spec.documents import MAX_DOCUMENT_LENGTH, MAX_DOCUMENT_SAMPLE

#: decoder layers of a model (and of a proxy, a pipeline stage, a 0/1 per-layer pattern); published: <= 126
MAX_LAYERS = 4096
#: multi-token-prediction layers (DeepSeek-V3: 1)
MAX_MTP_LAYERS = 64
#: hidden, FFN, expert-FFN, per-head and latent widths (elements); published: <= 53,248
MAX_WIDTH = 1 << 18
#: attention heads and key/value groups; published: <= 128
MAX_HEADS = 4096
#: routed experts (and router groups, top-k); published: <= 384
MAX_EXPERTS = 16384
#: vocabulary entries (and the padding multiple); published: <= ~256 K
MAX_VOCAB = 1 << 24
#: tokens per trained sequence
MAX_SEQ_LENGTH = 1 << 20
#: positions a model may embed, and a sliding window's reach (tokens)
MAX_POSITIONS = 1 << 24
#: sequences per optimizer step (global batch size)
MAX_GLOBAL_BATCH = 1 << 24
#: GPUs of one cluster
MAX_GPUS = 65536
#: measured trials of one tuning job
MAX_TRIALS = 10_000
#: layouts one verify job checks by slices (each builds and times one rank: minutes on a GPU at real widths)
MAX_VERIFY_LAYOUTS = 64
#: decoder layers of each kind one slice builds
MAX_SLICE_LAYERS = 64
#: complete checkpoints a training keeps (its newest; 0 keeps all)
MAX_KEEP_LAST = 10_000
#: tokens a "time and cost to train N tokens" question may name; published pre-training runs: <= ~36 T
MAX_TRAIN_TOKENS = 10**16
#: US dollars per GPU-hour a cost question may name; rented H200/B200 hours cost ~2-10 USD
MAX_PRICE_PER_GPU_HOUR = 1000.0
#: routed-token counts (MoE layers × experts) a training stores per optimizer step (about 25 KB of JSON at
#: most); a wider model keeps evenly spaced MoE layers, e.g. 32 of Qwen3-30B-A3B's 48 × 128 and 16 of
#: DeepSeek-V3's 59 × 256 (MTP included), while Mixtral's 32 × 8 and every tiny proxy keep all
MAX_EXPERT_LOAD_CELLS = 4096
#: ratios bounded by the expert count: busiest expert's tokens over the mean (at most E by definition) and
#: the capacity factor (beyond E every expert can hold every token)
MAX_EXPERT_RATIO = float(MAX_EXPERTS)

#: ModelSpec fields and their bounds (a tuple-valued field's numbers each)
MODEL_BOUNDS: Mapping[str, int] = {
    "num_layers": MAX_LAYERS, "mtp_num_layers": MAX_MTP_LAYERS, "moe_first_k_dense": MAX_LAYERS,
    "moe_layer_freq": MAX_LAYERS, "window_attn_skip_freq": MAX_LAYERS,
    "hidden_size": MAX_WIDTH, "ffn_hidden_size": MAX_WIDTH, "moe_ffn_hidden_size": MAX_WIDTH,
    "moe_shared_expert_intermediate_size": MAX_WIDTH, "kv_channels": MAX_WIDTH, "q_lora_rank": MAX_WIDTH,
    "kv_lora_rank": MAX_WIDTH, "qk_head_dim": MAX_WIDTH, "qk_pos_emb_head_dim": MAX_WIDTH, "v_head_dim": MAX_WIDTH,
    "num_attention_heads": MAX_HEADS, "num_query_groups": MAX_HEADS,
    "num_experts": MAX_EXPERTS, "moe_router_topk": MAX_EXPERTS, "moe_router_num_groups": MAX_EXPERTS,
    "moe_router_group_topk": MAX_EXPERTS,
    "vocab_size": MAX_VOCAB, "make_vocab_size_divisible_by": MAX_VOCAB,
    "max_position_embeddings": MAX_POSITIONS, "window_size": MAX_POSITIONS,
}
#: ModelSpec's per-layer 0/1 patterns and their most entries
MODEL_LENGTHS: Mapping[str, int] = {"moe_layer_freq": MAX_LAYERS, "window_attn_skip_freq": MAX_LAYERS}

#: TrainingSpec fields and their bounds
TRAINING_BOUNDS: Mapping[str, int | float] = {
    "seq_length": MAX_SEQ_LENGTH, "global_batch_size": MAX_GLOBAL_BATCH,
    "moe_routing_imbalance": MAX_EXPERT_RATIO, "moe_expert_capacity_factor": MAX_EXPERT_RATIO,
    "document_lengths": MAX_DOCUMENT_LENGTH,
}
#: TrainingSpec's per-expert list and its most entries (its entries are any positive weights)
TRAINING_LENGTHS: Mapping[str, int] = {"moe_expert_load": MAX_EXPERTS, "document_lengths": MAX_DOCUMENT_SAMPLE}

#: ClusterSpec fields and their bounds
CLUSTER_BOUNDS: Mapping[str, int] = {"num_gpus": MAX_GPUS}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shown(value: int | float) -> str:
    """``value`` as text, a huge integer by its digit count (str() of one refuses past 4,300 digits)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"a {int(value.bit_length() * 0.30103) + 1}-digit number"
    return repr(value)


def too_large(name: str, value: int | float, limit: int | float) -> str:
    """The one error message of a bound: the field, the limit and what was sent."""
    return f"{name} must be at most {limit:g}, got {_shown(value)}" if isinstance(limit, float) else \
        f"{name} must be at most {limit}, got {_shown(value)}"


def bound_problems(problems: list[str], owner: object, bounds: Mapping[str, int | float],
                   lengths: Mapping[str, int] | None = None) -> None:
    """Append a message to ``problems`` for every attribute of ``owner`` that exceeds its bound: a number
    named in ``bounds`` by its value (a tuple's numbers each), a tuple or list named in ``lengths`` by its
    length. Values of the wrong type are left to the owner's own checks."""
    for name, limit in (lengths or {}).items():
        value = getattr(owner, name)
        if isinstance(value, tuple | list) and len(value) > limit:
            problems.append(f"{name} must hold at most {limit} entries, got {len(value)}")
    for name, limit in bounds.items():
        value = getattr(owner, name)
        numbers = value if isinstance(value, tuple | list) else (value,)
        largest = max((v for v in numbers if _is_number(v)), default=None)
        if largest is not None and largest > limit:
            problems.append(too_large(name, largest, limit))
