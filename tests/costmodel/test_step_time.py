"""The step-time model: hand-worked terms, monotonic behaviour, and validation against published rows."""

import json
from dataclasses import FrozenInstanceError, fields, replace
from pathlib import Path

import pytest

from spec import (
    ClusterSpec,
    InvalidConfigError,
    MeasuredCurve,
    ModelSpec,
    ParallelConfig,
    TrainingSpec,
    get_hardware,
    get_model,
)
from costmodel import reference
from costmodel.attention_kinds import fused_causal_fraction, window_keys
from costmodel.collective_inventory import step_stat_calls
from costmodel.comm import call_time, group_placement, link_rates
from costmodel.compute import (KERNEL_OVERHEAD_S, attention_time, compute_rates, grouped_gemm_fwd_bwd, memory_time,
                               sink_attention_time)
from spec.flops import flops_per_step
from costmodel.params import stage_param_counts
from spec.validity import COSTMODEL_RULES, check
from costmodel.step_time import (
    TERMS,
    StepTimeBreakdown,
    estimate_step_time,
    layer_times,
    pipeline_bubble,
    stage_times,
)

H100 = get_hardware("h100-sxm")
A100 = get_hardware("a100-80gb")
BOTTLENECKS = {"compute", "all-to-all", "tp-comm", "cp-comm", "dp-comm", "pp-bubble", "pp-comm", "memory-bound",
               "optimizer", "host-overhead"}
REFERENCE = Path(__file__).resolve().parents[1] / "data" / "reference.json"  # copy of shared/validation

DENSE = ModelSpec(name="dense-test", num_layers=8, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                  ffn_hidden_size=14336, vocab_size=32000)


def _step(model, training, cluster, **kw):
    return estimate_step_time(model, training, cluster, ParallelConfig(world_size=cluster.num_gpus, **kw))


# ---- interface ------------------------------------------------------------------------------------
def test_breakdown_names_and_sums():
    b = _step(get_model("mixtral-8x7b"), TrainingSpec(seq_length=4096, global_batch_size=64),
              ClusterSpec(H100, 32), tp=2, pp=2, ep=8)
    assert tuple(name for name, _ in b.terms) == TERMS
    assert b.step_time == pytest.approx(sum(v for _, v in b.terms))
    assert all(v >= 0 for _, v in b.terms) and all(v >= 0 for _, v in b.hidden)
    assert {name for name, _ in b.hidden} <= set(TERMS)
    assert b.bottleneck in BOTTLENECKS
    assert b.tokens_per_s_per_gpu == pytest.approx(64 * 4096 / b.step_time / 32)
    flops = flops_per_step(get_model("mixtral-8x7b"), 4096, 64)
    assert b.tflops_per_gpu == pytest.approx(flops / b.step_time / 32 / 1e12)
    assert b.mfu == pytest.approx(b.tflops_per_gpu * 1e12 / 989.4e12)
    # built without the generated __init__ for speed: still an ordinary, equal, immutable dataclass
    assert b == StepTimeBreakdown(**{f.name: getattr(b, f.name) for f in fields(StepTimeBreakdown)})
    with pytest.raises(FrozenInstanceError):
        b.step_time = 0.0


def test_bad_layouts_raise_one_clear_error():
    model, cluster = get_model("mixtral-8x7b"), ClusterSpec(H100, 16)
    with pytest.raises(InvalidConfigError, match="global_batch_size"):
        _step(model, TrainingSpec(seq_length=4096, global_batch_size=12), cluster, tp=2)
    with pytest.raises(InvalidConfigError, match="num_experts"):
        _step(model, TrainingSpec(seq_length=4096, global_batch_size=16), cluster, ep=16)
    with pytest.raises(InvalidConfigError, match="correction"):
        estimate_step_time(model, TrainingSpec(seq_length=4096, global_batch_size=16), cluster,
                           ParallelConfig(world_size=16), corrections={"nonsense": 2.0})


# ---- hand-worked terms ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v3", "qwen2-57b-a14b", "deepseek-v2-lite",
                                  "tiny-moe-shared", "gpt-oss-120b"])
def test_gemm_shapes_match_megatron_flops(name):
    """With GEMMs at exactly peak, GEMM + grouped-GEMM seconds are the model's linear-layer FLOPs / peak.

    This checks every GEMM shape (GQA and MLA projections, dense-first layers, shared and routed experts,
    MTP, logits) against spec.flops, which follows Megatron's formula, for Megatron's loss
    (``megatron_cross_entropy``) and the executor's, which keeps its logits at these sizes (4096 tokens a
    micro-batch): no second output-layer GEMM in backward (tests/costmodel/test_loss_terms.py prices the
    blocked one).
    """
    one = MeasuredCurve(((1.0, 1.0),))
    hw = replace(H100, gemm_efficiency=one, grouped_gemm_efficiency=one)
    model = get_model(name)
    seq, gbs = 4096, 16
    ep = 8 if model.num_experts % 8 == 0 else 1
    b = _step(model, TrainingSpec(seq_length=seq, global_batch_size=gbs), ClusterSpec(hw, 8), ep=ep)
    megatron = _step(model, TrainingSpec(seq_length=seq, global_batch_size=gbs, megatron_cross_entropy=True),
                     ClusterSpec(hw, 8), ep=ep)
    layers = model.num_layers + model.mtp_num_layers
    n = model.num_attention_heads
    if model.multi_latent_attention:
        core = 3 * seq * n * (model.qk_head_dim + model.qk_pos_emb_head_dim + model.v_head_dim)
    else:
        core = 6 * seq * n * model.head_dim
    linear = flops_per_step(model, seq, gbs) - core * layers * seq * gbs
    assert (megatron.term("gemm") + megatron.term("grouped_gemm")) * 8 * 989.4e12 == pytest.approx(linear, rel=1e-4)
    assert (b.term("gemm") + b.term("grouped_gemm")) * 8 * 989.4e12 == pytest.approx(linear, rel=1e-4)


