"""RouterOptions: bounds, the model-dependent expert-bias default, and the stored (job) form."""

from __future__ import annotations

import pytest

from spec.catalog import get_model
from spec.errors import SpecError
from spec.router_options import ROUTER_KEY, RouterOptions, split_router, with_router


@pytest.mark.parametrize("field,value", [("moe_aux_loss_coeff", -1e-3), ("moe_z_loss_coeff", 101.0),
                                         ("moe_router_bias_update_rate", 1.5),
                                         ("moe_router_load_balancing_type", "sinkhorn"),
                                         ("moe_token_drop_policy", "random")])
def test_out_of_bounds_values_are_rejected_by_name(field, value):
    with pytest.raises(SpecError, match=field):
        RouterOptions(**{field: value})


def test_expert_bias_follows_the_models_score_function_unless_set():
    assert RouterOptions().resolve(get_model("deepseek-v3")).moe_router_enable_expert_bias is True
    assert RouterOptions().resolve(get_model("tiny-moe")).moe_router_enable_expert_bias is False
    off = RouterOptions(moe_router_enable_expert_bias=False).resolve(get_model("deepseek-v3"))
    assert off.moe_router_enable_expert_bias is False
    with pytest.raises(SpecError, match="sigmoid"):  # Megatron rejects the bias on softmax scores
        RouterOptions(moe_router_enable_expert_bias=True).resolve(get_model("tiny-moe"))


def test_a_job_stores_only_non_default_router_options():
    training = {"seq_length": 64, "global_batch_size": 8}
    assert with_router(training, RouterOptions()) == training  # old jobs' signatures stay
    stored = with_router(training, RouterOptions(moe_router_enable_expert_bias=True, moe_aux_loss_coeff=1e-4))
    assert stored[ROUTER_KEY] == {"moe_router_enable_expert_bias": True, "moe_aux_loss_coeff": 1e-4}
    spec, router = split_router(stored)
    assert spec == training and router.moe_router_enable_expert_bias is True and router.moe_aux_loss_coeff == 1e-4
