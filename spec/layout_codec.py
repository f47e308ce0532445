"""The one codec of a layout: every text form a :class:`~spec.parallel_config.ParallelConfig` takes, and the
words they are spelled with.

- **label** (:meth:`LayoutCodec.label` / :meth:`LayoutCodec.parse` / :func:`read_label`):
  ``tp2 cp1 pp4 vpp2 ep8 etp1 dp4 edp2 mbs1 recompute=selective:core_attn dispatcher=alltoall ep_overlap=on``
  (``tp_overlap=on``: Megatron's TP communication overlap, ``--tp-comm-overlap``; ``shared_overlap=on``: the
  shared experts under the dispatch all-to-all, ``--moe-shared-expert-overlap``; ``cuda_graphs=on``: each
  layer's static part replayed from CUDA graphs);
  (``cp_comm=p2p``, ``cp_comm=a2a+p2p:2x4``: the CP communication type, with the hierarchical sizes);
  sizes are ``<name><n>`` tokens, knobs ``<name>=<value>`` tokens, each written only when it is not the
  default; any subset parses, separated by spaces or commas (``layout=`` takes a Megatron layout string,
  commas included).
- **knob suffixes**: a label may end with knobs that are not the layout's but the trial's (a tuning job
  that searches precision labels its trials ``... precision=fp8``). :class:`Labelled` is that pair;
  :meth:`LayoutCodec.parse_labelled` reads it back. :meth:`LayoutCodec.parse` reads a layout alone and
  refuses a suffix rather than drop it.
- **Optuna parameters** (:data:`OPTUNA_PARAMS`, :meth:`LayoutCodec.to_optuna_params`,
  :meth:`LayoutCodec.from_optuna_params`, :func:`optuna_key`): one categorical parameter per searched
  dimension and knob. Parameters added after studies had begun are listed in :data:`OPTUNA_ADDED` with the
  value those studies ran, and earlier spellings in :data:`OPTUNA_RESPELLED`, so a stored study of any age
  reads as the current version.
- **JSON** (:meth:`LayoutCodec.to_dict` / :meth:`LayoutCodec.from_dict`): every field by name, what the
  database stores with a trial or a training.

``ParallelConfig`` inherits these methods from :class:`LayoutCodec`; nothing else reads or builds a label.
This module imports no ParallelConfig (that module imports this one), so it works on ``cls`` and ``self``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, fields
from typing import Any, NamedTuple

from spec.cp_comm_types import CP_COMM_TYPES, DEFAULT_CP_COMM, HIERARCHICAL
from spec.dispatchers import DEFAULT_DISPATCHER, DISPATCHERS
from spec.errors import InvalidConfigError, SpecError
from spec.optimizer_dtypes import (FIELDS as OPTIMIZER_DTYPE_FIELDS, FP32_STATES, OPTIMIZER_STATE_DTYPES, dtypes_text,
                                   read_dtypes)
from spec.pipeline_layout import PipelineSplit, canonical_layout
from spec.suggest import unknown_fields
from spec.training_spec import PRECISIONS

# ---- the vocabulary of a layout's knobs ---------------------------------------------------------
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
DEFAULT_SELECTIVE_MODULES = ("core_attn",)
#: Modules whose saved activations can go to pinned CPU memory in forward (executor/offload.py): the recompute
#: vocabulary's modules the executor runs as one call (core_attn: the attention kernel; layernorm: the RMSNorms;
#: mlp: a dense layer's MLP; moe: the whole MoE block).
ACTIVATION_OFFLOAD_MODULES = ("core_attn", "layernorm", "mlp", "moe")
PIPELINE_FIELDS = ("pipeline_layout", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                   "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")

# ---- the label grammar --------------------------------------------------------------------------
SIZE_KEYS = ("tp", "cp", "pp", "vpp", "ep", "etp", "dp", "edp", "mbs")
PRECISION_PARAM = "precision"  # the knob suffix of a trial that searched its precision (label and Optuna)
KNOB_SUFFIXES = (PRECISION_PARAM,)  # tokens of a trial label that are not the layout's
ON_WORDS = ("on", "1", "true", "yes")
_ON_OFF = {"on": True, "1": True, "true": True, "yes": True, "off": False, "0": False, "false": False, "no": False}
_TOKEN_SEPARATOR = re.compile(r"[\s,]+")
_SIZE_TOKEN = re.compile(r"(tp|cp|pp|vpp|ep|etp|dp|edp|mbs)=?(\d+)")
# a Megatron layout string may carry cosmetic commas, which elsewhere separate tokens: read it first
_LAYOUT_TOKEN = re.compile(r"(?i)(?:^|(?<=[\s,]))layout=([^\s]+)")
# What a bad token's error lists: every form a label token takes.
LABEL_KEYS = tuple(f"{k}N" for k in SIZE_KEYS) + (
    f"recompute={{none|selective[:MODULE+...]|full[:LAYERS]}} (modules: {'+'.join(RECOMPUTE_MODULES)})",
    f"dispatcher={{{'|'.join(DISPATCHERS)}}}", "distopt={on|off}", "ep_overlap={on|off}", "tp_overlap={on|off}",
    "shared_overlap={on|off}", "cuda_graphs={on|off}",
    "opt_offload=FRACTION",
    f"act_offload=MODULE+... (modules: {'+'.join(ACTIVATION_OFFLOAD_MODULES)})",
    f"exp_avg={{{'|'.join(OPTIMIZER_STATE_DTYPES)}}}", f"exp_avg_sq={{{'|'.join(OPTIMIZER_STATE_DTYPES)}}}",
    f"main_params={{{'|'.join(OPTIMIZER_STATE_DTYPES)}}}",
    "layout=MEGATRON_PIPELINE_LAYOUT", "pp_first=N", "pp_last=N", "pp_account={embedding|loss|embedding+loss}",
    f"cp_comm={{{'|'.join(c for c in CP_COMM_TYPES if c != HIERARCHICAL)}|{HIERARCHICAL}:AxP}}",
    f"precision={{{'|'.join(PRECISIONS)}}} (a trial's knob, last)")

# ---- the Optuna form ----------------------------------------------------------------------------
OPTUNA_PARAMS = ("tp", "cp", "pp", "vpp", "ep", "etp", "mbs", "recompute", "dispatcher", "distopt", "ep_overlap",
                 "opt_offload", "act_offload", "opt_dtypes", "cp_comm", "shared_overlap", "cuda_graphs")
#: A multimodal layout's Optuna parameters beyond its LLM's (:meth:`MultimodalCodec.to_optuna_params`); a text-only
#: trial has none of them.
MULTIMODAL_OPTUNA_PARAMS = ("placement", "enc_tp", "enc_cp", "enc_pp", "enc_dp")
#: Parameters added to the search after studies had begun, with the value a trial of an older study ran.
OPTUNA_ADDED = {"ep_overlap": False, "opt_offload": 0.0, "act_offload": "none", "opt_dtypes": dtypes_text(FP32_STATES),
                "cp_comm": DEFAULT_CP_COMM, "shared_overlap": False, "cuda_graphs": False}
#: Label token -> ParallelConfig field of the precision-aware optimizer's dtypes (Megatron's words).
OPTIMIZER_DTYPE_TOKENS = dict(zip(("exp_avg", "exp_avg_sq", "main_params"), OPTIMIZER_DTYPE_FIELDS))
#: (parameter, earlier spelling) -> the current one: the codec once wrote a whole-stage full recompute 'full:0'.
OPTUNA_RESPELLED = {("recompute", "full:0"): "full"}


class LabelTokens(NamedTuple):
    """The tokens of a label, read but not checked: ``sizes`` by token name (tp, cp, pp, vpp, ep, etp, dp,
    edp, mbs), ``fields`` the other ParallelConfig fields by field name, ``knobs`` the trial's knob suffixes
    (:data:`KNOB_SUFFIXES`) by name."""

    sizes: dict[str, int]
    fields: dict[str, Any]
    knobs: dict[str, str]


def _bad_token(token: str, text: str, why: str = "") -> InvalidConfigError:
    return InvalidConfigError(f"cannot parse layout token {token!r} in {text!r}{why}; valid tokens: "
                              + ", ".join(LABEL_KEYS))


def recompute_fields(text: str) -> dict[str, Any]:
    """The recompute fields of :meth:`LayoutCodec.recompute_text` output ('full:0' reads as 'full')."""
    granularity, _, rest = text.partition(":")
    out: dict[str, Any] = {"recompute_granularity": granularity}
    if granularity == "selective" and rest:
        out["recompute_modules"] = tuple(rest.split("+"))
    elif granularity == "full" and rest:
        out["recompute_num_layers"] = int(rest)
    return out


def cp_comm_fields(text: str) -> dict[str, Any]:
    """The CP communication fields of :meth:`LayoutCodec.cp_comm_text` output: 'p2p', or 'a2a+p2p:2x4' (the
    hierarchical sizes, a2a then p2p). ValueError for sizes that are not 'AxP' integers."""
    name, _, sizes = text.partition(":")
    out: dict[str, Any] = {"cp_comm_type": name}
    if sizes:
        out["hierarchical_context_parallel_sizes"] = tuple(int(n) for n in sizes.lower().split("x"))
    return out


def read_label(text: str) -> LabelTokens:
    """The tokens of a label (or any subset, separated by spaces or commas), unchecked.

    Raises InvalidConfigError "cannot parse ..." for a token the grammar does not have (the message lists
    every form a token takes).
    """
    sizes: dict[str, int] = {}
    out: dict[str, Any] = {}
    knobs: dict[str, str] = {}
    layout = _LAYOUT_TOKEN.search(text)
    if layout is not None:
        out["pipeline_layout"] = canonical_layout(layout.group(1))
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
                out.update(recompute_fields(value))
            except ValueError:  # 'full:x'
                raise _bad_token(token, text) from None
        elif key == "dispatcher":
            out["moe_token_dispatcher_type"] = value
        elif key == "distopt":
            if value.lower() not in _ON_OFF:
                raise _bad_token(token, text, " (distopt is on or off)")
            # parameter-gather overlap follows the distributed optimizer, as in every layout the planner
            # enumerates and in from_optuna_params: without it 'distopt=off' would be an invalid layout
            out["use_distributed_optimizer"] = out["overlap_param_gather"] = _ON_OFF[value.lower()]
        elif key == "ep_overlap":
            out["overlap_moe_expert_parallel_comm"] = value.lower() in ON_WORDS
        elif key == "tp_overlap":
            out["tp_comm_overlap"] = value.lower() in ON_WORDS
        elif key == "shared_overlap":
            out["moe_shared_expert_overlap"] = value.lower() in ON_WORDS
        elif key == "cuda_graphs":
            if value.lower() not in _ON_OFF:
                raise _bad_token(token, text, " (cuda_graphs is on or off)")
            out["cuda_graphs"] = _ON_OFF[value.lower()]
        elif key == "opt_offload":
            try:
                out["optimizer_cpu_offload_fraction"] = float(value)
            except ValueError:
                raise _bad_token(token, text, " (opt_offload is a fraction in [0, 1])") from None
        elif key in OPTIMIZER_DTYPE_TOKENS:
            if value not in OPTIMIZER_STATE_DTYPES:
                raise _bad_token(token, text, f" ({key} is one of {', '.join(OPTIMIZER_STATE_DTYPES)})")
            out[OPTIMIZER_DTYPE_TOKENS[key]] = value
        elif key == "act_offload" and value:
            out["activation_offload_modules"] = tuple(value.split("+"))
        elif key == "cp_comm" and value:
            try:
                out.update(cp_comm_fields(value.lower()))
            except ValueError:  # 'a2a+p2p:two'
                raise _bad_token(token, text, " (cp_comm=a2a+p2p takes its sizes as AxP, e.g. a2a+p2p:2x4)") from None
        elif key in ("pp_first", "pp_last") and value.isdigit():
            out[f"decoder_{key[3:]}_pipeline_num_layers"] = int(value)
        elif key == "pp_account" and value and set(value.lower().split("+")) <= {"embedding", "loss"}:
            parts = value.lower().split("+")
            out["account_for_embedding_in_pipeline_split"] = "embedding" in parts
            out["account_for_loss_in_pipeline_split"] = "loss" in parts
        elif key == PRECISION_PARAM:
            if value not in PRECISIONS:
                raise _bad_token(token, text, f" (precision is one of {', '.join(PRECISIONS)})")
            knobs[PRECISION_PARAM] = value
        else:
            raise _bad_token(token, text)
    return LabelTokens(sizes, out, knobs)


def _fraction_text(x: float) -> str:
    """``x`` short ('0.5', '1') where that reads back as ``x``, else every digit it takes."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


