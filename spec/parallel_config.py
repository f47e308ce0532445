"""ParallelConfig: one folded layout (attention TP·CP·DP·PP, MoE ETP·EP·EDP·PP) plus the knobs beside it."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from spec._validate import positive_ints, raise_if, require
from spec.dispatchers import DEFAULT_DISPATCHER, DISPATCHERS
from spec.errors import InvalidConfigError, SpecError
from spec.pipeline_layout import DEFAULT_SPLIT, PipelineSplit, canonical_layout
from spec.suggest import unknown_fields

RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
DEFAULT_SELECTIVE_MODULES = ("core_attn",)
#: Modules whose saved activations can go to pinned CPU memory in forward (executor/offload.py): the recompute
#: vocabulary's modules the executor runs as one call (core_attn: the attention kernel; layernorm: the RMSNorms;
#: mlp: a dense layer's MLP; moe: the whole MoE block).
ACTIVATION_OFFLOAD_MODULES = ("core_attn", "layernorm", "mlp", "moe")
OPTUNA_PARAMS = ("tp", "cp", "pp", "vpp", "ep", "etp", "mbs", "recompute", "dispatcher", "distopt", "ep_overlap",
                 "opt_offload", "act_offload")
ON_WORDS = ("on", "1", "true", "yes")

_TOKEN_SEPARATOR = re.compile(r"[\s,]+")
_SIZE_TOKEN = re.compile(r"(tp|cp|pp|vpp|ep|etp|dp|edp|mbs)=?(\d+)")
# a Megatron layout string may carry cosmetic commas, which elsewhere separate tokens: read it first
_LAYOUT_TOKEN = re.compile(r"(?i)(?:^|(?<=[\s,]))layout=([^\s]+)")
SIZE_KEYS = ("tp", "cp", "pp", "vpp", "ep", "etp", "dp", "edp", "mbs")
_ON_OFF = {"on": True, "1": True, "true": True, "yes": True, "off": False, "0": False, "false": False, "no": False}
# What a bad token's error lists: every form a label token takes.
LABEL_KEYS = tuple(f"{k}N" for k in SIZE_KEYS) + (
    f"recompute={{none|selective[:MODULE+...]|full[:LAYERS]}} (modules: {'+'.join(RECOMPUTE_MODULES)})",
    f"dispatcher={{{'|'.join(DISPATCHERS)}}}", "distopt={on|off}", "ep_overlap={on|off}",
    "layout=MEGATRON_PIPELINE_LAYOUT", "pp_first=N", "pp_last=N", "pp_account={embedding|loss|embedding+loss}")


def _bad_token(token: str, text: str, why: str = "") -> InvalidConfigError:
    return InvalidConfigError(f"cannot parse layout token {token!r} in {text!r}{why}; valid tokens: "
                              + ", ".join(LABEL_KEYS))


def _recompute_fields(text: str) -> dict[str, Any]:
    """The recompute fields of :meth:`ParallelConfig.recompute_text` output ('full:0' reads as 'full')."""
    granularity, _, rest = text.partition(":")
    fields_: dict[str, Any] = {"recompute_granularity": granularity}
    if granularity == "selective" and rest:
        fields_["recompute_modules"] = tuple(rest.split("+"))
    elif granularity == "full" and rest:
        fields_["recompute_num_layers"] = int(rest)
    return fields_


@dataclass(frozen=True)
class ParallelConfig:
    """A complete folded layout for ``world_size`` GPUs.

    ``world_size = tp·cp·dp·pp = etp·ep·edp·pp``; ``dp`` and ``edp`` are derived. Names follow
    Megatron-LM: ``vpp`` is the number of virtual stages per pipeline rank (1 = no interleaving),
    ``sequence_parallel`` defaults to on whenever ``tp > 1`` (Megatron requires it for MoE),
    ``recompute_num_layers`` is how many layers per stage a 'full' recompute covers (0 = all).
    ``overlap_moe_expert_parallel_comm`` hides the EP all-to-all of one micro-batch behind another's compute.
    ``optimizer_cpu_offload_fraction`` (Megatron's ``--optimizer-cpu-offload --optimizer-offload-fraction``): the
    share of each rank's optimizer state (fp32 master weights + Adam moments) kept in CPU memory and stepped
    there; it needs the distributed optimizer, as Megatron's does. ``activation_offload_modules``: modules of
    :data:`ACTIVATION_OFFLOAD_MODULES` whose saved activations go to pinned CPU memory in forward and come back
    in backward (not with full recompute, nor for a module that is also recomputed).
    The pipeline placement options are Megatron's (``spec.pipeline_layout``): ``pipeline_layout``
    (``--pipeline-model-parallel-layout``, stored without its cosmetic commas; it fixes pp·vpp),
    ``decoder_first/last_pipeline_num_layers`` and ``account_for_embedding/loss_in_pipeline_split``; none
    given, the layers split into pp·vpp chunks that differ by at most one.
    """

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    micro_batch_size: int = 1
    sequence_parallel: bool | None = None
    recompute_granularity: str = "none"
    recompute_modules: tuple[str, ...] = ()
    recompute_num_layers: int = 0
    moe_token_dispatcher_type: str = DEFAULT_DISPATCHER
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    optimizer_cpu_offload_fraction: float = 0.0
    activation_offload_modules: tuple[str, ...] = ()
    pipeline_layout: str | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    def __post_init__(self) -> None:
        if self.pipeline_layout is not None:
            object.__setattr__(self, "pipeline_layout", canonical_layout(str(self.pipeline_layout)))
        if isinstance(self.recompute_modules, (list, set)):
            object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        if not isinstance(self.activation_offload_modules, str):
            object.__setattr__(self, "activation_offload_modules", _module_order(self.activation_offload_modules))
        if self.sequence_parallel is None:
            object.__setattr__(self, "sequence_parallel", self.tp > 1)
        if self.recompute_granularity == "selective" and not self.recompute_modules:
            object.__setattr__(self, "recompute_modules", DEFAULT_SELECTIVE_MODULES)
        # types and ranges only: how the sizes fold the world and which knobs go together are rules of the
        # rule book (spec.layout_rules, spec.validity.check), which names the rule a layout breaks
        p: list[str] = []
        positive_ints(p, self, ("world_size", "tp", "cp", "pp", "vpp", "ep", "etp", "micro_batch_size"))
        raise_if(p, "parallel config")
        require(p, self.recompute_granularity in RECOMPUTE_GRANULARITIES,
                f"recompute_granularity must be one of {RECOMPUTE_GRANULARITIES}, got {self.recompute_granularity!r}")
        bad = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        require(p, not bad, f"unknown recompute_modules {bad}; known: {RECOMPUTE_MODULES}")
        require(p, self.recompute_num_layers >= 0, f"recompute_num_layers must be >= 0, got {self.recompute_num_layers}")
        p += _offload_problems(self)
        require(p, self.moe_token_dispatcher_type in DISPATCHERS,
                f"moe_token_dispatcher_type must be one of {DISPATCHERS}, got {self.moe_token_dispatcher_type!r}")
        p += self.pipeline_split.problems()
        if p:
            raise InvalidConfigError("invalid parallel config: " + "; ".join(p))

    @property
    def dp(self) -> int:
        """Data-parallel size of the attention/dense layout (rounded down where tp·cp·pp does not divide the
        world: the rule book's world_dense rule, which a layout must pass before it is used)."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size of the MoE layout (rounded down where etp·ep·pp does not divide the world:
        the rule book's world_expert rule)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def pipeline_split(self) -> PipelineSplit:
        """Megatron's pipeline placement options of this layout (``spec.pipeline_layout``)."""
        if (self.pipeline_layout is None and self.decoder_first_pipeline_num_layers is None
                and self.decoder_last_pipeline_num_layers is None and not self.account_for_embedding_in_pipeline_split
                and not self.account_for_loss_in_pipeline_split):
            return DEFAULT_SPLIT
        return PipelineSplit(self.pipeline_layout, self.decoder_first_pipeline_num_layers,
                             self.decoder_last_pipeline_num_layers, self.account_for_embedding_in_pipeline_split,
                             self.account_for_loss_in_pipeline_split)

    def num_micro_batches(self, global_batch_size: int) -> int:
        """Micro-batches per pipeline per step (gradient-accumulation steps)."""
        return global_batch_size // (self.micro_batch_size * self.dp)

    # ---- text form: "tp2 cp1 pp4 vpp2 ep8 etp1 mbs1 recompute=selective:core_attn+moe_act dispatcher=alltoall"
    def recompute_text(self) -> str:
        """The recomputation as one word: 'none', 'selective:core_attn+moe_act', 'full' or 'full:<layers>'."""
        if self.recompute_granularity == "selective":
            return "selective:" + "+".join(self.recompute_modules)
        if self.recompute_granularity == "full":
            return "full" + (f":{self.recompute_num_layers}" if self.recompute_num_layers else "")
        return "none"

    def label(self) -> str:
        """A compact, parseable one-line description of the layout and its knobs."""
        parts = [f"tp{self.tp}", f"cp{self.cp}", f"pp{self.pp}", f"vpp{self.vpp}", f"ep{self.ep}", f"etp{self.etp}",
                 f"dp{self.dp}", f"edp{self.edp}", f"mbs{self.micro_batch_size}"]
        if self.recompute_granularity != "none":
            parts.append("recompute=" + self.recompute_text())
        if self.moe_token_dispatcher_type != DEFAULT_DISPATCHER:
            parts.append(f"dispatcher={self.moe_token_dispatcher_type}")
        if not self.use_distributed_optimizer:
            parts.append("distopt=off")
        if self.overlap_moe_expert_parallel_comm:
            parts.append("ep_overlap=on")
        if self.optimizer_cpu_offload_fraction:
            parts.append(f"opt_offload={self.optimizer_cpu_offload_fraction:g}")
        if self.activation_offload_modules:
            parts.append("act_offload=" + "+".join(self.activation_offload_modules))
        if self.pipeline_layout is not None:
            parts.append(f"layout={self.pipeline_layout}")
        if self.decoder_first_pipeline_num_layers is not None:
            parts.append(f"pp_first={self.decoder_first_pipeline_num_layers}")
        if self.decoder_last_pipeline_num_layers is not None:
            parts.append(f"pp_last={self.decoder_last_pipeline_num_layers}")
        accounted = [name for name, on in (("embedding", self.account_for_embedding_in_pipeline_split),
                                           ("loss", self.account_for_loss_in_pipeline_split)) if on]
        if accounted:
            parts.append("pp_account=" + "+".join(accounted))
        return " ".join(parts)

    @staticmethod
    def read_label(text: str) -> tuple[dict[str, int], dict[str, Any]]:
        """The tokens of a :meth:`label` (or any subset, separated by spaces or commas), unchecked.

        Returns (sizes by token name: tp, cp, pp, vpp, ep, etp, dp, edp, mbs; the other fields by field
        name). ``layout=`` takes a Megatron layout string, commas included. Raises InvalidConfigError "cannot
        parse ..." for a token that is neither.
        """
        sizes: dict[str, int] = {}
        kwargs: dict[str, Any] = {}
        layout = _LAYOUT_TOKEN.search(text)
        if layout is not None:
            kwargs["pipeline_layout"] = canonical_layout(layout.group(1))
            text = text[:layout.start()] + " " + text[layout.end():]
        for token in _TOKEN_SEPARATOR.split(text.strip()):
            if not token:
                continue
            m = _SIZE_TOKEN.fullmatch(token.lower())
            if m:
                sizes[m.group(1)] = int(m.group(2))
                continue
            key, _, value = token.partition("=")
            key = key.lower()
            if key == "recompute":
                try:
                    kwargs.update(_recompute_fields(value))
                except ValueError:  # 'full:x'
                    raise _bad_token(token, text) from None
            elif key == "dispatcher":
                kwargs["moe_token_dispatcher_type"] = value
            elif key == "distopt":
                if value.lower() not in _ON_OFF:
                    raise _bad_token(token, text, " (distopt is on or off)")
                # parameter-gather overlap follows the distributed optimizer, as in every layout the planner
                # enumerates and in from_optuna_params: without it 'distopt=off' would be an invalid layout
                kwargs["use_distributed_optimizer"] = kwargs["overlap_param_gather"] = _ON_OFF[value.lower()]
            elif key == "ep_overlap":
                kwargs["overlap_moe_expert_parallel_comm"] = value.lower() in ON_WORDS
            elif key == "opt_offload":
                try:
                    kwargs["optimizer_cpu_offload_fraction"] = float(value)
                except ValueError:
                    raise _bad_token(token, text, " (opt_offload is a fraction in [0, 1])") from None
            elif key == "act_offload" and value:
                kwargs["activation_offload_modules"] = tuple(value.split("+"))
            elif key in ("pp_first", "pp_last") and value.isdigit():
                kwargs[f"decoder_{key[3:]}_pipeline_num_layers"] = int(value)
            elif key == "pp_account" and value and set(value.lower().split("+")) <= {"embedding", "loss"}:
                parts = value.lower().split("+")
                kwargs["account_for_embedding_in_pipeline_split"] = "embedding" in parts
                kwargs["account_for_loss_in_pipeline_split"] = "loss" in parts
            else:
                raise _bad_token(token, text)
        return sizes, kwargs

    @classmethod
    def parse(cls, text: str, world_size: int | None = None) -> ParallelConfig:
        """Parse :meth:`label` output (or any subset of it, separated by spaces or commas).

        ``dp``/``edp`` tokens are checked against ``world_size`` when given; when ``world_size`` is None
        it is derived from ``dp``.
        """
        sizes, kwargs = cls.read_label(text)
        tp, cp, pp = sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("pp", 1)
        if world_size is None:
            if "dp" in sizes:
                world_size = tp * cp * pp * sizes["dp"]
            else:
                raise InvalidConfigError(f"layout {text!r} names no dp and no world size was given")
        vpp = sizes.get("vpp")
        if vpp is None:  # a layout string fixes pp·vpp
            vpp = 1
            if kwargs.get("pipeline_layout"):
                chunks = PipelineSplit(kwargs["pipeline_layout"]).num_chunks()
                vpp = max(1, chunks // pp) if chunks % pp == 0 else 1
        cfg = cls(world_size=world_size, tp=tp, cp=cp, pp=pp, vpp=vpp, ep=sizes.get("ep", 1),
                  etp=sizes.get("etp", 1), micro_batch_size=sizes.get("mbs", 1), **kwargs)
        for name in ("dp", "edp"):
            if name in sizes and sizes[name] != getattr(cfg, name):
                raise InvalidConfigError(f"layout {text!r}: {name}={sizes[name]} contradicts world size "
                                         f"{world_size} (derived {name}={getattr(cfg, name)})")
        return cfg

    # ---- Optuna form: one categorical parameter per dimension and knob ------------------------------
    def to_optuna_params(self) -> dict[str, Any]:
        """The Optuna parameters of this layout (names in :data:`OPTUNA_PARAMS`; recompute as :meth:`recompute_text`)."""
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "vpp": self.vpp, "ep": self.ep, "etp": self.etp,
                "mbs": self.micro_batch_size, "recompute": self.recompute_text(),
                "dispatcher": self.moe_token_dispatcher_type, "distopt": self.use_distributed_optimizer,
                "ep_overlap": self.overlap_moe_expert_parallel_comm,
                "opt_offload": self.optimizer_cpu_offload_fraction,
                "act_offload": "+".join(self.activation_offload_modules) or "none"}

    @classmethod
    def from_optuna_params(cls, params: dict[str, Any], world_size: int, **fixed: Any) -> ParallelConfig:
        """The layout of :meth:`to_optuna_params` output for ``world_size`` GPUs; parameter-gather overlap
        follows the distributed optimizer, as in every layout the planner proposes. ``fixed`` are fields the
        search does not vary (e.g. the pipeline placement fields, :data:`PIPELINE_FIELDS`); studies begun
        before 'ep_overlap' or the offload knobs were searched read as off."""
        act = str(params.get("act_offload", "none"))
        distopt = bool(params["distopt"])
        return cls(world_size=world_size, tp=params["tp"], cp=params["cp"], pp=params["pp"], vpp=params["vpp"],
                   ep=params["ep"], etp=params["etp"], micro_batch_size=params["mbs"],
                   moe_token_dispatcher_type=params["dispatcher"], use_distributed_optimizer=distopt,
                   overlap_param_gather=distopt,
                   overlap_moe_expert_parallel_comm=bool(params.get("ep_overlap", False)),
                   optimizer_cpu_offload_fraction=float(params.get("opt_offload", 0.0)),
                   activation_offload_modules=() if act == "none" else tuple(act.split("+")),
                   **_recompute_fields(str(params["recompute"])), **fixed)

    # ---- field form: the fast path for layouts a Validator has already accepted --------------------
    def field_values(self) -> dict[str, Any]:
        """Every field by name (a template for :meth:`trusted`)."""
        return dict(self.__dict__)

    @classmethod
    def trusted(cls, *parts: dict[str, Any]) -> ParallelConfig:
        """A config from field mappings merged left to right (the first one complete, e.g. from
        :meth:`field_values`), without the checks of the constructor.

        Only for layouts whose every field is already known to be valid: the planner builds hundreds of
        thousands of configs that its Validator has just accepted, and the constructor's checks cost a few
        microseconds each.
        """
        cfg = object.__new__(cls)
        d = cfg.__dict__
        for part in parts:
            d.update(part)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recompute_modules"] = list(self.recompute_modules)
        d["activation_offload_modules"] = list(self.activation_offload_modules)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelConfig:
        d = {k: v for k, v in data.items() if k not in ("dp", "edp")}
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise SpecError(unknown_fields("parallel config", unknown, [f.name for f in fields(cls)]))
        return cls(**d)

    def replace(self, **changes: Any) -> ParallelConfig:
        return replace(self, **changes)


def _module_order(modules) -> tuple[str, ...]:
    """Known offload modules in vocabulary order (one spelling per set), unknown ones after, as given."""
    known = [m for m in ACTIVATION_OFFLOAD_MODULES if m in modules]
    return tuple(known + [m for m in modules if m not in ACTIVATION_OFFLOAD_MODULES])


def _offload_problems(cfg: ParallelConfig) -> list[str]:
    """What is wrong with the offload knobs of ``cfg`` on their own (a fraction out of range, an unknown module)."""
    p: list[str] = []
    f = cfg.optimizer_cpu_offload_fraction
    if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0.0 <= f <= 1.0:
        p.append(f"optimizer_cpu_offload_fraction must be a fraction in [0, 1], got {f!r}")
    bad = [m for m in cfg.activation_offload_modules if m not in ACTIVATION_OFFLOAD_MODULES]
    if bad:
        p.append(f"unknown activation_offload_modules {bad}; known: {ACTIVATION_OFFLOAD_MODULES}")
    return p


PIPELINE_FIELDS = ("pipeline_layout", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                   "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
