"""The router options of a job or training body: :class:`spec.router_options.RouterOptions` as body fields.

Mixed into ``JobCreate`` and ``TrainingCreate`` (flat fields, Megatron's names). Bounds come from
``spec.router_options.BOUNDS``; a value outside them is a 422 problem naming the rule (``greater_than_equal``,
``less_than_equal``, ``literal_error``) and the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from api.schemas.common import BodyIn

from spec.router_options import BOUNDS, FIELDS, RouterOptions

_DEFAULT = RouterOptions()


def _bounded(name: str, description: str) -> Any:
    low, high = BOUNDS[name]
    return Field(getattr(_DEFAULT, name), ge=low, le=high, description=description)


class RouterOptionsIn(BodyIn):
    """MoE router training options (see RouterOptions); every field optional."""

    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = Field(
        _DEFAULT.moe_router_load_balancing_type,
        description="aux_loss: switch loss per micro-batch; seq_aux_loss: per sequence, averaged (DeepSeek-V2/V3); "
                    "global_aux_loss: tokens per expert over the global batch (DP·CP·TP, averaged over the step's "
                    "micro-batches; Megatron's); none: no load-balancing loss")
    moe_aux_loss_coeff: float = _bounded("moe_aux_loss_coeff", "load-balancing loss coefficient")
    moe_z_loss_coeff: float = _bounded("moe_z_loss_coeff", "router z-loss coefficient")
    moe_router_enable_expert_bias: bool | None = Field(
        None, description="aux-loss-free balancing (DeepSeek-V3 expert bias); null: on for sigmoid-scored models")
    moe_router_bias_update_rate: float = _bounded("moe_router_bias_update_rate",
                                                  "expert bias step per optimizer step")
    moe_token_drop_policy: Literal["probs", "position"] = Field(
        _DEFAULT.moe_token_drop_policy, description="which tokens a full expert drops (routing_mode 'capacity')")
    moe_router_force_load_balancing: bool = Field(
        False, description="benchmarks only: round-robin routing instead of by score")

    def router_options(self) -> RouterOptions:
        """The body's router options (model defaults not yet decided: see RouterOptions.resolve)."""
        return RouterOptions.from_dict(self.model_dump(include=set(FIELDS)))

    def given_router_options(self) -> dict[str, Any]:
        """The router fields the client set explicitly."""
        return {name: getattr(self, name) for name in FIELDS if name in self.model_fields_set}