def test_dp_grad_all_reduce_volume_and_link():
    """Without the distributed optimizer: one all-reduce of 2·P·(dp-1)/dp fp32 bytes over the DP group."""
    cluster = ClusterSpec(H100, 32)
    training = TrainingSpec(seq_length=2048, global_batch_size=32)
    config = ParallelConfig(world_size=32, tp=8, use_distributed_optimizer=False, overlap_grad_reduce=False,
                            overlap_param_gather=False)
    b = estimate_step_time(DENSE, training, cluster, config)
    params = stage_param_counts(DENSE, config, 0).dense
    # DP group: 4 ranks 8 apart, one per node -> one 50 GB/s NIC at 80 %, 2·(n-1) steps of 10 us
    expected = 2 * params * 4 * 3 / 4 / (50e9 * 0.8) + 2 * 3 * 10e-6
    # plus the step's small calls in line after the backward (TP sums of replicated gradients, statistics)
    assert b.term("dp_grad") == pytest.approx(expected + _step_stats(training, cluster, config))
    assert b.term("param_gather") == 0.0 and b.term("edp_grad") == 0.0


def _step_stats(training, cluster, config) -> float:
    """Seconds of collective_inventory.step_stat_calls on the test's DENSE model (TP of 8 inside a node, DP·CP of
    4 one per node)."""
    link = link_rates(cluster.hardware)
    places = {"tp": group_placement(1, config.tp, 8), "dp_cp": group_placement(config.tp, 4, 8)}
    calls = step_stat_calls(DENSE, training, config)
    assert {c.group for c in calls} == {"tp", "dp_cp"}
    return sum(call_time(link, c, places[c.group]) for c in calls)


def test_distributed_optimizer_reduce_scatters_grads_and_gathers_params():
    cluster = ClusterSpec(H100, 32)
    training = TrainingSpec(seq_length=2048, global_batch_size=32)
    config = ParallelConfig(world_size=32, tp=8, overlap_grad_reduce=False, overlap_param_gather=False)
    b = estimate_step_time(DENSE, training, cluster, config)
    params = stage_param_counts(DENSE, config, 0).dense
    assert b.term("dp_grad") == pytest.approx(params * 4 * 3 / 4 / (50e9 * 0.8) + 3 * 10e-6
                                              + _step_stats(training, cluster, config))
    assert b.term("param_gather") == pytest.approx(params * 2 * 3 / 4 / (50e9 * 0.8) + 3 * 10e-6)
    # the optimizer touches 1/dp of the parameters
    sharded = estimate_step_time(DENSE, training, cluster, config).term("optimizer")
    whole = estimate_step_time(DENSE, training, cluster,
                               config.replace(use_distributed_optimizer=False)).term("optimizer")
    fixed = 4 * KERNEL_OVERHEAD_S  # the optimizer's few kernels' fixed cost
    assert (whole - fixed) / (sharded - fixed) == pytest.approx(4)


def test_expert_grads_reduce_over_edp():
    model = get_model("mixtral-8x7b")
    training = TrainingSpec(seq_length=4096, global_batch_size=64)
    cluster = ClusterSpec(H100, 64)
    edp8 = _step(model, training, cluster, tp=2, ep=8, overlap_grad_reduce=False)
    edp1 = _step(model, TrainingSpec(seq_length=4096, global_batch_size=8), ClusterSpec(H100, 8), tp=2, ep=8,
                 overlap_grad_reduce=False)
    assert edp8.term("edp_grad") > 0 and edp1.term("edp_grad") == 0.0


def test_bubble_is_pp_minus_one_over_vpp_m_of_the_ideal():
    assert pipeline_bubble([2.0] * 8, vpp=1) == pytest.approx(7 * 2.0)
    m, t = 16, 2.0
    assert pipeline_bubble([t] * 8, vpp=4) == pytest.approx((8 - 1) / (4 * m) * (m * t))
    model = DENSE.with_layers(16)
    cluster = ClusterSpec(H100, 32)
    for gbs in (8, 32):
        training = TrainingSpec(seq_length=2048, global_batch_size=gbs)
        plain = ParallelConfig(world_size=32, tp=4, pp=4)
        b1 = estimate_step_time(model, training, cluster, plain)
        times = stage_times(model, training, cluster, plain)
        assert b1.term("pp_bubble") == pytest.approx(pipeline_bubble(times, 1))
        # 16 layers split evenly: every stage holds 4 layers with or without interleaving
        b2 = estimate_step_time(model, training, cluster, plain.replace(vpp=2))
        assert stage_times(model, training, cluster, plain.replace(vpp=2)) == pytest.approx(times)
        assert b2.term("pp_bubble") == pytest.approx(b1.term("pp_bubble") / 2)
    assert estimate_step_time(model, training, cluster, ParallelConfig(world_size=32, tp=4)).term("pp_bubble") == 0


def test_stage_imbalance_from_embedding_logits_and_mtp():
    model = replace(DENSE.with_layers(12), vocab_size=256000)
    training = TrainingSpec(seq_length=2048, global_batch_size=16)
    cluster = ClusterSpec(H100, 16)
    config = ParallelConfig(world_size=16, tp=4, pp=4)
    first, middle, _, last = stage_times(model, training, cluster, config)
    assert first > middle and last > first  # embedding < logits + loss over a large vocabulary
    with_mtp = replace(model, mtp_num_layers=1)
    assert stage_times(with_mtp, training, cluster, config)[-1] > last
    # fill and drain pass through every rank but the slowest: more than (pp-1) middle stages' worth
    b = estimate_step_time(model, training, cluster, config)
    assert b.term("pp_bubble") == pytest.approx(first + 2 * middle)
    assert b.term("pp_bubble") > 3 * middle


def test_tokens_per_expert_and_imbalance_slow_the_grouped_gemm():
    model = get_model("mixtral-8x7b")
    cluster = ClusterSpec(H100, 8)
    config = ParallelConfig(world_size=8, ep=8)
    balanced = layer_times(model, TrainingSpec(seq_length=4096, global_batch_size=8), cluster, config)["moe"]
    skewed = layer_times(model, TrainingSpec(seq_length=4096, global_batch_size=8, moe_routing_imbalance=1.5),
                         cluster, config)["moe"]
    grouped = dict(balanced.fwd)["grouped_gemm"]
    assert dict(skewed.fwd)["grouped_gemm"] == pytest.approx(1.5 * grouped, rel=0.01)
    assert dict(skewed.fwd)["ep_a2a"] > dict(balanced.fwd)["ep_a2a"]


