"""ModelSpec: the architecture of a (MoE) decoder-only transformer, in Megatron-LM's argument names."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from spec._validate import positive_ints, raise_if, require
from spec.errors import SpecError
from spec.suggest import unknown_fields

ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid")
NORMALIZATIONS = ("rmsnorm", "layernorm")
POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
QK_LAYERNORM_SCOPES = ("head", "all")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, dense or Mixture-of-Experts.

    Field names follow Megatron-LM's arguments so that a spec reads like a launch script. Sizes are
    element counts (not bytes). A model is MoE when ``num_experts`` is set; which layers carry the MoE
    MLP is given by ``moe_layer_freq`` (every n-th layer, or an explicit 0/1 pattern) after the first
    ``moe_first_k_dense`` dense layers (DeepSeek's ``first_k_dense_replace``).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    num_query_groups: int | None = None  # GQA key/value heads; None means MHA
    kv_channels: int | None = None  # per-head dim; None means hidden_size // num_attention_heads
    swiglu: bool = True
    # GPT-OSS's GLU: quick_gelu(gate) = gate·sigmoid(1.702·gate) times (up + glu_linear_offset), gate clamped
    # above and up clamped on both sides at activation_func_clamp_value (Megatron's --quick-geglu)
    quick_geglu: bool = False
    activation_func_clamp_value: float | None = None
    glu_linear_offset: float = 0.0
    normalization: str = "rmsnorm"
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    # What qk_layernorm's RMSNorm spans: 'head' normalises each head's d values (Qwen3; weights [d]); 'all'
    # normalises a token's whole q (heads·d) and k (kv_heads·d) at once before the head split (OLMoE; weights
    # [heads·d] and [kv_heads·d]). Not with multi_latent_attention.
    qk_layernorm_scope: str = "head"
    # 'learnable': one learned logit per head joins the softmax denominator (GPT-OSS attention sinks);
    # 'off-by-one': that logit is fixed at 0
    softmax_type: str = "vanilla"
    # Sliding-window attention: (left, right) tokens around the query, -1 unbounded; with
    # window_attn_skip_freq N every N-th layer (1-based) attends fully, or a 0/1 pattern with 1 = windowed
    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    position_embedding_type: str = "rope"
    max_position_embeddings: int = 4096
    untie_embeddings_and_output_weights: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    make_vocab_size_divisible_by: int = 128
    # Multi-latent attention (DeepSeek-V2/V3)
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # Mixture of experts
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    # Qwen2-MoE: the shared experts' output scaled per token by sigmoid(x · w), w [1, hidden_size]
    moe_shared_expert_gate: bool = False
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_first_k_dense: int = 0
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    # Multi-token prediction depth (DeepSeek-V3)
    mtp_num_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("moe_layer_freq", "window_size", "window_attn_skip_freq"):  # lists from JSON
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        p: list[str] = []
        positive_ints(p, self, ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                "vocab_size", "max_position_embeddings", "make_vocab_size_divisible_by"))
        require(p, bool(self.name), "name must not be empty")
        if self.num_query_groups is not None:
            require(p, isinstance(self.num_query_groups, int) and self.num_query_groups >= 1,
                    f"num_query_groups must be a positive integer, got {self.num_query_groups!r}")
            if isinstance(self.num_query_groups, int) and self.num_query_groups >= 1:
                require(p, self.num_attention_heads % self.num_query_groups == 0,
                        f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                        f"num_query_groups ({self.num_query_groups})")
        if self.kv_channels is None:
            require(p, self.num_attention_heads < 1 or self.hidden_size % self.num_attention_heads == 0  # <1: reported above
                    or self.multi_latent_attention,
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}) unless kv_channels is given")
        require(p, self.normalization in NORMALIZATIONS,
                f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        require(p, self.position_embedding_type in POSITION_EMBEDDINGS,
                f"position_embedding_type must be one of {POSITION_EMBEDDINGS}, got {self.position_embedding_type!r}")
        require(p, 0.0 <= self.hidden_dropout < 1.0 and 0.0 <= self.attention_dropout < 1.0,
                "dropout probabilities must lie in [0, 1)")
        self._check_attention_and_activation(p)
        require(p, self.mtp_num_layers >= 0, f"mtp_num_layers must be >= 0, got {self.mtp_num_layers}")
        if self.multi_latent_attention:
            require(p, self.num_query_groups is None, "multi_latent_attention excludes num_query_groups (GQA)")
            for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
                value = getattr(self, name)
                require(p, isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
        if self.num_experts is not None:
            require(p, isinstance(self.num_experts, int) and self.num_experts >= 1,
                    f"num_experts must be a positive integer or None, got {self.num_experts!r}")
            require(p, 1 <= self.moe_router_topk <= (self.num_experts or 0),
                    f"moe_router_topk ({self.moe_router_topk}) must lie in [1, num_experts={self.num_experts}]")
            require(p, self.moe_router_score_function in ROUTER_SCORE_FUNCTIONS,
                    f"moe_router_score_function must be one of {ROUTER_SCORE_FUNCTIONS}, "
                    f"got {self.moe_router_score_function!r}")
            require(p, not self.moe_shared_expert_gate or bool(self.moe_shared_expert_intermediate_size),
                    "moe_shared_expert_gate needs shared experts (moe_shared_expert_intermediate_size)")
            require(p, 0 <= self.moe_first_k_dense <= self.num_layers,
                    f"moe_first_k_dense ({self.moe_first_k_dense}) must lie in [0, num_layers={self.num_layers}]")
            if isinstance(self.moe_layer_freq, tuple):
                require(p, len(self.moe_layer_freq) == self.num_layers and set(self.moe_layer_freq) <= {0, 1},
                        f"moe_layer_freq as a pattern must hold num_layers ({self.num_layers}) zeros and ones, "
                        f"got {len(self.moe_layer_freq)} entries")
            else:
                require(p, isinstance(self.moe_layer_freq, int) and self.moe_layer_freq >= 1,
                        f"moe_layer_freq must be a positive integer or a 0/1 pattern, got {self.moe_layer_freq!r}")
            if self.moe_router_num_groups is not None:
                groups = self.moe_router_num_groups
                require(p, groups >= 1 and (self.num_experts or 0) % groups == 0,
                        f"num_experts ({self.num_experts}) must be divisible by moe_router_num_groups ({groups})")
                require(p, self.moe_router_group_topk is not None and 1 <= self.moe_router_group_topk <= groups,
                        f"moe_router_group_topk ({self.moe_router_group_topk}) must lie in [1, moe_router_num_groups={groups}]")
        raise_if(p, f"model {self.name!r}")

    def _check_attention_and_activation(self, p: list[str]) -> None:
        require(p, not (self.swiglu and self.quick_geglu), "swiglu and quick_geglu exclude each other")
        clamp = self.activation_func_clamp_value
        require(p, clamp is None or (isinstance(clamp, (int, float)) and clamp > 0),
                f"activation_func_clamp_value must be positive or None, got {clamp!r}")
        require(p, (clamp is None and not self.glu_linear_offset) or self.gated_linear_unit,
                "activation_func_clamp_value and glu_linear_offset need a gated linear unit (swiglu or quick_geglu)")
        require(p, self.qk_layernorm_scope in QK_LAYERNORM_SCOPES,
                f"qk_layernorm_scope must be one of {QK_LAYERNORM_SCOPES}, got {self.qk_layernorm_scope!r}")
        require(p, self.softmax_type in SOFTMAX_TYPES,
                f"softmax_type must be one of {SOFTMAX_TYPES}, got {self.softmax_type!r}")
        window = self.window_size
        if window is not None:
            require(p, isinstance(window, tuple) and len(window) == 2
                    and all(isinstance(w, int) and w >= -1 for w in window),
                    f"window_size must be two integers >= -1 (left, right), got {window!r}")
        freq = self.window_attn_skip_freq
        if freq is not None:
            require(p, window is not None, "window_attn_skip_freq needs window_size")
            if isinstance(freq, tuple):
                require(p, len(freq) == self.num_layers and set(freq) <= {0, 1},
                        f"window_attn_skip_freq as a pattern must hold num_layers ({self.num_layers}) zeros "
                        f"and ones, got {len(freq)} entries")
            else:
                require(p, isinstance(freq, int) and freq >= 1,
                        f"window_attn_skip_freq must be a positive integer or a 0/1 pattern, got {freq!r}")

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def head_dim(self) -> int:
        """Per-head dimension of Q/K/V for MHA/GQA; of Q and K under MLA (qk_head_dim + qk_pos_emb_head_dim,
        Megatron's q_head_dim, which also sets the softmax scale; V has v_head_dim)."""
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def rotary_head_dim(self) -> int:
        """Per-head dimension RoPE rotates: the decoupled qk_pos_emb_head_dim under MLA, else head_dim."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def gated_linear_unit(self) -> bool:
        """Whether the MLPs are gated (gate and up projections): SwiGLU or GPT-OSS's quick-GeGLU."""
        return self.swiglu or self.quick_geglu

    def attention_window(self, layer: int) -> int | None:
        """Keys before the query that layer ``layer`` (0-based) attends to, None for full causal attention
        (Megatron's is_layer_window_attention, whose layer numbers are 1-based)."""
        if self.window_size is None or self.window_size[0] < 0:
            return None
        freq = self.window_attn_skip_freq
        if isinstance(freq, tuple):
            windowed = bool(freq[layer])
        else:
            windowed = freq is None or (layer + 1) % freq != 0
        return self.window_size[0] if windowed else None

    @property
    def num_kv_heads(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_hidden_size

    @property
    def shared_expert_ffn_hidden_size(self) -> int:
        return self.moe_shared_expert_intermediate_size or 0

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocabulary padded as Megatron pads it: to a multiple of make_vocab_size_divisible_by · tp."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def moe_layer_pattern(self) -> tuple[int, ...]:
        """One entry per decoder layer: 1 where the MLP is MoE, 0 where it is dense."""
        if not self.is_moe:
            return (0,) * self.num_layers
        if isinstance(self.moe_layer_freq, tuple):
            pattern = list(self.moe_layer_freq)
        else:
            pattern = [1 if i % self.moe_layer_freq == 0 else 0 for i in range(self.num_layers)]
        for i in range(min(self.moe_first_k_dense, self.num_layers)):
            pattern[i] = 0
        return tuple(pattern)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_pattern())

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    # ---- (de)serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("moe_layer_freq", "window_size", "window_attn_skip_freq"):
            if isinstance(d[name], tuple):
                d[name] = list(d[name])
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(unknown_fields("model", unknown, known))
        try:
            return cls(**data)
        except TypeError as exc:  # a required field is missing
            raise SpecError(f"model spec {data.get('name', '?')!r}: {exc}") from None

    def with_layers(self, num_layers: int) -> ModelSpec:
        """A proxy of this model with ``num_layers`` decoder layers (fewer or more), the widths kept and the
        MoE pattern kept per layer index; named ``<name>@<num_layers>L``.

        A MoE model keeps at least one MoE layer: where the cut would leave only dense layers (DeepSeek-V3's
        three dense first layers cut to two), the first-k-dense count shrinks to ``num_layers - 1``, and
        failing that (a sparse ``moe_layer_freq``) the last layer becomes MoE, so the proxy still measures
        the experts and their communication.
        """
        patterns = {}
        if isinstance(self.moe_layer_freq, tuple):
            base = self.moe_layer_pattern()
            patterns["moe_layer_freq"] = tuple(base[i % len(base)] for i in range(num_layers))
        if isinstance(self.window_attn_skip_freq, tuple):
            base = self.window_attn_skip_freq
            patterns["window_attn_skip_freq"] = tuple(base[i % len(base)] for i in range(num_layers))
        proxy = replace(self, name=f"{self.name}@{num_layers}L", num_layers=num_layers,
                        moe_first_k_dense=min(self.moe_first_k_dense, num_layers), **patterns)
        if self.num_moe_layers and not proxy.num_moe_layers:
            proxy = replace(proxy, moe_first_k_dense=min(self.moe_first_k_dense, num_layers - 1))
            if not proxy.num_moe_layers:
                forced = list(proxy.moe_layer_pattern())
                forced[-1] = 1
                proxy = replace(proxy, moe_layer_freq=tuple(forced))
        return proxy
