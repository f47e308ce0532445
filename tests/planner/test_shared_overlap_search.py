"""The planner searches shared-expert overlap (``moe_shared_expert_overlap``): tried beside the plain alltoall
dispatcher for a model with shared experts and ep > 1, never elsewhere, and chosen where it prices faster."""

from __future__ import annotations

from planner.enumerate import SearchSpace, enumerate_layouts
from planner.rank import plan
from spec import ClusterSpec, TrainingSpec, get_hardware, get_model

H100 = get_hardware("h100-sxm")
TRAINING = TrainingSpec(seq_length=4096, global_batch_size=64)


def test_tried_only_with_shared_experts_ep_and_alltoall():
    cluster = ClusterSpec(H100, 16)
    shared = enumerate_layouts(get_model("deepseek-v2-lite"), TRAINING, cluster)
    configs = [c for c in shared.configs() if c.moe_shared_expert_overlap]
    assert configs and all(c.ep > 1 and c.moe_token_dispatcher_type == "alltoall"
                           and not c.overlap_moe_expert_parallel_comm for c in configs)
    # beside every plain alltoall option with ep > 1, once
    plain = {c.replace(moe_shared_expert_overlap=True) for c in shared.configs()
             if c.ep > 1 and c.moe_token_dispatcher_type == "alltoall" and not c.overlap_moe_expert_parallel_comm
             and not c.moe_shared_expert_overlap}
    assert set(configs) == plain
    # none for a model without shared experts, none when the space leaves it out
    assert not any(c.moe_shared_expert_overlap for c in enumerate_layouts(get_model("mixtral-8x7b"), TRAINING,
                                                                          cluster).configs())
    off = enumerate_layouts(get_model("deepseek-v2-lite"), TRAINING, cluster, SearchSpace(shared_overlap=False))
    assert off.valid == shared.valid - len(configs)


def test_chosen_where_it_prices_faster():
    """DeepSeek-V2-Lite on 16 H100s, alltoall without EP overlap: the fastest layout hides its shared experts
    under the dispatch, and is the fastest layout of the search without the knob, with it on."""
    model, cluster = get_model("deepseek-v2-lite"), ClusterSpec(H100, 16)
    space = SearchSpace(ep_overlap=False, dispatchers=("alltoall",))
    on = plan(model, TRAINING, cluster, top=3, rank_by="point", space=space).ranked[0]
    off = plan(model, TRAINING, cluster, top=3, rank_by="point",
               space=SearchSpace(ep_overlap=False, dispatchers=("alltoall",), shared_overlap=False)).ranked[0]
    assert on.config.moe_shared_expert_overlap and not off.config.moe_shared_expert_overlap
    assert on.config == off.config.replace(moe_shared_expert_overlap=True)
    assert on.time.step_time < off.time.step_time
    assert on.executable