# ---- monotonic behaviour --------------------------------------------------------------------------
def test_more_dp_keeps_per_gpu_compute():
    model = get_model("mixtral-8x7b")
    training = TrainingSpec(seq_length=4096, global_batch_size=64)
    small = _step(model, training, ClusterSpec(H100, 16), tp=2, ep=8)
    large = _step(model, training, ClusterSpec(H100, 64), tp=2, ep=8)
    # per micro-batch the same work; 4x the DP means 1/4 of the micro-batches per GPU
    assert stage_times(model, training, ClusterSpec(H100, 16), ParallelConfig(world_size=16, tp=2, ep=8)) == \
        pytest.approx(stage_times(model, training, ClusterSpec(H100, 64), ParallelConfig(world_size=64, tp=2, ep=8)))
    for term in ("gemm", "grouped_gemm", "attention_core"):
        assert large.term(term) * 4 == pytest.approx(small.term(term))
    # memory_bound: m micro-batches' worth less one per step: the first gradient written into each fp32 main
    # gradient, not added (6 bytes a local weight instead of 10)
    counts = stage_param_counts(model, ParallelConfig(world_size=16, tp=2, ep=8), 0)
    saving = 4 * (counts.dense + counts.expert) / compute_rates(H100, "bf16").hbm_bandwidth
    assert small.term("memory_bound") + saving == pytest.approx(4 * (large.term("memory_bound") + saving))


def test_a_steps_first_gradient_is_written_not_added():
    """memory_bound is m micro-batches' worth less one saving a step: the first gradient of each local weight
    is written into its fp32 main gradient (read 2, write 4 bytes) where the layer blocks price an add (10). So
    step(2) - 2 · step(1) = 4 bytes × local weights / HBM bandwidth; nothing with Megatron's fused accumulation
    (no add priced) or fp32 weights (autograd accumulates their .grad)."""
    model = get_model("mixtral-8x7b").with_layers(2)
    config = ParallelConfig(world_size=1)
    cluster = ClusterSpec(H100, 1)
    counts = stage_param_counts(model, config, 0)
    saving = 4 * (counts.dense + counts.expert) / compute_rates(H100, "bf16").hbm_bandwidth

    def memory_bound(training, gbs):
        return estimate_step_time(model, replace(training, global_batch_size=gbs), cluster, config).term("memory_bound")

    bf16 = TrainingSpec(seq_length=4096, global_batch_size=1)
    assert memory_bound(bf16, 2) - 2 * memory_bound(bf16, 1) == pytest.approx(saving)
    # the weights counted, by hand: per layer 8 experts' w1, w3, w2, the attention projections (GQA: k, v at 8
    # of 32 heads), the router and two norms; the embedding, the untied LM head and the final norm
    h, f, v = 4096, 14336, 32000
    layer = 8 * 3 * h * f + h * (h + 2 * 1024) + h * h + 8 * h + 2 * h
    assert counts.dense + counts.expert == 2 * layer + 2 * v * h + h
    for other in (replace(bf16, gradient_accumulation_fusion=True), replace(bf16, precision="fp32")):
        assert memory_bound(other, 2) - 2 * memory_bound(other, 1) == pytest.approx(0.0, abs=1e-12)


def test_ep_group_crossing_nodes_makes_the_all_to_all_slower():
    model = get_model("qwen3-30b-a3b")
    training = TrainingSpec(seq_length=4096, global_batch_size=32)
    cluster = ClusterSpec(H100, 16)
    inside = _step(model, training, cluster, ep=8)
    across = _step(model, training, cluster, ep=16)
    assert across.term("ep_a2a") > 3 * inside.term("ep_a2a")
    # ETP2 pushes the EP8 group's ranks two apart, over two nodes
    strided = _step(model, training, cluster, tp=2, ep=8, etp=2)
    packed = _step(model, training, cluster, tp=2, ep=8, etp=1)
    assert dict(layer_times(model, training, cluster, ParallelConfig(world_size=16, tp=2, ep=8, etp=2))["moe"].fwd)[
        "ep_a2a"] > dict(layer_times(model, training, cluster, ParallelConfig(world_size=16, tp=2, ep=8))["moe"].fwd)[
        "ep_a2a"]
    assert strided.term("etp_comm") > 0 and packed.term("etp_comm") == 0


def test_allgather_dispatcher_prices_gather_and_scatter_volumes():
    model = get_model("mixtral-8x7b")
    training = TrainingSpec(seq_length=4096, global_batch_size=8)
    cluster = ClusterSpec(H100, 8)
    a2a = _step(model, training, cluster, ep=8)
    ag = _step(model, training, cluster, ep=8, moe_token_dispatcher_type="allgather")
    # top-2 of 8 experts: the all-gather moves every token to every rank, 4x the a2a's token copies
    assert ag.term("ep_a2a") > 2 * a2a.term("ep_a2a")
    assert ag.term("etp_comm") == 0.0


def _compute(b):
    return sum(b.term(t) for t in ("gemm", "grouped_gemm", "attention_core", "memory_bound", "recompute"))


@pytest.mark.parametrize("flag", ["overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap",
                                  "overlap_moe_expert_parallel_comm"])
def test_overlap_flags_hide_communication_but_never_compute(flag):
    model = get_model("qwen3-30b-a3b")
    training = TrainingSpec(seq_length=4096, global_batch_size=128)
    cluster = ClusterSpec(H100, 64)
    off = dict(tp=2, ep=16, overlap_grad_reduce=False, overlap_param_gather=False, tp_comm_overlap=False,
               overlap_moe_expert_parallel_comm=False)
    for pp in (1, 2):
        base = _step(model, training, cluster, pp=pp, **off)
        on = _step(model, training, cluster, pp=pp, **{**off, flag: True})
        assert on.step_time < base.step_time
        assert on.step_time >= _compute(on)
        assert sum(v for _, v in on.hidden) > sum(v for _, v in base.hidden)
        if pp == 1:  # one stage: the same compute, only less exposed communication
            assert _compute(on) == pytest.approx(_compute(base))