def _placement_tokens(layout: str | None, first: int | None, last: int | None, embedding: bool,
                      loss: bool) -> list[str]:
    parts = []
    if layout is not None:
        parts.append(f"layout={layout}")
    if first is not None:
        parts.append(f"pp_first={first}")
    if last is not None:
        parts.append(f"pp_last={last}")
    accounted = [name for name, on in (("embedding", embedding), ("loss", loss)) if on]
    if accounted:
        parts.append("pp_account=" + "+".join(accounted))
    return parts


def placement_label(split: PipelineSplit) -> str:
    """The label tokens of Megatron's pipeline placement options ``split`` ('' for the default split)."""
    return " ".join(_placement_tokens(split.layout, split.first, split.last, split.embedding, split.loss))


def names_placement(text: str) -> bool:
    """Whether the label ``text`` names a pipeline placement option of its own."""
    return any(name in read_label(text).fields for name in PIPELINE_FIELDS)


def current_optuna_params(params: dict[str, Any]) -> dict[str, Any]:
    """A stored trial's Optuna parameters as the current version writes them (:data:`OPTUNA_ADDED`,
    :data:`OPTUNA_RESPELLED`); a searched precision is kept."""
    out = {**OPTUNA_ADDED, **params}
    for (name, old), new in OPTUNA_RESPELLED.items():
        if out.get(name) == old:
            out[name] = new
    return out


