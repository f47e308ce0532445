"""The gated activation's extra tensors and traffic: hand counts per GLU variant."""

from dataclasses import replace

import pytest

from spec import ClusterSpec, ParallelConfig, TrainingSpec, get_hardware, get_model
from costmodel.activation import glu_saved_intermediates, glu_traffic
from costmodel.compute import compute_rates, memory_time
from costmodel.step_time import ELEMENTWISE_BWD_RATIO, layer_times

GPTOSS = get_model("gpt-oss-120b")
PLAIN = get_model("qwen3-30b-a3b")


@pytest.mark.parametrize("changes,saved,traffic", [
    ({}, 4, (16.0, 7)),  # clamped gate, sigmoid, activated gate, shifted up; clamps 4, quick-GELU 7, offset 2, product 3
    ({"activation_func_clamp_value": None}, 3, (12.0, 5)),  # no clamp: sigmoid, activated gate, shifted up
    ({"activation_func_clamp_value": None, "glu_linear_offset": 0.0}, 2, (10.0, 4)),
    ({"quick_geglu": False, "swiglu": True}, 3, (11.0, 5)),  # SwiGLU with clamp and offset: not the fused kernel
])
def test_unfused_glu_variants_hand_count(changes, saved, traffic):
    model = replace(GPTOSS, **changes)
    assert glu_saved_intermediates(model) == saved
    assert glu_traffic(model) == traffic


def test_plain_swiglu_is_the_fused_kernel():
    assert glu_saved_intermediates(PLAIN) == 0 and glu_traffic(PLAIN) == (3.0, 1)


def test_gpt_oss_expert_activation_time_is_its_unfused_traffic():
    # ep16 etp1 on 16 H100: 4096 tokens, top-4, ffn 2880 -> 4096·4 rows x 2880 activation outputs, bf16
    cluster, config = ClusterSpec(get_hardware("h100-sxm"), 16), ParallelConfig(world_size=16, ep=16)
    training = TrainingSpec(seq_length=4096, global_batch_size=16)
    rates = compute_rates(get_hardware("h100-sxm"), "bf16")
    elements = 4096 * 4 * 2880
    plain = replace(GPTOSS, name="plain-glu", quick_geglu=False, swiglu=True, activation_func_clamp_value=None,
                    glu_linear_offset=0.0)
    ours, fused = (layer_times(m, training, cluster, config)["moe"] for m in (GPTOSS, plain))
    gap_fwd = dict(ours.fwd)["memory_bound"] - dict(fused.fwd)["memory_bound"]
    gap_bwd = dict(ours.bwd)["memory_bound"] - dict(fused.bwd)["memory_bound"]
    assert gap_fwd == pytest.approx(memory_time(rates, 16 * elements * 2, 7) - memory_time(rates, 3 * elements * 2),
                                    rel=1e-9)
    r = ELEMENTWISE_BWD_RATIO
    assert gap_bwd == pytest.approx(memory_time(rates, r * 16 * elements * 2, 7)
                                    - memory_time(rates, r * 3 * elements * 2), rel=1e-9)