def test_recomputation_costs_forward_work():
    model = get_model("deepseek-v2-lite")
    training = TrainingSpec(seq_length=4096, global_batch_size=32)
    cluster = ClusterSpec(H100, 8)
    none = _step(model, training, cluster, ep=8)
    attn = _step(model, training, cluster, ep=8, recompute_granularity="selective")
    moe = _step(model, training, cluster, ep=8, recompute_granularity="selective", recompute_modules=("moe",))
    full = _step(model, training, cluster, ep=8, recompute_granularity="full")
    half = _step(model, training, cluster, ep=8, recompute_granularity="full", recompute_num_layers=13)
    assert none.term("recompute") == 0.0
    assert 0 < attn.term("recompute") < moe.term("recompute") < full.term("recompute")
    assert half.term("recompute") == pytest.approx(full.term("recompute") * 13 / 27, rel=0.05)
    # selective core_attn recomputes exactly the attention core's forward
    attention = layer_times(model, training, cluster, ParallelConfig(world_size=8, ep=8))["attention"]
    m = 32 // 8  # micro-batches per step
    assert attn.term("recompute") == pytest.approx(m * model.num_layers * dict(attention.fwd)["attention_core"])
    # full recompute is below one extra forward+backward, above the forward compute alone
    assert full.term("recompute") < none.step_time / 2


def test_corrections_scale_their_term():
    model = get_model("mixtral-8x7b")
    training = TrainingSpec(seq_length=4096, global_batch_size=16)
    cluster = ClusterSpec(H100, 16)
    config = ParallelConfig(world_size=16, tp=2, ep=8)
    base = estimate_step_time(model, training, cluster, config)
    corrected = estimate_step_time(model, training, cluster, config, corrections={"ep_a2a": 2.0, "gemm": 0.5})
    assert corrected.term("ep_a2a") == pytest.approx(2 * base.term("ep_a2a"))
    assert corrected.step_time == pytest.approx(base.step_time + base.term("ep_a2a") - base.term("gemm") / 2)


# ---- validation against published measurements (loose bands; issue 7 tightens after calibration) ---
def _reference():
    if not REFERENCE.exists():
        pytest.skip(f"{REFERENCE} not present")
    return json.loads(REFERENCE.read_text())


def nemo_rows():
    return reference.nemo_rows(_reference()["nemo_24_07_h100_dense"], H100)


def korthikanti_rows():
    return reference.korthikanti_rows(_reference()["korthikanti2022"], A100)


def moe_layer_rows():
    return reference.moe_layer_rows(_reference()["megatron_moe_layer_8xh100"], H100)


def _report(title, rows, band):
    print(f"\n{title} (model prediction vs published)")
    for label, predicted, published in rows:
        error = predicted / published - 1
        print(f"  {label:58s} predicted {predicted:10.2f}  published {published:10.2f}  {error:+6.1%}")
    errors = [abs(p / q - 1) for _, p, q in rows]
    print(f"  mean |error| {sum(errors) / len(errors):.1%}, max {max(errors):.1%} (band {band:.0%})")
    return errors


def test_validation_nemo_fp8_h100_dense():
    errors = _report("NeMo 24.07 fp8 H100 dense, tokens/s/GPU", nemo_rows(), 0.40)
    assert max(errors) < 0.40


def test_validation_korthikanti_a100_iteration_time():
    errors = _report("Korthikanti 2022 A100 fp16, seconds per iteration", korthikanti_rows(), 0.15)
    assert max(errors) < 0.15


def test_validation_megatron_moe_layer():
    errors = _report("Megatron MoE layer 8xH100 TP1 EP8, ms", moe_layer_rows(), 0.45)
    assert max(errors) < 0.45


# ---- speed ----------------------------------------------------------------------------------------
_SWEEP = """
import itertools, time
from spec import ClusterSpec, ParallelConfig, TrainingSpec, get_hardware, get_model
from costmodel.step_time import estimate_step_time

model = get_model("deepseek-v3")
training = TrainingSpec(seq_length=4096, global_batch_size=8192)
cluster = ClusterSpec(get_hardware("h100-sxm"), 1024)
configs = []
for tp, pp, vpp, ep, etp, mbs, rc in itertools.product((1, 2, 4, 8), (4, 8, 16), (1, 2), (8, 16, 32, 64), (1, 2),
                                                       (1, 2), ("none", "selective", "full")):
    dp = 1024 // (tp * pp)
    if 8192 % (mbs * dp) or 1024 % (etp * ep * pp):
        continue
    configs.append(ParallelConfig(world_size=1024, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, micro_batch_size=mbs,
                                  recompute_granularity=rc))
start = time.thread_time()
results = [estimate_step_time(model, training, cluster, c) for c in configs]
per_call = (time.thread_time() - start) / len(configs)
assert all(r.step_time > 0 for r in results)
print(len(configs), per_call)
"""