def optuna_key(params: dict[str, Any]) -> tuple:
    """A hashable key of a trial's Optuna parameters of any version: one value per name of
    :data:`OPTUNA_PARAMS`, then the searched precision (None for a study that does not search it). Two
    parameter sets name the same trial point exactly when their keys are equal."""
    params = current_optuna_params(params)
    return tuple(params.get(name) for name in OPTUNA_PARAMS + (PRECISION_PARAM,) + MULTIMODAL_OPTUNA_PARAMS)


class LayoutCodec:
    """The text, Optuna and JSON forms of ParallelConfig (its base class: see the module docstring)."""

    __slots__ = ()

    def recompute_text(self) -> str:
        """The recomputation as one word: 'none', 'selective:core_attn+moe_act', 'full' or 'full:<layers>'."""
        if self.recompute_granularity == "selective":
            return "selective:" + "+".join(self.recompute_modules)
        if self.recompute_granularity == "full":
            return "full" + (f":{self.recompute_num_layers}" if self.recompute_num_layers else "")
        return "none"

    def cp_comm_text(self) -> str:
        """The CP communication type as one word: 'allgather', 'p2p', 'a2a', or 'a2a+p2p:2x4' with the
        hierarchical sizes (a2a size x p2p size) when they are set."""
        sizes = self.hierarchical_context_parallel_sizes
        return self.cp_comm_type + (":" + "x".join(map(str, sizes)) if sizes else "")

    # ---- label ---------------------------------------------------------------------------------------
    def label(self) -> str:
        """A compact one-line description of the layout and its knobs, which :meth:`parse` reads back."""
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
        if self.tp_comm_overlap:
            parts.append("tp_overlap=on")
        if self.moe_shared_expert_overlap:
            parts.append("shared_overlap=on")
        if self.cuda_graphs:
            parts.append("cuda_graphs=on")
        if self.optimizer_cpu_offload_fraction:
            parts.append(f"opt_offload={_fraction_text(self.optimizer_cpu_offload_fraction)}")
        if self.activation_offload_modules:
            parts.append("act_offload=" + "+".join(self.activation_offload_modules))
        if self.cp_comm_type != DEFAULT_CP_COMM or self.hierarchical_context_parallel_sizes:
            parts.append("cp_comm=" + self.cp_comm_text())
        parts += [f"{token}={getattr(self, name)}" for token, name in OPTIMIZER_DTYPE_TOKENS.items()
                  if getattr(self, name) != "fp32"]
        parts += _placement_tokens(self.pipeline_layout, self.decoder_first_pipeline_num_layers,
                                   self.decoder_last_pipeline_num_layers,
                                   self.account_for_embedding_in_pipeline_split,
                                   self.account_for_loss_in_pipeline_split)
        return " ".join(parts)

    read_label = staticmethod(read_label)

    @classmethod
    def parse(cls, text: str, world_size: int | None = None):
        """The layout of :meth:`label` output (or any subset of it, separated by spaces or commas).

        ``dp``/``edp`` tokens are checked against ``world_size`` when given; when ``world_size`` is None it is
        derived from ``dp``. A trial's knob suffix (``precision=``) is refused: :meth:`parse_labelled` reads it.
        """
        tokens = read_label(text)
        if tokens.knobs:
            raise InvalidConfigError(f"layout {text!r} carries a trial's knob ("
                                     + ", ".join(f"{k}={v}" for k, v in tokens.knobs.items())
                                     + "); a layout alone has none (ParallelConfig.parse_labelled reads both)")
        return cls._from_tokens(text, tokens, world_size)

    @classmethod
    def parse_labelled(cls, text: str, world_size: int | None = None) -> Labelled:
        """A trial's label, the layout's with its knob suffixes (``... precision=fp8``), as a :class:`Labelled`."""
        tokens = read_label(text)
        return Labelled(cls._from_tokens(text, tokens, world_size), tokens.knobs.get(PRECISION_PARAM))

    @classmethod
    def from_sizes(cls, sizes: dict[str, int], world_size: int | None = None, **fields: Any):
        """The layout whose label tokens have these ``sizes`` (token names: tp, cp, pp, vpp, ep, etp, dp, edp,
        mbs) and these other fields, read exactly as :meth:`parse` reads the label they spell (dp and edp
        checked against the world size)."""
        text = " ".join(f"{name}={value}" for name, value in sizes.items())  # for error messages only
        return cls._from_tokens(text, LabelTokens(dict(sizes), dict(fields), {}), world_size)

    @classmethod
    def _from_tokens(cls, text: str, tokens: LabelTokens, world_size: int | None):
        sizes, kwargs = tokens.sizes, tokens.fields
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
        """The Optuna parameters of this layout (names in :data:`OPTUNA_PARAMS`; recompute as
        :meth:`recompute_text`)."""
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "vpp": self.vpp, "ep": self.ep, "etp": self.etp,
                "mbs": self.micro_batch_size, "recompute": self.recompute_text(),
                "dispatcher": self.moe_token_dispatcher_type, "distopt": self.use_distributed_optimizer,
                "ep_overlap": self.overlap_moe_expert_parallel_comm,
                "opt_offload": self.optimizer_cpu_offload_fraction,
                "act_offload": "+".join(self.activation_offload_modules) or "none",
                "opt_dtypes": dtypes_text(self.optimizer_dtypes),
                "cp_comm": self.cp_comm_text(), "shared_overlap": self.moe_shared_expert_overlap,
                "cuda_graphs": self.cuda_graphs}

    @classmethod
    def from_optuna_params(cls, params: dict[str, Any], world_size: int, **fixed: Any):
        """The layout of a trial's Optuna parameters (any version: :func:`current_optuna_params`; a searched
        precision is not the layout's and is left out) for ``world_size`` GPUs; parameter-gather overlap
        follows the distributed optimizer, as in every layout the planner proposes. ``fixed`` are fields the
        search does not vary (e.g. the pipeline placement fields, :data:`PIPELINE_FIELDS`)."""
        params = current_optuna_params(params)
        act = str(params["act_offload"])
        distopt = bool(params["distopt"])
        return cls(world_size=world_size, tp=params["tp"], cp=params["cp"], pp=params["pp"], vpp=params["vpp"],
                   ep=params["ep"], etp=params["etp"], micro_batch_size=params["mbs"],
                   moe_token_dispatcher_type=params["dispatcher"], use_distributed_optimizer=distopt,
                   overlap_param_gather=distopt,
                   overlap_moe_expert_parallel_comm=bool(params["ep_overlap"]),
                   moe_shared_expert_overlap=bool(params["shared_overlap"]),
                   cuda_graphs=bool(params["cuda_graphs"]),
                   optimizer_cpu_offload_fraction=float(params["opt_offload"]),
                   activation_offload_modules=() if act == "none" else tuple(act.split("+")),
                   **dict(zip(OPTIMIZER_DTYPE_FIELDS, read_dtypes(str(params["opt_dtypes"])))),
                   **recompute_fields(str(params["recompute"])), **cp_comm_fields(str(params["cp_comm"])), **fixed)

    # ---- JSON form ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field by name (tuples as lists): what the database stores."""
        d = asdict(self)
        d["recompute_modules"] = list(self.recompute_modules)
        d["activation_offload_modules"] = list(self.activation_offload_modules)
        sizes = self.hierarchical_context_parallel_sizes
        d["hierarchical_context_parallel_sizes"] = None if sizes is None else list(sizes)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """The layout of :meth:`to_dict` output (derived ``dp``/``edp`` ignored; a field added since it was
        stored takes its default)."""
        d = {k: v for k, v in data.items() if k not in ("dp", "edp")}
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise SpecError(unknown_fields("parallel config", unknown, names))
        return cls(**d)


