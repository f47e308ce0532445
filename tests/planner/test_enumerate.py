"""Enumeration counts: one case worked by hand, and the hierarchical enumerator against a brute force."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from spec.catalog import get_hardware, get_model
from spec.errors import InvalidConfigError
from spec.hardware import ClusterSpec
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from planner.enumerate import RULE_ORDER, SearchSpace, divisors, enumerate_layouts

# the four recompute options this hand-worked case was counted with (the default chain has more)
FOUR_RECOMPUTE = (("none", ()), ("selective", ("core_attn",)), ("selective", ("core_attn", "moe_act", "layernorm")),
                  ("full", ()))
from spec.validity import check_config

TINY = get_model("tiny-moe")  # 2 layers, 4 heads / 2 KV groups, 8 experts, expert FFN 32
CPU = get_hardware("cpu")
H100 = get_hardware("h100-sxm")


def test_tiny_moe_on_4_gpus_worked_by_hand():
    """tiny-moe on 4 GPUs, seq 64, global batch 8, mbs 1 only, no interleaving, distributed optimizer on,
    four recompute options, EP overlap not searched.

    (tp, cp, pp, dp) factorisations of 4: 10 (exponent 2 spread over 4 slots). pp4 needs 4 layers > 2:
    rejected (layers_pp); every tp <= 4 divides 4 heads and 2 KV groups works (tp 4 replicates KV); any cp
    divides 64/2; dp in {1, 2, 4} divides 8. Valid dense factorisations: 6 with pp1, 3 with pp2.
    (ep, etp, edp) factorisations of 4 (pp1): 6, of which only ep1·etp1 keeps tokens local (1 dispatcher),
    the other 5 try both dispatchers: 11 dispatcher choices; of 2 (pp2): 3 -> 2 + 2 + 1 = 5.
    pp4 leaves: 1 factorisation of 1 -> 1 dispatcher choice.
    With allgather alone: valid configs (6·11 + 3·5) · 4 recompute options = 81 · 4 = 324; layouts
    6·6 + 3·3 = 45; considered (66 + 15 + 1) · 4 = 328; rejected: 4, all layers_pp.
    CP communication types: the dense factorisations with cp > 1 are (tp, cp, pp) = (1, 2, 1), (2, 2, 1),
    (1, 4, 1) and (1, 2, 2). Each also runs p2p; a2a only where tp·cp divides the 2 KV heads (cp_a2a_heads):
    (1, 2, 1) and (1, 2, 2); the 64-rank CPU "node" holds every CP group, so a2a+p2p is not tried. p2p adds
    3·11 + 5 dispatcher choices, a2a 11 + 5: 54 · 4 = 216 configs (3·6 + 3 + 6 + 3 = 30 layouts); a2a at
    (2, 2, 1) and (1, 4, 1) is rejected, 2 · 11 · 4 = 88 configs.
    Valid 324 + 216 = 540, layouts 75, considered 328 + 216 + 88 = 632.
    """
    training = TrainingSpec(seq_length=64, global_batch_size=8, distributed_optimizer=True)
    enum = enumerate_layouts(TINY, training, ClusterSpec(CPU, 4), SearchSpace(mbs_max=1, vpp_max=1,
                                                                              cp_min_chunk_tokens=1,
                                                                              expert_ffn_min_columns=1,
                                                                              recompute=FOUR_RECOMPUTE,
                                                                              ep_overlap=False))
    assert len(enum.layouts) == 75
    assert enum.valid == 540
    assert enum.considered == 632
    assert enum.rejected == {"layers_pp": 4, "cp_a2a_heads": 88}
    assert "num_layers (2) is smaller than pp·vpp = 4·1 = 4" in enum.examples["layers_pp"].reason
    assert enum.recompute == FOUR_RECOMPUTE and enum.distributed_optimizer == (True,)
    configs = list(enum.configs())
    assert len(configs) == 540 == len(set(configs))
    assert Counter(c.cp_comm_type for c in configs) == {"allgather": 324, "p2p": 38 * 4, "a2a": 16 * 4}
    assert all(c.dp * c.tp * c.cp * c.pp == 4 == c.edp * c.ep * c.etp * c.pp for c in configs)
    assert all(c.sequence_parallel == (c.tp > 1) for c in configs)
    assert {c.moe_token_dispatcher_type for c in configs if c.ep * c.etp == 1} == {"alltoall"}


def _brute_force(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, space: SearchSpace):
    """Every candidate built as a real ParallelConfig and judged by check_config (slow, obviously right)."""
    world = cluster.num_gpus
    distopts = (True, False) if training.distributed_optimizer is None else (training.distributed_optimizer,)
    order = {rule: i for i, rule in enumerate(RULE_ORDER)}
    valid = []
    rejected: Counter = Counter()
    for tp in divisors(world):
        for cp in divisors(world // tp):
            if not space.allows_cp(cp, training.seq_length):
                continue
            for cp_option, pp in ((o, pp) for o in space.cp_comm_options(tp, cp, cluster.gpus_per_node)
                                  for pp in divisors(world // (tp * cp))):
                for vpp in range(1, space.vpp_max + 1):
                    for ep in divisors(world // pp):
                        for etp in divisors(world // (pp * ep)):
                            if not space.allows_etp(etp, model):
                                continue
                            dispatchers = space.dispatchers_for(ep, etp, model.is_moe, cluster.gpus_per_node,
                                                                 bool(model.shared_expert_ffn_hidden_size),
                                                                 gpu=cluster.gpu.name != "cpu"
                                                                 and tp == cp == pp == 1)
                            for mbs in range(1, space.mbs_max + 1):
                                for disp in dispatchers:
                                    for distopt in distopts:
                                        for gran, mods in space.recompute_for(model):
                                            cfg = ParallelConfig(world, tp=tp, cp=cp, pp=pp, vpp=vpp, ep=ep,
                                                                 etp=etp, micro_batch_size=mbs,
                                                                 recompute_granularity=gran, recompute_modules=mods,
                                                                 **disp.fields(), **cp_option.fields(),
                                                                 use_distributed_optimizer=distopt,
                                                                 overlap_param_gather=distopt)
                                            found = check_config(model, training, cluster, cfg)
                                            if found:
                                                rejected[min(found, key=lambda r: order[r.rule]).rule] += 1
                                            else:
                                                valid.append(cfg)
    return valid, rejected


def test_enumerator_matches_brute_force_moe_and_dense():
    space = SearchSpace(mbs_max=3, vpp_max=2, cp_min_chunk_tokens=4, expert_ffn_min_columns=8)
    dense = ModelSpec(name="dense6", num_layers=4, hidden_size=96, num_attention_heads=6, num_query_groups=3,
                      ffn_hidden_size=192, vocab_size=256, make_vocab_size_divisible_by=8)
    cases = [
        (TINY, TrainingSpec(seq_length=64, global_batch_size=16), 8),
        (replace(get_model("tiny-moe-shared"), moe_ffn_hidden_size=24), TrainingSpec(seq_length=24, global_batch_size=12,
                                                                                  distributed_optimizer=False), 8),
        (dense, TrainingSpec(seq_length=32, global_batch_size=8), 4),
        (TINY, TrainingSpec(seq_length=16, global_batch_size=32), 16),  # H100: 8 per node caps allgather
    ]
    for model, training, gpus in cases:
        cluster = ClusterSpec(H100 if gpus > 8 else CPU, gpus)
        enum = enumerate_layouts(model, training, cluster, space)
        valid, rejected = _brute_force(model, training, cluster, space)
        assert set(enum.configs()) == set(valid), model.name
        assert enum.valid == len(valid)
        assert enum.rejected == dict(rejected), model.name
        assert enum.considered == len(valid) + sum(rejected.values())
        if model is dense:  # the dense model never tries moe_act and never an expert layout
            assert enum.rejected["recompute_modules"] > 0 and "experts_ep" in enum.rejected
    # allgather only for ETP·EP groups inside one 8-GPU node; CP chunks of >= 4 tokens (cp <= 2 at seq 16)
    assert {c.moe_token_dispatcher_type for c in enum.configs() if c.ep * c.etp == 16} == {"alltoall"}
    assert {c.moe_token_dispatcher_type for c in enum.configs() if c.ep * c.etp == 8} == {"alltoall", "allgather"}
    assert max(lay.cp for lay in enum.layouts) == 2
    assert max(lay.etp for lay in enum.layouts) == 4  # expert FFN 32 in shards of >= 8 columns


def test_large_cluster_enumerates_fast_and_counts_add_up():
    import time

    model = get_model("deepseek-v3")
    cluster = ClusterSpec(get_hardware("h100-sxm"), 1024)
    # CPU time of this process, not wall time: other jobs on a busy machine do not count against it
    t0 = time.process_time()
    enum = enumerate_layouts(model, TrainingSpec(seq_length=4096, global_batch_size=8192), cluster)
    elapsed = time.process_time() - t0
    assert enum.considered == enum.valid + sum(enum.rejected.values())
    assert enum.valid > 100_000 and len(enum.layouts) > 10_000
    assert elapsed < 5.0  # ~0.2 s of CPU on the 2-core CI machine
    # uneven pipelines are enumerated (61 layers is prime)
    assert any(lay.pp == 16 for lay in enum.layouts)
    assert all(sum(lay.stage_layers) == 61 for lay in enum.layouts)


def test_an_unknown_dispatcher_in_the_search_space_is_an_error():
    # the enumeration builds its configs unchecked, so the search space refuses the name up front
    with pytest.raises(InvalidConfigError, match="'bogus'"):
        SearchSpace(dispatchers=("alltoall", "bogus"))


def test_cp_comm_options_try_the_hierarchical_split_only_across_nodes():
    space = SearchSpace()
    names = lambda options: [(o.cp_comm_type, o.sizes) for o in options]  # noqa: E731
    assert names(space.cp_comm_options(2, 1, 8)) == [("allgather", None)]
    # tp 1, cp 8 fits one node of 8: no hierarchy
    assert names(space.cp_comm_options(1, 8, 8)) == [("allgather", None), ("p2p", None), ("a2a", None)]
    # tp 2, cp 16: CP ranks 2 apart over 4 nodes, 4 on each: a2a over the 4, the ring across the nodes
    assert names(space.cp_comm_options(2, 16, 8))[-1] == ("a2a+p2p", (4, 4))
    # tp 8, cp 4: one CP rank per node, nothing for an all-to-all inside a node
    assert "a2a+p2p" not in {o.cp_comm_type for o in space.cp_comm_options(8, 4, 8)}
    assert names(SearchSpace(cp_comm_types=("p2p",)).cp_comm_options(1, 4, 8)) == [("p2p", None)]
    with pytest.raises(InvalidConfigError, match="CP communication types"):
        SearchSpace(cp_comm_types=("ring",))
