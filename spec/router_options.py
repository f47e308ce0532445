"""RouterOptions: how the MoE router is trained (load-balancing loss, z-loss, expert bias, token dropping).

One definition, in Megatron-Core's argument names, with the defaults and bounds that every user path reads:
the CLI (``api/cli/_router_args.py``), the API bodies (``api/schemas/router.py``), the runner (trials and
trainings) and the executor (``ExecutorOptions.for_training(..., router=...)``). The capacity factor is not
here: it belongs to the TrainingSpec (``routing_mode``), which the cost model prices.

Defaults follow the model where Megatron's recipes do: ``moe_router_enable_expert_bias`` None turns the
aux-loss-free expert bias on for a model that scores with sigmoid (DeepSeek-V3; Megatron's DeepSeek-V3
recipe passes --moe-router-enable-expert-bias with --moe-router-score-function sigmoid, and Megatron
rejects the bias with softmax scores), off otherwise. Everything else defaults to Megatron's defaults.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from spec._validate import raise_if, require
from spec.errors import SpecError
from spec.model_spec import ModelSpec

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
DROP_POLICIES = ("probs", "position")
# inclusive bounds of the numeric options: what the CLI, the API schema and the dataclass all check
BOUNDS = {"moe_aux_loss_coeff": (0.0, 100.0), "moe_z_loss_coeff": (0.0, 100.0),
          "moe_router_bias_update_rate": (0.0, 1.0)}
ROUTER_KEY = "router"  # a stored training_spec's key for non-default router options (jobs)


@dataclass(frozen=True)
class RouterOptions:
    """Router training options (Megatron argument names).

    ``moe_router_load_balancing_type``: 'aux_loss' (the switch loss over each micro-batch), 'seq_aux_loss'
    (DeepSeek-V2/V3: the same loss per sequence, averaged), 'global_aux_loss' (Megatron's global-batch balance:
    the tokens per expert summed over DP·CP·TP, over every data-parallel replica's micro-batch of the moment, and
    averaged over the step's micro-batches so far) or 'none' (no load-balancing loss whatever the coefficient);
    ``moe_aux_loss_coeff`` weights it and ``moe_z_loss_coeff`` the router z-loss.
    ``moe_router_enable_expert_bias`` adds a per-expert bias to the sigmoid scores for top-k selection only,
    moved by ``moe_router_bias_update_rate`` · sign(mean load − load) once per optimizer step over the
    global batch; None: follow the model (on for sigmoid scoring). ``moe_token_drop_policy`` decides which
    tokens a full expert drops under ``routing_mode`` 'capacity' ('probs': lowest probability first,
    'position': latest first). ``moe_router_force_load_balancing`` (benchmarks only) routes round-robin.
    """

    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_router_enable_expert_bias: bool | None = None
    moe_router_bias_update_rate: float = 1e-3
    moe_token_drop_policy: str = "probs"
    moe_router_force_load_balancing: bool = False

    def __post_init__(self) -> None:
        p: list[str] = []
        require(p, self.moe_router_load_balancing_type in LOAD_BALANCING_TYPES,
                f"moe_router_load_balancing_type must be one of {LOAD_BALANCING_TYPES}, "
                f"got {self.moe_router_load_balancing_type!r}")
        require(p, self.moe_token_drop_policy in DROP_POLICIES,
                f"moe_token_drop_policy must be one of {DROP_POLICIES}, got {self.moe_token_drop_policy!r}")
        for name, (low, high) in BOUNDS.items():
            value = getattr(self, name)
            require(p, isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high,
                    f"{name} must lie in [{low:g}, {high:g}], got {value!r}")
        raise_if(p, "router options")

    def resolve_model_defaults(self, model: ModelSpec) -> RouterOptions:
        """These options with the model-dependent defaults decided (expert bias None: on for sigmoid scores)."""
        bias = self.moe_router_enable_expert_bias
        if bias is None:
            bias = model.is_moe and model.moe_router_score_function == "sigmoid"
        return replace(self, moe_router_enable_expert_bias=bool(bias))

    def resolve(self, model: ModelSpec) -> RouterOptions:
        """:meth:`resolve_model_defaults`, and SpecError when the options do not fit the model."""
        resolved = self.resolve_model_defaults(model)
        problem = resolved.model_problem(model)
        if problem:
            raise SpecError(problem)
        return resolved

    def model_problem(self, model: ModelSpec) -> str | None:
        """Why these options cannot train ``model`` (None when they can)."""
        if self.moe_router_enable_expert_bias and model.moe_router_score_function != "sigmoid":
            return (f"moe_router_enable_expert_bias needs moe_router_score_function 'sigmoid' (model {model.name!r} "
                    f"scores with {model.moe_router_score_function!r})")
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def non_default(self) -> dict[str, Any]:
        """The fields that differ from the defaults (what a stored job keeps)."""
        default = RouterOptions()
        return {k: v for k, v in asdict(self).items() if v != getattr(default, k)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RouterOptions:
        unknown = sorted(set(data) - set(FIELDS))
        if unknown:
            raise SpecError(f"unknown router option(s): {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def pick(cls, data: dict[str, Any], base: RouterOptions | None = None) -> RouterOptions:
        """The router options among ``data``'s keys (others ignored), over ``base`` (default: the defaults)."""
        return replace(base or cls(), **{k: v for k, v in data.items() if k in FIELDS})


FIELDS = tuple(f.name for f in fields(RouterOptions))


def split_router(stored: dict[str, Any]) -> tuple[dict[str, Any], RouterOptions]:
    """A stored job ``training_spec`` as (the TrainingSpec fields, its router options)."""
    spec = {k: v for k, v in stored.items() if k != ROUTER_KEY}
    return spec, RouterOptions.from_dict(dict(stored.get(ROUTER_KEY) or {}))


def with_router(training_spec: dict[str, Any], router: RouterOptions) -> dict[str, Any]:
    """A job's stored ``training_spec``: the TrainingSpec fields, plus the router options that differ from
    the defaults (none: the dict is the TrainingSpec's alone, so jobs without router options keep their
    signature)."""
    changed = router.non_default()
    return {**training_spec, ROUTER_KEY: changed} if changed else dict(training_spec)