def test_planner_sized_sweep_is_fast():
    """A cold sweep over DeepSeek-V3 layouts on 1024 H100: per-call cost must stay small (CI-safe bound).

    It runs in a fresh process, as ``foldtune plan`` does, timed in that thread's CPU time: inside the test
    session the heap of every earlier test makes the garbage collector's passes, and other processes on a
    shared 2-core machine the wall clock, up to 10x slower (580 and 507 us per call read in full CI runs,
    46-57 us alone)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SWEEP], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    count, per_call = out.stdout.split()
    print(f"\n{count} DeepSeek-V3 layouts, cold, fresh process: {float(per_call) * 1e6:.1f} us per call")
    assert int(count) > 1000
    assert float(per_call) < 500e-6


def test_host_overhead_floors_an_overhead_bound_layout():
    from costmodel import host

    model = get_model("small-moe")  # hidden 256: every kernel is tiny, the host sets the pace
    training = TrainingSpec(seq_length=1024, global_batch_size=16)
    config = ParallelConfig(world_size=2)
    b = estimate_step_time(model, training, ClusterSpec(get_hardware("h200"), 2), config)
    per_op = get_hardware("h200").op_launch_seconds
    layers = host.layer_host_ops(model, config, True) * model.num_layers
    per_micro_batch = (layers + host.extras_host_ops(config, True, True)).seconds(
        per_op, get_hardware("h200").collective_launch_seconds)
    m = 16 // 2
    assert b.step_time >= m * per_micro_batch
    assert b.term("host_overhead") > 0.5 * b.step_time and b.bottleneck == "host-overhead"
    assert b.step_time == pytest.approx(sum(v for _, v in b.terms))
    # a measured executor layer replaces the bare-op launch cost: twice the layer, twice the host floor
    slow = replace(get_hardware("h200"), name="h200-slow-host", moe_layer_host_s=2 * host.MOE_LAYER.ops * per_op)
    b2 = estimate_step_time(model, training, ClusterSpec(slow, 2), config)
    assert b2.step_time == pytest.approx(2 * b.step_time, rel=0.05)


def test_host_overhead_vanishes_for_a_real_sized_layer():
    model = get_model("mixtral-8x7b").with_layers(2)
    b = estimate_step_time(model, TrainingSpec(seq_length=4096, global_batch_size=8), ClusterSpec(H100, 2),
                           ParallelConfig(world_size=2, ep=2))
    assert b.term("host_overhead") == 0.0


def test_overlap_slowdown_charges_its_share_of_hidden_gradient_traffic():
    """A measured interference of 0.4 adds 0.4 x the hidden seconds of each DP collective to its exposed term."""
    model = get_model("mixtral-8x7b")
    training = TrainingSpec(seq_length=4096, global_batch_size=64)
    config = ParallelConfig(world_size=16, tp=2, ep=8, micro_batch_size=1)
    slow = estimate_step_time(model, training, ClusterSpec(replace(H100, overlap_slowdown=0.4), 16), config)
    free = estimate_step_time(model, training, ClusterSpec(H100, 16), config)
    hidden = dict(free.hidden)
    for term, name in (("dp_grad", "dp_grad"), ("edp_grad", "edp_grad"), ("param_gather", "param_gather")):
        assert slow.term(term) == pytest.approx(free.term(term) + 0.4 * hidden[name])
    assert sum(hidden[n] for n in ("dp_grad", "edp_grad", "param_gather")) > 0  # something was hidden
    assert slow.step_time > free.step_time


def test_unfused_gradient_accumulation_costs_a_pass_over_local_weights_per_micro_batch():
    """10 bytes per local weight per micro-batch: with twice the micro-batches (mbs 1 vs 2) the unfused
    executor pays the pass twice as often; Megatron's fused accumulation pays nothing."""
    model = get_model("mixtral-8x7b").with_layers(2)
    cluster = ClusterSpec(H100, 1)
    unfused = TrainingSpec(seq_length=4096, global_batch_size=8)
    fused = replace(unfused, gradient_accumulation_fusion=True)
    config = ParallelConfig(world_size=1, micro_batch_size=1)
    moe_u = layer_times(model, unfused, cluster, config)["moe"]
    moe_f = layer_times(model, fused, cluster, config)["moe"]
    experts = model.num_experts * 3 * model.expert_ffn_hidden_size * model.hidden_size
    router = model.num_experts * model.hidden_size
    rates = compute_rates(H100, "bf16")
    extra = moe_u.bwd_time - moe_f.bwd_time
    assert extra == pytest.approx(memory_time(rates, 10 * experts) + memory_time(rates, 10 * router), rel=1e-6)
    assert moe_u.fwd_time == pytest.approx(moe_f.fwd_time)


def test_measured_routing_load_paces_ep_layouts_by_their_busiest_rank():
    """Experts 0-3 get 60 % of the tokens: under EP2 rank 0 runs 1.2x the mean rank's grouped GEMMs (and
    the other rank waits for it); EP1 holds every expert and is unchanged."""
    model = get_model("mixtral-8x7b").with_layers(2)
    load = (0.15, 0.15, 0.15, 0.15, 0.1, 0.1, 0.1, 0.1)
    even = TrainingSpec(seq_length=4096, global_batch_size=8)
    skew = replace(even, moe_expert_load=load)
    cluster = ClusterSpec(H100, 2)
    ep2, ep1 = ParallelConfig(world_size=2, ep=2), ParallelConfig(world_size=2)
    grouped = dict(layer_times(model, even, cluster, ep2)["moe"].fwd)["grouped_gemm"]
    assert dict(layer_times(model, skew, cluster, ep2)["moe"].fwd)["grouped_gemm"] == pytest.approx(1.2 * grouped, rel=0.02)
    assert layer_times(model, skew, cluster, ep1)["moe"].fwd == layer_times(model, even, cluster, ep1)["moe"].fwd


def test_megatron_regathers_a_sequence_parallel_input_for_the_weight_gradient_the_executor_does_not():
    """TP2 with SP, attention block of 4096 tokens x 4096 hidden (bf16, 32 MiB gathered): the executor's backward
    runs the output-gradient all-gather and the input-gradient reduce-scatter; Megatron adds one all-gather of
    the input. The forward is the same for both."""
    from costmodel.comm import group_placement, link_rates, ring_time

    model = get_model("mixtral-8x7b").with_layers(2)
    executor = TrainingSpec(seq_length=4096, global_batch_size=8)
    megatron = replace(executor, sequence_parallel_regather=True)
    cluster, config = ClusterSpec(H100, 2), ParallelConfig(world_size=2, tp=2)
    ours, theirs = (dict(layer_times(model, t, cluster, config)["attention"].bwd)["tp_comm"]
                    for t in (executor, megatron))
    place, link = group_placement(1, 2, H100.gpus_per_node), link_rates(H100)
    gathered = 4096 * 4096 * 2
    assert ours == pytest.approx(ring_time(link, "all_gather", gathered, place)
                                 + ring_time(link, "reduce_scatter", gathered, place))
    assert theirs - ours == pytest.approx(ring_time(link, "all_gather", gathered, place))
    assert (layer_times(model, executor, cluster, config)["attention"].fwd
            == layer_times(model, megatron, cluster, config)["attention"].fwd)
    # the output layer too: its backward reduce-scatters the input gradient, Megatron's also re-gathers the input
    ours_head, theirs_head = (dict(layer_times(model, t, cluster, config)["head"].bwd)["tp_comm"]
                              for t in (executor, megatron))
    assert ours_head == pytest.approx(ring_time(link, "reduce_scatter", gathered, place))
    assert theirs_head - ours_head == pytest.approx(ring_time(link, "all_gather", gathered, place))


# ---- sinks and sliding windows: the executor's masked path against Megatron's fused kernel ---------------
def _attention_core(model, training, tp=1):
    times = layer_times(model, training, ClusterSpec(H100, tp), ParallelConfig(world_size=tp, tp=tp))["attention"]
    return dict(times.fwd)["attention_core"], dict(times.bwd)["attention_core"]


def test_window_keys_hand_worked():
    # seq 8, window 2: queries 0..7 see 1, 2, 3, 3, 3, 3, 3, 3 keys
    assert window_keys(8, 2) == pytest.approx(21 / 8)
    assert window_keys(4, 10) == pytest.approx((1 + 2 + 3 + 4) / 4)  # a window longer than the sequence