class Labelled(NamedTuple):
    """A layout with a trial's knob suffixes: what a tuning trial that searched its precision ran
    (``precision`` None: the job's own, and the label is the layout's alone)."""

    config: Any  # a ParallelConfig
    precision: str | None = None

    def label(self) -> str:
        """The layout's label, then ``precision=<p>`` when the trial carries its precision."""
        return self.config.label() + ("" if self.precision is None else f" {PRECISION_PARAM}={self.precision}")

    def optuna_params(self) -> dict[str, Any]:
        """The layout's Optuna parameters, with :data:`PRECISION_PARAM` when the trial carries its precision."""
        params = self.config.to_optuna_params()
        return params if self.precision is None else {**params, PRECISION_PARAM: self.precision}


# ---- the multimodal layout: the LLM's folded layout + the vision encoder's own + a placement --------------
#: Where the vision encoder runs: ``homogeneous`` inherits the LLM's layout (its tp and cp, data
#: parallel over the LLM's dp, on the LLM's first pipeline stage: what Megatron does by default);
#: ``colocated`` gives it its own process groups over the LLM's GPUs (encoder tp·cp·pp·dp = the LLM's world,
#: time-shared); ``separate`` puts it on its own ranks (the non-colocated placement: encoder tp·cp·pp·dp more
#: GPUs, pipelined ahead of the LLM).
PLACEMENTS = ("homogeneous", "colocated", "separate")
ENCODER_SIZE_KEYS = ("enc_tp", "enc_cp", "enc_pp", "enc_dp")
_ENCODER_TOKEN = re.compile(r"(enc_tp|enc_cp|enc_pp|enc_dp)=?(\d+)")
MULTIMODAL_LABEL_KEYS = tuple(f"{k}N" for k in ENCODER_SIZE_KEYS) + (f"placement={{{'|'.join(PLACEMENTS)}}}",)


