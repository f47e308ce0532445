"""One rank of a large layout built and timed alone (executor/slices.py): its groups exchange nothing but
give integer payloads as a symmetric world would, its local experts receive the scenario's exact rows, and
its modules hold its real shards."""

import torch

from executor.parallel.collectives import all_gather, all_gather_nograd, all_reduce_, all_to_all, reduce_scatter
from executor.parallel.groups import SLICE_PEERS, slice_state
from executor.slices import SliceTiming, assignment, measure_slice, slice_rank
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from spec.proxy import proxy_model
from spec.routing_scenarios import hot_expert_load, routed_counts, scenario_load


def test_slice_groups_have_real_sizes_and_stand_in_communicators():
    config = ParallelConfig(world_size=64, tp=2, cp=2, ep=4, etp=2, pp=2)
    state = slice_state(config, slice_rank(config))
    assert (state.tp.size, state["cp"].size, state.ep.size, state.etp.size, state["pp"].size) == (2, 2, 4, 2, 2)
    assert state.tp.pg is SLICE_PEERS and state["dp"].size == 8 and state["dp"].pg is SLICE_PEERS
    assert state.tp.rank == state.ep.rank == state["pp"].rank == 0


def test_stand_in_collectives_size_outputs_and_mirror_integer_payloads():
    config = ParallelConfig(world_size=8, tp=2, ep=4)
    state = slice_state(config, slice_rank(config))
    x = torch.randn(3, 5)
    assert all_gather(x, state.tp).shape == (6, 5)
    assert reduce_scatter(torch.randn(6, 5), state.tp).shape == (3, 5)
    ids = torch.tensor([[1, 2], [3, 0]])
    assert torch.equal(all_gather_nograd(ids, state.tp), torch.cat([ids, ids]))
    # the routing counts' exchange: every EP peer sends this rank what it sends itself (row 0: EP rank 0)
    counts_PE = torch.tensor([[5, 6], [1, 2], [3, 4], [7, 8]])
    received = all_to_all(counts_PE, [1] * 4, [1] * 4, state.ep)
    assert torch.equal(received, torch.tensor([[5, 6]] * 4))
    total = all_reduce_(torch.tensor([2, 3]), state.tp)
    assert torch.equal(total, torch.tensor([4, 6]))


def test_assignment_gives_each_expert_its_count_and_no_token_an_expert_twice():
    counts = routed_counts(hot_expert_load(8, 2.0), 64, 4)
    experts = assignment(counts, 64, 4, torch.device("cpu"))
    assert experts.shape == (64, 4)
    assert torch.bincount(experts.flatten(), minlength=8).tolist() == counts
    assert all(len(set(row)) == 4 for row in experts.tolist())


def test_slice_of_a_folded_layout_routes_the_scenario_rows_to_its_local_experts():
    model = proxy_model(get_model("qwen3-30b-a3b"), 2, "tiny")  # 8 experts, top-4, 4 heads, hidden 64
    config = ParallelConfig(world_size=64, tp=2, cp=2, pp=2, ep=4, etp=2, micro_batch_size=2,
                            recompute_granularity="selective", recompute_modules=("moe_act",))
    loads = {"even": scenario_load("even", 8), "skewed": scenario_load("skewed", 8, 2.0)}
    out = measure_slice(model, config, 64, "fp32", loads, cap=1, timing=SliceTiming(calls=1, windows=1, warmup=1))
    moe = out["kinds"]["moe"]
    assert list(out["kinds"]) == ["moe"] and moe["layers"] == [0]
    # its real shards: 4 heads / tp 2, 2 KV groups / tp 2, 64 / cp 2 queries against all 64 keys (CP gathers
    # them), 8 experts / ep 4 at FFN 32 / etp 2
    assert moe["shapes"] == {"heads": 2, "kv_heads": 1, "q_tokens": 32, "kv_tokens": 64, "micro_batch": 2,
                             "local_experts": 2, "expert_ffn": 16}
    # the rank's tokens at the router: seq 64 / cp 2 / tp 2 (sequence parallel) x mbs 2 = 32, 128 copies
    for name, load in loads.items():
        counts = routed_counts(load, 32, 4)
        # EP rank 0 holds experts 0 and 1; each of 4 EP peers sends its copies, gathered over 2 ETP members
        assert moe["expert_rows"][name] == [4 * 2 * counts[0], 4 * 2 * counts[1]]
    assert moe["expert_rows"]["skewed"][0] == 2 * moe["expert_rows"]["even"][0]
    for key in ("layer_s", "no_recompute_s", "grouped_gemm_s"):
        assert set(moe[key]) == {"even", "skewed"} and all(v > 0 for v in moe[key].values())
    assert moe["gemm_s"] > 0 and moe["attention_core_s"] > 0
    assert out["parts"]["embedding_s"] > 0 and out["parts"]["head_s"] > 0
    assert out["layout"] == config.label() and out["rank"] == 0 and out["methods"]["layer_s"] == "wall clock"
