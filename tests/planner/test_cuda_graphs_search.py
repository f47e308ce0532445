"""The planner searches CUDA graphs (``cuda_graphs``): on GPU clusters only (rule cuda_graphs_device), where the
executor captures them (tp = cp = pp = 1), beside every dispatcher option but the EP overlap (rule
cuda_graphs_ep_overlap), with the recompute options that leave the captured half alone (rule
cuda_graphs_recompute), and chosen where the host sets the step time."""

from __future__ import annotations

from planner.enumerate import SearchSpace, enumerate_layouts
from planner.rank import plan
from spec import ClusterSpec, TrainingSpec, get_hardware, get_model
from spec.validity import check_config

H100 = get_hardware("h100-sxm")
TRAINING = TrainingSpec(seq_length=4096, global_batch_size=64)


def test_tried_on_gpus_beside_the_plain_options_without_recompute():
    model, cluster = get_model("deepseek-v2-lite"), ClusterSpec(H100, 16)
    enum = enumerate_layouts(model, TRAINING, cluster)
    configs = list(enum.configs())
    graphed = [c for c in configs if c.cuda_graphs]
    assert graphed and all(c.recompute_granularity == "none" and not c.overlap_moe_expert_parallel_comm
                           and c.tp == c.cp == c.pp == 1 for c in graphed)
    # exactly the twins of the plain configs the executor captures (tp = cp = pp = 1) without recompute and without
    # the EP overlap
    twins = {c.replace(cuda_graphs=True) for c in configs if not c.cuda_graphs and c.recompute_granularity == "none"
             and not c.overlap_moe_expert_parallel_comm and c.tp == c.cp == c.pp == 1}
    assert set(graphed) == twins
    assert all(check_config(model, TRAINING, cluster, c) == [] for c in graphed[:200])
    assert any(c.moe_shared_expert_overlap for c in graphed)
    # the bookkeeping holds: considered = valid + rejected, the dropped recompute options under the graphs' rule
    assert enum.considered == enum.valid + sum(enum.rejected.values())
    assert enum.rejected["cuda_graphs_recompute"] > 0
    off = enumerate_layouts(model, TRAINING, cluster, SearchSpace(cuda_graphs=False))
    assert off.valid == enum.valid - len(graphed) and not off.rejected.get("cuda_graphs_recompute")


def test_never_on_cpu_ranks_nor_with_an_offloaded_attention():
    cpu = ClusterSpec(get_hardware("cpu"), 4)
    tiny = TrainingSpec(seq_length=64, global_batch_size=8)
    assert not any(c.cuda_graphs for c in enumerate_layouts(get_model("tiny-moe"), tiny, cpu).configs())
    space = SearchSpace(activation_offload=(("core_attn",),))
    assert not space.graphs_searched()
    assert not any(c.cuda_graphs for c in enumerate_layouts(get_model("tiny-moe"), tiny, ClusterSpec(H100, 8),
                                                            space).configs())


def test_chosen_where_the_host_sets_the_step_time():
    """tiny-moe on one H100 at seq 256: its kernels are tiny, the host issues them slower than the GPU runs them;
    the fastest layout replays its layers from graphs, is the plain fastest one with the knob on, and runs."""
    model, cluster = get_model("tiny-moe"), ClusterSpec(H100, 1)
    training = TrainingSpec(seq_length=256, global_batch_size=8)
    on = plan(model, training, cluster, top=3, rank_by="point").ranked[0]
    off = plan(model, training, cluster, top=3, rank_by="point", space=SearchSpace(cuda_graphs=False)).ranked[0]
    assert on.config.cuda_graphs and not off.config.cuda_graphs
    assert on.config == off.config.replace(cuda_graphs=True)
    assert on.time.step_time < off.time.step_time
    assert on.executable