class MultimodalTokens(NamedTuple):
    """A multimodal label read but not checked: the LLM's part (a label of :func:`read_label`'s grammar), the
    encoder's sizes by token name (enc_tp, enc_cp, enc_pp, enc_dp) and the placement (None when absent)."""

    llm_text: str
    encoder_sizes: dict[str, int]
    placement: str | None


def read_multimodal_label(text: str) -> MultimodalTokens:
    """Split a multimodal label into its LLM part and its encoder tokens. InvalidConfigError for a malformed
    encoder token or placement (the message lists every form they take)."""
    rest: list[str] = []
    sizes: dict[str, int] = {}
    placement = None
    for token in _TOKEN_SEPARATOR.split(text.strip()):
        low = token.lower()
        if low.startswith("enc_"):
            m = _ENCODER_TOKEN.fullmatch(low)
            if m is None:
                raise InvalidConfigError(f"cannot parse encoder token {token!r} in {text!r}; encoder tokens: "
                                         + ", ".join(MULTIMODAL_LABEL_KEYS))
            sizes[m.group(1)] = int(m.group(2))
        elif low.startswith("placement="):
            placement = low.partition("=")[2]
            if placement not in PLACEMENTS:
                raise InvalidConfigError(f"placement {placement!r} in {text!r} is not one of {', '.join(PLACEMENTS)}")
        elif token:
            rest.append(token)
    return MultimodalTokens(" ".join(rest), sizes, placement)