def test_fused_window_attention_costs_its_keys_executor_sink_attention_the_whole_fp32_matrix():
    plain = replace(DENSE, name="plain")
    gptoss_like = replace(DENSE, name="sinks", softmax_type="learnable", window_size=(128, 0), window_attn_skip_freq=2)
    executor = TrainingSpec(seq_length=4096, global_batch_size=8)
    megatron = replace(executor, fused_window_sink_attention=True)
    causal = _attention_core(plain, executor)
    # Megatron: half the layers full causal, half with a 128-key window (128.x of 2048.5 mean causal keys)
    share = (1 + window_keys(4096, 128) / 2048.5) / 2
    assert fused_causal_fraction(gptoss_like, 4096) == pytest.approx(share)
    fused = _attention_core(gptoss_like, megatron)
    assert fused == pytest.approx((causal[0] * share, causal[1] * share), rel=1e-12)
    # the executor: every layer has sinks, so every layer runs the explicit fp32 path (32 heads of 128)
    ours = _attention_core(gptoss_like, executor)
    assert ours == pytest.approx(sink_attention_time(compute_rates(H100, "bf16"), 4096, 4096, 32, 128), rel=1e-12)
    assert ours[0] > 20 * causal[0]
    # a plain model is priced the same under both switches
    assert _attention_core(plain, megatron) == causal


def test_window_only_layers_run_masked_sdpa_on_their_share_of_layers():
    windowed = replace(DENSE, name="window", window_size=(128, 0), window_attn_skip_freq=2)
    executor = TrainingSpec(seq_length=4096, global_batch_size=8)
    rates = compute_rates(H100, "bf16")
    causal = attention_time(rates, 4096, 4096, 32, 128, 128, True)
    full = attention_time(rates, 4096, 4096, 32, 128, 128, False)
    bias = memory_time(rates, 4096 * 4096 * 3)
    fwd, bwd = _attention_core(windowed, executor)
    assert fwd == pytest.approx(0.5 * causal[0] + 0.5 * (full[0] + bias), rel=1e-12)
    assert bwd == pytest.approx(0.5 * causal[1] + 0.5 * full[1], rel=1e-12)


def test_gpt_oss_step_time_moves_with_the_attention_switch():
    model = get_model("gpt-oss-120b")
    cluster, config = ClusterSpec(H100, 64), ParallelConfig(world_size=64, tp=2, pp=2, ep=16)
    executor = TrainingSpec(seq_length=4096, global_batch_size=512)
    megatron = replace(executor, fused_window_sink_attention=True)
    ours, theirs = (estimate_step_time(model, t, cluster, config) for t in (executor, megatron))
    assert ours.term("attention_core") > 10 * theirs.term("attention_core")
    assert ours.step_time > theirs.step_time and ours.tflops_per_gpu < theirs.tflops_per_gpu


def test_moe_layer_pattern_and_dense_first_layers_are_priced_per_stage():
    # layers: dense, MoE (with a shared expert), dense, MoE on pp4: each middle stage costs exactly its layer kind
    model = replace(get_model("tiny-moe-shared"), moe_layer_freq=(0, 1, 0, 1), moe_first_k_dense=0)
    training, cluster = TrainingSpec(seq_length=128, global_batch_size=8), ClusterSpec(H100, 8)
    config = ParallelConfig(world_size=8, pp=4, ep=2)
    parts = layer_times(model, training, cluster, config)

    def total(*names):
        return sum(v for name in names for _, v in parts[name].fwd + parts[name].bwd)

    first, moe_stage, dense_stage, last = stage_times(model, training, cluster, config)
    assert moe_stage == pytest.approx(total("attention", "moe"), rel=1e-12)
    assert dense_stage == pytest.approx(total("attention", "dense_mlp"), rel=1e-12)
    assert first == pytest.approx(total("attention", "dense_mlp", "embedding"), rel=1e-12)
    assert last == pytest.approx(total("attention", "moe", "head"), rel=1e-12)
    assert moe_stage > dense_stage  # top-2 of 8 experts + the shared expert over one dense FFN


def test_olmoe_whole_width_qk_norms_add_two_tiny_tp_all_reduces_each_way():
    """OLMoE under TP2, 4096 tokens per rank: the q and k sums of squares (fp32, 16 KiB each) are all-reduced
    forward and their gradients backward; per-head norms (Qwen3's) have no TP traffic; TP1 has none."""
    from costmodel.comm import group_placement, link_rates, ring_time

    olmoe = get_model("olmoe-1b-7b").with_layers(2)
    per_head = replace(olmoe, qk_layernorm_scope="head")
    training, cluster = TrainingSpec(seq_length=4096, global_batch_size=8), ClusterSpec(H100, 2)
    tp2 = ParallelConfig(world_size=2, tp=2)
    all_heads, one_head = (layer_times(m, training, cluster, tp2)["attention"] for m in (olmoe, per_head))
    reduce = 2 * ring_time(link_rates(H100), "all_reduce", 4096 * 4, group_placement(1, 2, H100.gpus_per_node))
    assert reduce > 0
    for phase in ("fwd", "bwd"):
        ours, theirs = (dict(getattr(t, phase))["tp_comm"] for t in (all_heads, one_head))
        assert ours - theirs == pytest.approx(reduce)
    tp1 = ParallelConfig(world_size=2, ep=2)
    assert (layer_times(olmoe, training, cluster, tp1)["attention"].fwd
            == layer_times(per_head, training, cluster, tp1)["attention"].fwd)


