"""The training recipe: optimizer, schedule, evaluation and MoE loss settings of a full training run,
with the one set of defaults that ``foldtune train``, ``POST /v1/trainings`` and the executor's training
loop all read."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from spec.router_options import RouterOptions


@dataclass(frozen=True)
class Recipe:
    """How a layout is trained, beside the layout and the model. Learning rates are per optimizer step;
    ``warmup_steps`` of linear warm-up precede a cosine decay to ``min_lr``; ``max_grad_norm`` bounds the
    global gradient norm; ``eval_every`` 0 evaluates only before the first and after the last step, on
    ``eval_batches`` held-out global batches; ``data_seed`` fixes the data order; the MoE loss
    coefficients weight the load-balancing and router z-losses."""

    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    eval_every: int = 0
    eval_batches: int = 4
    data_seed: int = 0
    moe_aux_loss_coeff: float = 1e-2
    moe_z_loss_coeff: float = 1e-3

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def router_defaults(self) -> RouterOptions:
        """The router options a training starts from: RouterOptions' defaults with this recipe's loss
        coefficients."""
        return RouterOptions(moe_aux_loss_coeff=self.moe_aux_loss_coeff, moe_z_loss_coeff=self.moe_z_loss_coeff)


DEFAULT_RECIPE = Recipe()
