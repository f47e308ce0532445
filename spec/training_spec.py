"""TrainingSpec: what is trained per step (sequence, batch, precision, optimizer, routing mode)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from spec._validate import positive_ints, raise_if, require
from spec.documents import attention_share, length_problems
from spec.errors import SpecError
from spec.limits import TRAINING_BOUNDS, TRAINING_LENGTHS, bound_problems
from spec.suggest import unknown_fields

PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
ROUTING_MODES = ("dropless", "capacity")
OPTIMIZERS = ("adam",)
#: Transformer Engine's fp8 recipes, as Megatron's ``--fp8-recipe`` names them: tensorwise (current scaling, one
#: scale per tensor computed from its own amax), delayed (scales from an amax history), blockwise (1x128 tiles of
#: activations, 128x128 of weights; DeepSeek-V3's recipe) and mxfp8 (one power-of-two scale per 32 elements)
FP8_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
#: Megatron's ``--cross-entropy-fusion-impl``: native (megatron/core/fusions/fused_cross_entropy.py) or te
#: (Transformer Engine's parallel_cross_entropy)
CROSS_ENTROPY_FUSION_IMPLS = ("native", "te")


@dataclass(frozen=True)
class TrainingSpec:
    """The training recipe a layout must serve.

    ``distributed_optimizer`` is the user's constraint: True/False forces it, None lets the planner try
    both. ``moe_routing_imbalance`` is the expected ratio of the busiest expert's tokens to the mean
    (1.0 = perfectly balanced); the memory and time models size expert buffers and GEMMs by it.
    ``moe_expert_load``, when given, replaces it with what the routing measured: the share of routed tokens
    of each expert (:meth:`ep_imbalance` groups them by EP rank).
    ``flash_attention`` False models the unfused softmax path (it stores the s×s score matrix).
    ``gradient_accumulation_fusion`` True models Megatron's fused weight-gradient accumulation (no separate
    per-micro-batch pass over the main gradients).
    ``sequence_parallel_regather`` True models Megatron's column-parallel linears under sequence parallelism,
    which keep their input sharded and all-gather it again in backward for the weight gradient; foldtune's
    executor keeps the gathered input instead (one all-gather fewer per TP block in backward).
    ``fused_window_sink_attention`` True models Megatron's fused attention kernel (Transformer Engine / cuDNN)
    for layers with a sliding window or attention sinks: flash-style, a windowed layer computes only the
    scores inside its window and nothing of size s×s is stored. foldtune's executor (False) runs those layers
    as an explicit masked softmax over the whole [s/cp, s] score matrix (in fp32 with sinks) and keeps it.
    ``megatron_cross_entropy`` True models Megatron's output layer and loss (``vocab_parallel_cross_entropy``,
    or its ``--cross-entropy-loss-fusion`` kernel): the whole [tokens, vocab/tp] logits in the compute dtype,
    then one fp32 softmax per output head kept from forward to backward. foldtune's executor (False) fuses the
    output layer with the loss, blocked over the vocabulary (no logits kept; one more output-layer GEMM in
    backward), see ``executor/parallel/linear_cross_entropy.py``.
    ``moe_pad_expert_input_to_capacity`` (Megatron's flag; with capacity routing, rule ``pad_to_capacity``)
    pads every expert's input to its capacity: :meth:`expert_rows_factor` is then the capacity factor.
    ``transformer_engine_fp8`` True models Transformer Engine's fp8 casts (one fused cast-transpose per GEMM
    input, dense and expert alike, and per weight once a step); foldtune's executor (False) quantises a dense
    linear's input and output gradient in both forms from two reads, the experts' rows rowwise only (their
    weight gradient runs in bf16), and each GEMM weight in both forms once a step (costmodel/step_time.py). In
    memory it models what Transformer Engine's modules keep for backward: the fp8 copy of a GEMM's input
    (1 byte per element plus ``fp8_recipe``'s scales) where its module saves that copy instead of the 16-bit
    input (docs/memory-model.md, "Megatron-Core's accounting").
    ``fp8_recipe`` (one of :data:`FP8_RECIPES`, Megatron's ``--fp8-recipe``): the scaling recipe Transformer
    Engine quantises with; read with ``transformer_engine_fp8`` only (the executor's fp8 has its own rowwise
    scaling).
    ``fp8_param_gather`` (Megatron's ``--fp8-param-gather``): the model's GEMM weights are fp8 tensors (no
    16-bit copy beside the optimizer's fp32 master), gathered in fp8.
    The optimizer state's dtypes (Megatron's precision-aware optimizer) are the layout's
    (``ParallelConfig.exp_avg_dtype`` ...): the planner searches them and the executor runs them.
    ``cross_entropy_fusion_impl`` (one of :data:`CROSS_ENTROPY_FUSION_IMPLS`), read with
    ``megatron_cross_entropy`` only: Megatron's native fused loss keeps an fp32 softmax per head; Transformer
    Engine's keeps the 16-bit logits and writes their gradient over them.
    ``document_lengths``: packed sequences (``data prepare --pack``) made of documents of these lengths (tokens;
    a sample of the dataset's, at most ``spec.documents.MAX_DOCUMENT_SAMPLE``): causal attention costs
    :meth:`document_attention_share` of an unpacked sequence's (Σ len²/2 over the documents instead of seq²/2,
    :mod:`spec.documents`). None: unpacked sequences.
    ``megatron_memory`` True models the tensors Megatron-Core keeps where they differ from foldtune's executor
    (the MoE dispatcher's saved tensors, multi-latent attention's output, the distributed optimizer's gradient
    shards, the optimizer step's copies; docs/memory-model.md, "Megatron-Core's accounting"). Like the other
    Megatron switches it prices Megatron's implementation and leaves the executor's runs as they are.
    """

    seq_length: int
    global_batch_size: int
    precision: str = "bf16"
    optimizer: str = "adam"
    distributed_optimizer: bool | None = None
    routing_mode: str = "dropless"
    moe_expert_capacity_factor: float | None = None
    moe_routing_imbalance: float = 1.0
    # measured share of routed tokens per expert (any positive weights, normalised here; e.g. a profiled run's
    # tokens_per_expert): when given, the busiest EP rank's load is computed per layout from it
    moe_expert_load: tuple[float, ...] | None = None
    flash_attention: bool = True
    main_grads_fp32: bool = True  # Megatron accumulates grads in fp32 (the 18-byte recipe)
    # Megatron's --gradient-accumulation-fusion: the weight-gradient GEMM adds straight into the fp32 main
    # gradient. foldtune's executor does not fuse (it adds each micro-batch's gradient in a separate kernel),
    # so the default prices that traffic; set True to model Megatron runs.
    gradient_accumulation_fusion: bool = False
    # Megatron re-gathers a sequence-parallel linear's input in backward (memory for traffic); the executor's
    # autograd keeps the gathered input, (1 - 1/tp) of it more per TP block, which the memory model adds only
    # for MLA's gathered latents (whole by default, split over TP under this switch)
    sequence_parallel_regather: bool = False
    # Megatron's fused kernel for windowed / sink attention layers; the executor's masked path when False
    fused_window_sink_attention: bool = False
    # Megatron's whole-logits loss (one fp32 softmax kept per head); the executor's vocabulary-blocked fused
    # output layer + loss when False
    megatron_cross_entropy: bool = False
    # Transformer Engine's fp8 casts (Megatron runs); the executor's quantisation when False (precision fp8 only)
    transformer_engine_fp8: bool = False
    # Megatron's --moe-pad-expert-input-to-capacity: under capacity routing every expert computes exactly its
    # capacity of rows (the dropped-to tokens padded with zero-weight rows): static shapes, more GEMM rows
    moe_pad_expert_input_to_capacity: bool = False
    # Transformer Engine's fp8 scaling recipe (with transformer_engine_fp8)
    fp8_recipe: str = "tensorwise"
    # Megatron's fp8 primary weights (--fp8-param-gather)
    fp8_param_gather: bool = False
    # Megatron's fused loss implementation (with megatron_cross_entropy)
    cross_entropy_fusion_impl: str = "native"
    # the tensors Megatron-Core keeps where they differ from the executor's
    megatron_memory: bool = False
    # packed sequences' document lengths (a sample), which price attention within documents
    document_lengths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        p: list[str] = []
        bound_problems(p, self, TRAINING_BOUNDS, TRAINING_LENGTHS)
        positive_ints(p, self, ("seq_length", "global_batch_size"))
        require(p, self.precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        require(p, self.optimizer in OPTIMIZERS, f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        require(p, self.fp8_recipe in FP8_RECIPES,
                f"fp8_recipe must be one of {FP8_RECIPES}, got {self.fp8_recipe!r}")
        require(p, self.cross_entropy_fusion_impl in CROSS_ENTROPY_FUSION_IMPLS,
                f"cross_entropy_fusion_impl must be one of {CROSS_ENTROPY_FUSION_IMPLS}, "
                f"got {self.cross_entropy_fusion_impl!r}")
        require(p, self.routing_mode in ROUTING_MODES,
                f"routing_mode must be one of {ROUTING_MODES}, got {self.routing_mode!r}")
        if self.routing_mode == "capacity":
            cf = self.moe_expert_capacity_factor
            require(p, cf is not None and cf > 0,
                    f"routing_mode 'capacity' needs moe_expert_capacity_factor > 0, got {cf!r}")
        else:
            require(p, self.moe_expert_capacity_factor is None,
                    "moe_expert_capacity_factor is only meaningful with routing_mode 'capacity'")
        require(p, self.moe_routing_imbalance >= 1.0,
                f"moe_routing_imbalance must be >= 1.0 (max/mean tokens per expert), got {self.moe_routing_imbalance}")
        load = self.moe_expert_load
        if load is not None:
            if isinstance(load, list):  # JSON round trips give lists; the spec stays hashable
                object.__setattr__(self, "moe_expert_load", tuple(float(x) for x in load))
                load = self.moe_expert_load
            require(p, len(load) > 0 and all(x >= 0 for x in load) and sum(load) > 0,
                    f"moe_expert_load must be non-negative shares with a positive sum, got {load}")
        if self.document_lengths is not None:
            if isinstance(self.document_lengths, list):  # JSON round trips give lists; the spec stays hashable
                object.__setattr__(self, "document_lengths", tuple(self.document_lengths))
            p += length_problems(self.document_lengths)
        raise_if(p, "training spec")

    def document_attention_share(self) -> float:
        """Causal attention work per sequence as a share of an unpacked one's: 1.0 without ``document_lengths``."""
        if self.document_lengths is None:
            return 1.0
        return attention_share(self.document_lengths, self.seq_length)

    def expert_rows_factor(self, ep: int) -> float:
        """Rows the busiest EP rank's experts compute per micro-batch over the balanced share (routed copies / ep):
        :meth:`ep_imbalance`, capped at the capacity factor under capacity routing, and exactly the capacity
        factor when the experts' input is padded to capacity (every expert computes its whole capacity)."""
        factor = self.ep_imbalance(ep)
        if self.routing_mode == "capacity" and self.moe_expert_capacity_factor is not None:
            cf = self.moe_expert_capacity_factor
            factor = cf if self.moe_pad_expert_input_to_capacity else min(factor, cf)
        return factor

    def ep_imbalance(self, ep: int) -> float:
        """Busiest EP rank's routed tokens over the mean rank's (>= 1; 1.0 with EP = 1, where every expert is
        local and the total cannot be imbalanced). From ``moe_expert_load`` (experts ``r·E/ep ... (r+1)·E/ep−1``
        on rank r, as the executor places them) when given, else ``moe_routing_imbalance``."""
        if ep <= 1:
            return 1.0
        load = self.moe_expert_load
        if load is None:
            return self.moe_routing_imbalance
        n = len(load)
        if n % ep:
            return self.moe_routing_imbalance
        per = n // ep
        ranks = [sum(load[r * per:(r + 1) * per]) for r in range(ep)]
        return max(1.0, max(ranks) * ep / sum(ranks))

    @property
    def param_bytes(self) -> int:
        """Bytes of one model weight as stored for compute (fp8 training keeps bf16 weights)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def activation_bytes(self) -> int:
        """Bytes of one stored activation element (fp8 still stores most activations in bf16)."""
        return 4 if self.precision == "fp32" else 2

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values; ``document_lengths`` only when given, so that an unpacked request keeps
        the dict (and the service's job signature over it) it had before packed sequences existed."""
        data = asdict(self)
        if data["document_lengths"] is None:
            del data["document_lengths"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingSpec:
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise SpecError(unknown_fields("training", unknown, [f.name for f in fields(cls)]))
        try:
            return cls(**data)
        except TypeError as exc:
            raise SpecError(f"training spec: {exc}") from None