def test_host_factors_scale_the_host_floor_and_its_recompute_share_hand_worked():
    """A host-bound layout (small-moe, every kernel tiny): the per-micro-batch floor is base·f_host + recompute·
    f_recompute, and the once-per-step host work scales with f_host; other terms are untouched."""
    from costmodel.step_time import HOST_FACTOR, HOST_RECOMPUTE_FACTOR, host_seconds_per_micro_batch

    model = get_model("small-moe")
    training = TrainingSpec(seq_length=1024, global_batch_size=16)
    cluster = ClusterSpec(get_hardware("h200"), 2)
    config = ParallelConfig(world_size=2, recompute_granularity="full")
    base, recompute = host_seconds_per_micro_batch(model, training, cluster, config)
    assert base > 0 and recompute > 0
    plain = estimate_step_time(model, training, cluster, config)
    assert plain.bottleneck == "host-overhead"
    m = 16 // 2
    f_host, f_recompute = 2.0, 3.0
    scaled = estimate_step_time(model, training, cluster, config,
                                corrections={HOST_FACTOR: f_host, HOST_RECOMPUTE_FACTOR: f_recompute})
    # only the host floor moved: the step grows by m x the floor's growth (both floors bind: host-bound), plus
    # the once-per-step host work where it exceeds the step's reduce + optimizer
    floor_gain = m * ((base * f_host + recompute * f_recompute) - (base + recompute))
    assert scaled.step_time - plain.step_time >= floor_gain * (1 - 1e-9)
    same = {k: v for k, v in plain.terms if k != "host_overhead"}
    assert {k: v for k, v in scaled.terms if k != "host_overhead"} == same
    # the recompute factor defaults to the host factor
    only_host = estimate_step_time(model, training, cluster, config, corrections={HOST_FACTOR: f_host})
    assert only_host.step_time - plain.step_time >= m * (base + recompute) * (f_host - 1) * (1 - 1e-9)
    # a host factor next to a term factor: the term factor still applies
    both = estimate_step_time(model, training, cluster, config, corrections={HOST_FACTOR: 1.0, "gemm": 2.0})
    assert dict(both.terms)["gemm"] == pytest.approx(2 * dict(plain.terms)["gemm"])


def test_host_factors_leave_a_device_bound_layout_alone():
    model = get_model("mixtral-8x7b").with_layers(2)
    training = TrainingSpec(seq_length=4096, global_batch_size=8)
    cluster, config = ClusterSpec(H100, 2), ParallelConfig(world_size=2, ep=2)
    from costmodel.step_time import HOST_FACTOR

    assert estimate_step_time(model, training, cluster, config, corrections={HOST_FACTOR: 2.0}).step_time == \
        estimate_step_time(model, training, cluster, config).step_time


def test_fp8_casts_as_the_executor_quantises_and_as_transformer_engine_does():
    """Mixtral, one GPU, seq 4096, fp8 — bytes an element: the executor quantises a dense linear's input and output
    gradient in both forms from two reads (6; the input of Q, K and V three times, one GEMM each), the experts'
    rows rowwise (3), and every GEMM weight in both forms once a step (6); Transformer Engine casts each GEMM input
    once with a fused cast-transpose (4), weights too. The two differ by these bytes over HBM bandwidth."""
    model = get_model("mixtral-8x7b").with_layers(2)
    cluster, config = ClusterSpec(H100, 1), ParallelConfig(world_size=1)
    executor = TrainingSpec(seq_length=4096, global_batch_size=2, precision="fp8")
    te = replace(executor, transformer_engine_fp8=True)
    bw = compute_rates(H100, "fp8").hbm_bandwidth
    t, h, f, qkv, rows = 4096, 4096, 14336, (32 + 2 * 8) * 128, 4096 * 2

    def mem(training, part, phase):
        return dict(getattr(layer_times(model, training, cluster, config)[part], phase))["memory_bound"]

    # attention: Q/K/V input 3 × 6 against 4, O input 6 against 4; backward their output gradients 6 against 4
    assert mem(executor, "attention", "fwd") - mem(te, "attention", "fwd") == pytest.approx(
        (3 * 6 - 4) * t * h / bw + (6 - 4) * t * h / bw)
    assert mem(executor, "attention", "bwd") - mem(te, "attention", "bwd") == pytest.approx((6 - 4) * t * (qkv + h) / bw)
    # experts: 8192 routed rows; forward x [rows, h] and the activation [rows, f], backward dy [rows, h] and
    # d(gate, up) [rows, 2f]: 3 bytes against 4
    assert mem(executor, "moe", "fwd") - mem(te, "moe", "fwd") == pytest.approx(-rows * (h + f) / bw)
    assert mem(executor, "moe", "bwd") - mem(te, "moe", "bwd") == pytest.approx(-rows * (2 * f + h) / bw)
    # once a step: 2 layers' GEMM weights (8 experts' w1, w3, w2; Q, K, V, O) at 6 bytes against 4
    weights = 2 * (8 * 3 * h * f + h * qkv + h * h)
    m = 2  # micro-batches of the step

    def step_mem(training):
        return estimate_step_time(model, training, cluster, config).term("memory_bound")

    per_micro_batch = sum(mem(executor, p, ph) - mem(te, p, ph) for p in ("attention", "moe") for ph in ("fwd", "bwd"))
    assert step_mem(executor) - step_mem(te) == pytest.approx(m * 2 * per_micro_batch + (6 - 4) * weights / bw)
    # bf16 quantises nothing: the switch changes nothing there
    bf16 = replace(executor, precision="bf16")
    assert step_mem(bf16) == step_mem(replace(bf16, transformer_engine_fp8=True))


def test_fp8_quantises_only_the_weights_of_linears_that_run_fp8():
    """The executor quantises a weight lazily, in its linear's first fp8 call: where every linear runs bf16 (a
    calibrated profile whose fp8 dense linear and fp8 grouped GEMM are both slower than bf16's), an fp8 step
    prices exactly as the bf16 one, no weight cast left; where they all run fp8 the whole cast stays (above)."""
    from spec.proxy import proxy_model

    never = MeasuredCurve(((1.0, 0.5), (1e16, 0.5)))
    hw = replace(get_hardware("h200"), name="h200-fp8-never-pays", dense_fp8_over_bf16=never,
                 grouped_gemm_fp8_over_bf16=(("2048x768", MeasuredCurve(((1.0, 0.5), (1e6, 0.5)))),))
    cluster, config = ClusterSpec(hw, 1), ParallelConfig.parse("dp1 mbs1", world_size=1)
    for name in ("qwen3-30b-a3b", "deepseek-v2-lite"):
        model = proxy_model(get_model(name), 4)
        bf16 = TrainingSpec(seq_length=4096, global_batch_size=8)
        fp8 = replace(bf16, precision="fp8")
        assert estimate_step_time(model, fp8, cluster, config).step_time == pytest.approx(
            estimate_step_time(model, bf16, cluster, config).step_time, rel=1e-12), name


