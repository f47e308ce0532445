"""ExecutorOptions: the knobs of the executor that are neither the model, the training recipe nor the layout."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from spec.errors import SpecError
from spec.model_spec import ModelSpec
from spec.router_options import DROP_POLICIES, LOAD_BALANCING_TYPES, RouterOptions
from spec.training_spec import TrainingSpec
from spec.validity import executor_model_rule

#: Logits per block of the fused output layer + loss: 2**26 (its fp32 copy is 256 MiB).
DEFAULT_CHUNK_LOGITS = 2**26
#: Bytes of logits the fused output layer + loss keeps whole from forward to backward (16 GiB): up to there it
#: skips the backward's second output GEMM and the per-block input-gradient sums, which cost more time than the
#: bf16 logits cost memory on the proxies' micro-batches (docs/benchmarks.md, the whole step's kernels).
DEFAULT_KEEP_LOGITS = 2**34
#: SDPA kernels ``ExecutorOptions.attention_backend`` may ask for first (CUDA only; CPU keeps torch's choice).
ATTENTION_BACKENDS = ("auto", "cudnn", "flash")
EP_OVERLAP_TRANSPORTS = ("auto", "nccl", "copy_engine")
#: ExecutorOptions.fp8_expert_gemm -> the scaling of foldtune's grouped fp8 kernels (None: torch's kernel);
#: 'auto' is foldtune's rowwise path with torch's kernel among the forward and dgrad's tuning candidates;
#: 'fastest' is torch's kernel or bf16, per shape (executor.kernels.fp8.expert_pick).
FP8_EXPERT_GEMMS = {"fastest": None, "torch": None, "foldtune-rowwise": "rowwise", "foldtune-blockwise": "blockwise",
                    "auto": "rowwise"}


@dataclass(frozen=True)
class ExecutorOptions:
    """Router losses, expert bias, capacity, kernels and initialisation (Megatron argument names).

    The router fields are :class:`spec.router_options.RouterOptions`' (see there; here the expert bias is
    decided, not None); :meth:`for_training` builds them from a TrainingSpec and RouterOptions.
    ``moe_expert_capacity_factor`` None means dropless; ``moe_pad_expert_input_to_capacity`` (with a capacity
    factor, the rule book's ``pad_to_capacity``) pads every expert's input to its capacity.
    ``mtp_loss_scaling_factor``: weight of the multi-token-prediction loss (the mean over depths of each
    depth's cross-entropy) added to the main loss, Megatron's default 0.1 (models with ``mtp_num_layers``).
    ``cross_entropy_chunk_logits``: the output layer and loss hold at most this many logits (tokens × this
    rank's vocabulary rows) at once, fused and blocked over the vocabulary (default 2**26: a 256 MiB fp32
    block); 0 computes the whole [tokens, vocab/tp] logits and then their fp32 copies, as Megatron's
    unfused loss does (see ``executor.parallel.linear_cross_entropy``). ``cross_entropy_keep_logits`` (bytes,
    default 16 GiB; 0: never): where a micro-batch's whole logits [tokens, vocab/tp] in the compute dtype take at
    most this many bytes, the fused loss computes them in one GEMM and keeps them for the backward, which then
    turns them into their gradient in place and runs two whole GEMMs instead of a second output GEMM and a
    per-block fp32 sum (``costmodel.loss`` prices the bytes held and the work saved).

    Decoder-stack speed switches (each tested equal to the path it replaces, see
    tests/executor/test_stack_fusions.py): ``fused_qkv`` runs the Q, K and V projections as one GEMM against
    the three weights concatenated (one [tokens, h] × [h, (heads + 2·kv_heads)·d] product instead of three,
    the K/V ones narrow); ``fused_rope`` rotates q and k in one Triton kernel launch on CUDA (torch elsewhere);
    ``attention_backend`` picks SDPA's kernel on CUDA: 'auto' (torch's choice, flash on Hopper), 'cudnn'
    (cuDNN first, then torch's order), 'flash'. ``cuda_graphs`` overrides the layout's knob of that name
    (``ParallelConfig.cuda_graphs``; None, the default, follows the layout): each decoder layer's static part
    (attention block with its norm and residual, the MLP/MoE input norm, the router's logits and the shared
    experts: ``spec.validity.cuda_graph_scope``) replayed from a CUDA graph captured per micro-batch shape, fwd
    and bwd (:mod:`executor.cuda_graphs`; where it is refused, and why).

    ``ep_overlap_sm_carveout`` (SMs, default 0: none): with ``overlap_moe_expert_parallel_comm``, the number
    of SMs the compute kernels beside an overlapped EP all-to-all leave free for its NCCL kernel, through
    torch's experimental SM carveout, set only while such an exchange is in flight (executor/ep_overlap.py
    says which kernels honour it: the grouped GEMM of ``torch._grouped_mm`` on SM90 and cuBLASLt GEMMs, not
    the default cuBLAS path). No effect on CPU nor without the overlap. An executor knob, not searched by
    the planner.

    ``ep_overlap_transport`` (with ``overlap_moe_expert_parallel_comm``): what moves the EP all-to-alls that
    run beside the other micro-batch's compute, on CUDA: 'copy_engine' (peer copies over symmetric memory,
    no SM taken from that compute: executor/parallel/copy_engine_alltoall.py; every rank of the EP group on
    one node; each rank holds 256 MiB of inboxes outside PyTorch's allocator), 'nccl'
    (``all_to_all_single``), or 'auto' (the default: the copy engines where every rank of the EP group is on
    one node and all of them could build the transport, NCCL otherwise). With 'auto' the exchanges that
    run in line (the first forward's, the last backward's) go over NCCL, faster alone; 'copy_engine' moves
    every exchange of the overlapped schedule. Elsewhere (CPU) gloo moves them all.

    ``fp8_expert_gemm`` (precision fp8 only; no effect in other precisions): what runs the routed experts'
    forward, dgrad and wgrad. 'fastest' (the default): per expert linear shape, bf16 (``torch._grouped_mm``)
    or 'torch' below as its first call on a CUDA GPU timed them over the whole layer (forward, dgrad and wgrad,
    the activations' quantisation included, the cached weights' not; fp8 only where faster by more than
    ``spec.fp8_choice.FP8_CHOICE_MARGIN``), kept per shape for the process
    (:mod:`executor.kernels.fp8.expert_pick`, whose ``report`` and the profile's fp8 report say which shapes
    ran bf16). The default because fp8 is asked for speed, and at the fine-grained
    experts' shapes torch's fp8 grouped GEMM runs at about half bf16's rate (docs/benchmarks.md): with
    'fastest' precision fp8 never runs an expert linear slower than bf16 would, and runs fp8 where fp8 is
    faster (Mixtral's wide experts); the price is bf16 numbers at the shapes that ran bf16, one timing of
    both paths per shape at the first step, and a choice that may differ between ranks and between runs
    where the two are within noise. Where nothing can be timed (CPU, a CUDA graph capture) it runs 'torch'
    (on CPU its emulation: the same fp8 numbers as 'torch'). 'torch': ``torch._scaled_grouped_mm`` with
    rowwise scales for forward and dgrad, the wgrad as FOLDTUNE_FP8_WGRAD says (:mod:`executor.kernels.fp8.gemm`);
    'foldtune-rowwise' / 'foldtune-blockwise': foldtune's persistent grouped Triton kernels, all three
    products in fp8, with rowwise or DeepSeek-V3's blockwise scaling (1 × 128 activations, 128 × 128
    weights), the activations quantised into both their forms in one pass
    (:mod:`executor.kernels.fp8.grouped_gemm`). Blockwise changes the numbers, not only the speed. 'auto':
    'foldtune-rowwise' whose forward and dgrad run, shape by shape, on whichever of foldtune's kernel and
    torch's rowwise grouped GEMM its first call timed faster (the same operands and scales, so the same
    numbers up to fp32 summation order); the wgrad is foldtune's. On CPU they are emulated; on a GPU whose
    kernels fail their first-use check the experts run on 'torch'.
    """

    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: float | None = None
    moe_token_drop_policy: str = "probs"
    # with a capacity factor: every expert computes exactly its capacity of rows (TrainingSpec's field)
    moe_pad_expert_input_to_capacity: bool = False
    # Benchmarks only: assign experts round-robin (perfect balance) instead of by score, as Megatron's
    # --moe-router-force-load-balancing does, to measure the layout without an untrained router's skew.
    moe_router_force_load_balancing: bool = False
    mtp_loss_scaling_factor: float = 0.1
    kernel_backend: str = "torch"
    cross_entropy_chunk_logits: int = DEFAULT_CHUNK_LOGITS
    cross_entropy_keep_logits: int = DEFAULT_KEEP_LOGITS
    fused_qkv: bool = True
    fused_rope: bool = True
    fused_rms_norm: bool = True
    attention_backend: str = "auto"
    cuda_graphs: bool | None = None
    ep_overlap_sm_carveout: int = 0
    ep_overlap_transport: str = "auto"
    fp8_expert_gemm: str = "fastest"
    init_method_std: float = 0.02
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
            raise SpecError(f"moe_router_load_balancing_type must be one of {LOAD_BALANCING_TYPES}, "
                            f"got {self.moe_router_load_balancing_type!r}")
        if self.moe_token_drop_policy not in DROP_POLICIES:
            raise SpecError(f"moe_token_drop_policy must be one of {DROP_POLICIES}, got {self.moe_token_drop_policy!r}")
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor <= 0:
            raise SpecError(f"moe_expert_capacity_factor must be > 0, got {self.moe_expert_capacity_factor}")
        if self.mtp_loss_scaling_factor < 0:
            raise SpecError(f"mtp_loss_scaling_factor must be >= 0, got {self.mtp_loss_scaling_factor}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise SpecError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.ep_overlap_sm_carveout < 0:
            raise SpecError(f"ep_overlap_sm_carveout must be >= 0, got {self.ep_overlap_sm_carveout}")
        if self.ep_overlap_transport not in EP_OVERLAP_TRANSPORTS:
            raise SpecError(f"ep_overlap_transport must be one of {EP_OVERLAP_TRANSPORTS}, "
                            f"got {self.ep_overlap_transport!r}")
        if self.fp8_expert_gemm not in FP8_EXPERT_GEMMS:
            raise SpecError(f"fp8_expert_gemm must be one of {tuple(FP8_EXPERT_GEMMS)}, got {self.fp8_expert_gemm!r}")
        if self.cross_entropy_chunk_logits < 0:
            raise SpecError(f"cross_entropy_chunk_logits must be >= 0, got {self.cross_entropy_chunk_logits}")
        if self.cross_entropy_keep_logits < 0:
            raise SpecError(f"cross_entropy_keep_logits must be >= 0, got {self.cross_entropy_keep_logits}")

    def graphs_on(self, config) -> bool:
        """Whether the layers of ``config`` (a ParallelConfig) run from CUDA graphs: this override, else the
        layout's ``cuda_graphs``."""
        return bool(config.cuda_graphs) if self.cuda_graphs is None else self.cuda_graphs

    @classmethod
    def for_training(cls, training: TrainingSpec, router: RouterOptions | None = None,
                     model: ModelSpec | None = None, **overrides: Any) -> ExecutorOptions:
        """Options that follow a TrainingSpec's routing mode (capacity factor when 'capacity') and the router
        options (defaults: RouterOptions()), resolved for ``model`` when given (expert bias None: the model
        decides; without a model, off). SpecError when the router options do not fit the model."""
        cf = training.moe_expert_capacity_factor if training.routing_mode == "capacity" else None
        return cls.for_router(router, model, **{"moe_expert_capacity_factor": cf,
                                                "moe_pad_expert_input_to_capacity":
                                                    training.moe_pad_expert_input_to_capacity, **overrides})

    @classmethod
    def for_router(cls, router: RouterOptions | None = None, model: ModelSpec | None = None,
                   **overrides: Any) -> ExecutorOptions:
        """Options carrying ``router`` (as :meth:`for_training`, dropless unless ``overrides`` say otherwise)."""
        router = router or RouterOptions()
        if model is not None:
            router = router.resolve(model)
        fields = {**router.to_dict(), "moe_router_enable_expert_bias": bool(router.moe_router_enable_expert_bias)}
        return cls(**{**fields, **overrides})

    def router_options(self) -> RouterOptions:
        """The router options these executor options carry."""
        return RouterOptions.pick(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_model_supported(model: ModelSpec) -> None:
    """Raise SpecError for architecture features this executor does not build (yet)."""
    rejection = executor_model_rule(model)
    if rejection is not None:
        raise SpecError(rejection.reason)