class MultimodalCodec:
    """The text and JSON forms of :class:`spec.multimodal_layout.MultimodalLayout` (its base class): the LLM's
    label (:meth:`LayoutCodec.label`) followed by ``placement=...`` and, unless homogeneous, the encoder's
    ``enc_tpN enc_cpN enc_ppN enc_dpN``."""

    __slots__ = ()

    def encoder_label(self) -> str:
        """The encoder's sizes as label tokens (also for a homogeneous layout, whose label leaves them out)."""
        return (f"enc_tp{self.encoder_tp} enc_cp{self.encoder_cp} enc_pp{self.encoder_pp} "
                f"enc_dp{self.encoder_dp}")

    def label(self) -> str:
        parts = [self.llm.label(), f"placement={self.placement}"]
        if self.placement != "homogeneous":
            parts.append(self.encoder_label())
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str, world_size: int | None = None):
        """The layout of :meth:`label` output. ``world_size``: all GPUs (the LLM's plus, when separate, the
        encoder's); None derives it from the dp tokens. A label without encoder tokens or placement is the
        homogeneous layout of its LLM part."""
        tokens = read_multimodal_label(text)
        placement = tokens.placement or ("colocated" if tokens.encoder_sizes else "homogeneous")
        sizes = tokens.encoder_sizes
        if placement == "homogeneous":
            if sizes:
                raise InvalidConfigError(f"layout {text!r}: a homogeneous layout's encoder inherits the LLM's "
                                         f"layout; drop {', '.join(sorted(sizes))} or choose another placement")
            return cls.homogeneous(read_llm_layout(cls, tokens.llm_text, world_size))
        if "enc_dp" not in sizes and placement == "separate":
            raise InvalidConfigError(f"layout {text!r}: a separate encoder needs enc_dp (its ranks are its own)")
        enc = {k: sizes.get(k, 1) for k in ("enc_tp", "enc_cp", "enc_pp")}
        encoder_world = enc["enc_tp"] * enc["enc_cp"] * enc["enc_pp"] * sizes.get("enc_dp", 0)
        llm_world = world_size - encoder_world if (world_size is not None and placement == "separate") else world_size
        llm = read_llm_layout(cls, tokens.llm_text, llm_world)
        if "enc_dp" not in sizes:  # colocated: the encoder spans the LLM's world
            per = enc["enc_tp"] * enc["enc_cp"] * enc["enc_pp"]
            if llm.world_size % per:
                raise InvalidConfigError(f"layout {text!r}: enc_tp·enc_cp·enc_pp = {per} does not divide the "
                                         f"LLM's {llm.world_size} GPUs")
            sizes = {**sizes, "enc_dp": llm.world_size // per}
        return cls(llm=llm, placement=placement, encoder_tp=enc["enc_tp"], encoder_cp=enc["enc_cp"],
                   encoder_pp=enc["enc_pp"], encoder_dp=sizes["enc_dp"])

    def to_optuna_params(self) -> dict[str, Any]:
        """The LLM's Optuna parameters, then the placement and the encoder's sizes
        (:data:`MULTIMODAL_OPTUNA_PARAMS`)."""
        return {**self.llm.to_optuna_params(), "placement": self.placement, "enc_tp": self.encoder_tp,
                "enc_cp": self.encoder_cp, "enc_pp": self.encoder_pp, "enc_dp": self.encoder_dp}

    def to_dict(self) -> dict[str, Any]:
        return {"llm": self.llm.to_dict(), "placement": self.placement, "encoder_tp": self.encoder_tp,
                "encoder_cp": self.encoder_cp, "encoder_pp": self.encoder_pp, "encoder_dp": self.encoder_dp}


def read_llm_layout(cls, text: str, world_size: int | None):
    """The LLM part of a multimodal label, through the LLM layout class ``cls.LLM_LAYOUT``'s parse."""
    return cls.LLM_LAYOUT.parse(text, world_size)