def test_fp8_expert_wgrad_runs_in_bf16_in_the_executor_and_in_fp8_under_transformer_engine():
    """Mixtral, one GPU, 8192 routed rows over 8 experts: the MoE layer's backward grouped GEMMs are the fp8
    dgrad plus the wgrad at bf16 rates in the executor, and both in fp8 with Transformer Engine."""
    model = get_model("mixtral-8x7b").with_layers(2)
    cluster, config = ClusterSpec(H100, 1), ParallelConfig(world_size=1)
    executor = TrainingSpec(seq_length=4096, global_batch_size=1, precision="fp8")
    fp8, bf16 = compute_rates(H100, "fp8"), compute_rates(H100, "bf16")
    shapes = ((8, 1024.0, 2 * 14336, 4096), (8, 1024.0, 4096, 14336))

    def bwd(training):
        return dict(layer_times(model, training, cluster, config)["moe"].bwd)["grouped_gemm"]

    assert bwd(executor) == pytest.approx(sum(grouped_gemm_fwd_bwd(fp8, *s, wgrad_rates=bf16)[1] for s in shapes))
    te = replace(executor, transformer_engine_fp8=True)
    assert bwd(te) == pytest.approx(sum(grouped_gemm_fwd_bwd(fp8, *s)[1] for s in shapes))
    assert bwd(te) < bwd(executor)


def test_fp8_expert_linears_are_priced_at_the_cheaper_of_fp8_and_bf16_as_the_executor_runs_them(monkeypatch):
    """The executor's fp8 (ExecutorOptions.fp8_expert_gemm 'fastest') runs an expert linear in bf16 where bf16
    is faster: with fp8's grouped kernels priced slower than bf16's, the MoE layer's grouped GEMMs are the bf16
    ones and no expert quantisation is priced; Transformer Engine's stay fp8, casts included."""
    from costmodel import compute, step_time

    def fresh():  # rates and contexts are cached by value: priced afresh under the patched ratio, then after it
        compute_rates.cache_clear()
        step_time._context_by_value.cache_clear()
        step_time._CONTEXTS.clear()

    model = get_model("mixtral-8x7b").with_layers(2)
    cluster, config = ClusterSpec(H100, 1), ParallelConfig(world_size=1)
    executor = TrainingSpec(seq_length=4096, global_batch_size=1, precision="fp8")
    shapes = ((8, 1024.0, 2 * 14336, 4096), (8, 1024.0, 4096, 14336))

    def moe(training):
        layer = layer_times(model, training, cluster, config)["moe"]
        return dict(layer.fwd), dict(layer.bwd)

    fresh()
    monkeypatch.setattr(compute, "GROUPED_FP8_OVER_BF16", 0.5)
    try:
        bf16 = compute_rates(H100, "bf16")
        fwd, bwd = moe(executor)
        assert fwd["grouped_gemm"] == pytest.approx(sum(grouped_gemm_fwd_bwd(bf16, *s)[0] for s in shapes))
        assert bwd["grouped_gemm"] == pytest.approx(sum(grouped_gemm_fwd_bwd(bf16, *s)[1] for s in shapes))
        te_fwd, _ = moe(replace(executor, transformer_engine_fp8=True))
        fp8 = compute_rates(H100, "fp8")
        assert te_fwd["grouped_gemm"] == pytest.approx(sum(grouped_gemm_fwd_bwd(fp8, *s)[0] for s in shapes))
        assert te_fwd["grouped_gemm"] > fwd["grouped_gemm"] and te_fwd["memory_bound"] > fwd["memory_bound"]
    finally:
        monkeypatch.undo()
        fresh()


def test_fp8_dense_linears_are_priced_at_the_cheaper_of_fp8_and_bf16_as_the_executor_runs_them():
    """The executor's fp8 dense linears (FOLDTUNE_FP8_DENSE 'fastest', the default) run in bf16 where bf16 times
    no slower. tiny-moe's 64-wide projections: fp8's activation quantisation costs more than its faster GEMMs
    save, so the attention block of an fp8 step is priced as bf16's, to the second, with no casts, while
    Transformer Engine's (always fp8) pays them. Mixtral's 4096-wide projections at seq 4096: fp8 wins, so
    the executor's attention GEMMs are Transformer Engine's fp8 ones, below bf16's."""
    cluster, config = ClusterSpec(H100, 1), ParallelConfig(world_size=1)

    def attention(name, precision, te=False):
        training = TrainingSpec(seq_length=4096, global_batch_size=1, precision=precision,
                                transformer_engine_fp8=te)
        block = layer_times(get_model(name).with_layers(2), training, cluster, config)["attention"]
        fwd, bwd = dict(block.fwd), dict(block.bwd)
        return {term: fwd.get(term, 0.0) + bwd.get(term, 0.0) for term in ("gemm", "memory_bound")}

    tiny_bf16, tiny_fp8, tiny_te = (attention("tiny-moe", p, te) for p, te in
                                    (("bf16", False), ("fp8", False), ("fp8", True)))
    assert tiny_fp8 == pytest.approx(tiny_bf16)
    assert tiny_te["memory_bound"] > tiny_fp8["memory_bound"]
    wide_bf16, wide_fp8, wide_te = (attention("mixtral-8x7b", p, te) for p, te in
                                    (("bf16", False), ("fp8", False), ("fp8", True)))
    assert wide_fp8["gemm"] == pytest.approx(wide_te["gemm"]) and wide_fp8["gemm"] < 0.7 * wide_bf16["gemm"]
    assert wide_fp8["memory_bound"] > wide_bf16["memory_bound"]  # its casts are priced


def test_the_cost_model_refuses_what_the_seq_cp_rule_refuses():
    """seq_length 10 splits over cp 2 into 5 tokens, but not into the 2·cp chunks of the load-balanced split."""
    training = TrainingSpec(seq_length=10, global_batch_size=16)
    config = ParallelConfig(world_size=8, cp=2)
    assert [r.rule for r in check(get_model("tiny-moe"), training, config)] == ["seq_cp", "executor_seq_cp"]
    assert estimate_step_time(get_model("tiny-moe"), replace(training, seq_length=16), ClusterSpec(
        get_hardware("h100-sxm"), 8), config).step_time > 0
    with pytest.raises(InvalidConfigError, match=r"\[seq_cp\]"):
        estimate_step_time(get_model("tiny-moe"), training, ClusterSpec(get_hardware("h100-sxm"), 8), config)
    assert "seq_cp" in COSTMODEL_RULES
