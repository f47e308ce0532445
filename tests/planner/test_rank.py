"""Ranking: memory pruning, exact top-N order, Pareto front, nothing-fits, against brute force on stand-in models.

The stand-in models (tests/planner/fakes.py) are closed forms with the monotone properties the ranker
relies on, so brute force over every valid config is the ground truth for counts and order. They price no host
time, so CUDA graphs would only add twins of equal time (not executable on 16 ranks): the exact-order tests
search without them.
"""

from __future__ import annotations

import itertools
import random
from functools import partial

import pytest

from spec.catalog import get_hardware, get_model
from spec.errors import InvalidConfigError
from spec.hardware import ClusterSpec
from spec.training_spec import TrainingSpec
from planner.enumerate import SearchSpace, enumerate_layouts
from planner.rank import NoValidLayoutError, _staircase, explain_layout, pareto_front, plan
from tests.planner.fakes import GIB, fake_memory, fake_time

SMALL = get_model("small-moe")  # 4 layers, 8 heads / 4 KV groups, 8 experts
H100 = get_hardware("h100-sxm")
TRAIN = TrainingSpec(seq_length=256, global_batch_size=64)


def brute(model, training, cluster, space, memory_fn, time_fn):
    enum = enumerate_layouts(model, training, cluster, space)
    rows = []
    for cfg in enum.configs():
        total = memory_fn(model, training, cluster, cfg).total
        if total <= cluster.usable_hbm_bytes:
            rows.append((time_fn(model, training, cluster, cfg).step_time, total, cfg))
    return enum, rows


@pytest.mark.parametrize("weight_gib", [8.0, 60.0, 120.0])
def test_counts_and_top_order_match_brute_force(weight_gib):
    cluster = ClusterSpec(H100, 16)
    space = SearchSpace(mbs_max=4, vpp_max=2, cuda_graphs=False)
    mem = partial(fake_memory, weight_gib=weight_gib, act_gib=40.0)
    enum, rows = brute(SMALL, TRAIN, cluster, space, mem, fake_time)
    result = plan(SMALL, TRAIN, cluster, top=15, space=space, memory_fn=mem, time_fn=fake_time, workers=1)
    assert result.fitting == len(rows)
    assert result.pruned_by_memory == enum.valid - len(rows)
    assert 0 < len(rows) < enum.valid  # the cases prune some but not all
    expected = sorted(t for t, _, _ in rows)[:15]
    assert [e.time.step_time for e in result.ranked] == pytest.approx(expected)
    assert all(e.fits for e in result.ranked)
    assert result.order_violations == 0 and result.bound_violations == 0
    # far fewer evaluations than configs: the point of the staircase and the lazy siblings
    assert result.memory_calls < enum.valid / 3 and result.time_calls < enum.valid / 3


def test_parallel_workers_give_the_same_answer():
    cluster = ClusterSpec(H100, 16)
    space = SearchSpace(mbs_max=4, vpp_max=2)
    mem = partial(fake_memory, weight_gib=60.0, act_gib=40.0)
    one = plan(SMALL, TRAIN, cluster, top=10, space=space, memory_fn=mem, time_fn=fake_time, workers=1)
    two = plan(SMALL, TRAIN, cluster, top=10, space=space, memory_fn=mem, time_fn=fake_time, workers=2)
    assert [e.config for e in one.ranked] == [e.config for e in two.ranked]
    assert (one.fitting, one.bound_calls) == (two.fitting, two.bound_calls)
    # each slice ranks its own top N, so a split costs a few more time estimates, never fewer
    assert one.time_calls <= two.time_calls
    assert abs(one.memory_calls - two.memory_calls) <= 0.05 * one.memory_calls


def test_exhaustive_mode_and_pareto_front():
    cluster = ClusterSpec(H100, 8)
    space = SearchSpace(mbs_max=2, vpp_max=1, cuda_graphs=False)
    mem = partial(fake_memory, weight_gib=40.0, act_gib=40.0)
    enum, rows = brute(SMALL, TRAIN, cluster, space, mem, fake_time)
    assert 0 < len(rows) < enum.valid
    result = plan(SMALL, TRAIN, cluster, top=5, exhaustive=True, space=space, memory_fn=mem, time_fn=fake_time,
                  workers=1)
    assert result.time_calls == len(rows)
    front = result.pareto
    assert front and front[0].time.step_time == pytest.approx(min(t for t, _, _ in rows))
    # nobody dominates a front member; every non-member is dominated by some member
    for e in front:
        t, m = e.time.step_time, e.memory.total
        assert not any(t2 <= t and m2 <= m and (t2, m2) != (t, m) for t2, m2, _ in rows)
    members = {e.config for e in front}
    for t, m, cfg in rows:
        if cfg not in members:
            assert any(e.time.step_time <= t and e.memory.total <= m for e in front)
    assert [e.time.step_time for e in result.ranked] == pytest.approx(sorted(t for t, _, _ in rows)[:5])


def test_pareto_front_helper():
    pts = [(1.0, 9.0, "a"), (2.0, 5.0, "b"), (2.5, 6.0, "x"), (3.0, 1.0, "c"), (3.0, 2.0, "y"), (0.5, 20.0, "d")]
    assert pareto_front(pts) == ["d", "a", "b", "c"]


def test_nothing_fits_reports_the_closest():
    cluster = ClusterSpec(H100, 8)
    mem = partial(fake_memory, weight_gib=1e6)
    result = plan(SMALL, TRAIN, cluster, top=5, space=SearchSpace(mbs_max=2, vpp_max=1), memory_fn=mem,
                  time_fn=fake_time, workers=1)
    assert result.ranked == [] and result.fitting == 0 and result.best is None
    assert result.closest is not None and not result.closest.fits
    assert result.closest.limiter == "memory" and "GiB usable" in result.closest.explanation
    # the closest is the least memory any layout needs: most model parallelism, full recompute, mbs 1
    c = result.closest.config
    assert c.tp * c.pp * c.ep * c.etp == max(lay.tp * lay.pp * lay.ep * lay.etp
                                             for lay in enumerate_layouts(SMALL, TRAIN, cluster).layouts)


def test_no_valid_layout_is_one_clear_error():
    # seq 2 allows no CP, 8 heads at most TP 8, 4 layers at most PP 4: dp >= 2 on 64 GPUs never divides 3
    with pytest.raises(NoValidLayoutError, match="no valid layout of small-moe on 64 GPUs.*gbs_mbs_dp"):
        plan(SMALL, TrainingSpec(seq_length=2, global_batch_size=3), ClusterSpec(H100, 64),
             memory_fn=fake_memory, time_fn=fake_time)


def test_order_violations_are_counted_when_recompute_makes_things_faster():
    def backwards_time(model, training, cluster, c):
        t = fake_time(model, training, cluster, c)
        faster = {"none": 0.0, "selective": -0.3, "full": -0.6}[c.recompute_granularity]
        return type(t)(step_time=t.step_time + faster, terms=t.terms, bottleneck=t.bottleneck)

    result = plan(SMALL, TRAIN, ClusterSpec(H100, 8), top=20, space=SearchSpace(mbs_max=2, vpp_max=1),
                  memory_fn=fake_memory, time_fn=backwards_time, workers=1)
    assert result.order_violations > 0
    times = [e.time.step_time for e in result.ranked]
    assert times == sorted(times)


def test_staircase_matches_brute_force_on_random_monotone_grids():
    rng = random.Random(7)
    for _ in range(300):
        n_mbs, n_rec = rng.randint(1, 5), rng.randint(1, 4)
        # boundary: least fitting level per k, non-decreasing in k (n_rec = nothing fits)
        bounds = sorted(rng.randint(0, n_rec) for _ in range(n_mbs))
        calls = []

        def fits(k, r, bounds=bounds, calls=calls):
            calls.append((k, r))
            return r >= bounds[k]

        floors = [min(b, rng.randint(0, n_rec - 1)) if b < n_rec else rng.choice([None, 0]) for b in bounds]
        # floors must be lower bounds and None only where nothing fits; the fitting ks must be a prefix
        first_dead = next((k for k, f in enumerate(floors) if f is None), n_mbs)
        floors = [None if k >= first_dead else f for k, f in enumerate(floors)]
        guess = rng.choice([None, bounds[:], [rng.choice([None, 0, 1, 2, 3]) for _ in range(n_mbs)],
                            [None] * n_mbs, floors[:]])
        guess = None if guess is None else [g if g is None or g < n_rec else None for g in guess]
        got = _staircase(fits, n_mbs, n_rec, floors, guess)
        want = [None if (floors[k] is None or bounds[k] >= n_rec) else max(bounds[k], floors[k]) for k in range(n_mbs)]
        assert got == want, (bounds, floors)
        assert len(calls) <= 2 * n_mbs + 2 * n_rec + 2


def test_explain_layout_verdicts():
    cluster = ClusterSpec(H100, 16)
    ok = explain_layout(SMALL, TRAIN, cluster, "tp2 pp2 ep4 mbs2", memory_fn=fake_memory, time_fn=fake_time)
    assert ok.valid and ok.estimate is not None and ok.estimate.config.dp == 4
    assert ok.estimate.memory_headroom_bytes == pytest.approx(cluster.usable_hbm_bytes - ok.estimate.memory.total)
    bad = explain_layout(SMALL, TRAIN, cluster, "tp16 pp1 ep16", memory_fn=fake_memory, time_fn=fake_time)
    assert not bad.valid and {r.rule for r in bad.rejections} == {"heads_tp", "experts_ep"}
    assert bad.estimate is None
    off = explain_layout(SMALL, TRAIN, cluster, "tp3", memory_fn=fake_memory, time_fn=fake_time)
    assert off.config is None and [r.rule for r in off.rejections] == ["world_dense", "heads_tp"]
    assert "3·1·1 = 3 does not divide the world size 16" in off.rejections[0].reason
    off = explain_layout(SMALL, TRAIN, cluster, "ep3 etp1", memory_fn=fake_memory, time_fn=fake_time)
    assert off.config is None and [r.rule for r in off.rejections][0] == "world_expert"


def test_explain_layout_follows_the_optimizer_choice_and_rejects_garbage():
    cluster = ClusterSpec(H100, 16)
    plain = TrainingSpec(seq_length=256, global_batch_size=64, distributed_optimizer=False)
    v = explain_layout(SMALL, plain, cluster, "tp2 pp2 ep4 mbs1", memory_fn=fake_memory, time_fn=fake_time)
    assert v.config.use_distributed_optimizer is False and v.config.overlap_param_gather is False
    assert (v.config.tp, v.config.pp, v.config.ep, v.config.dp) == (2, 2, 4, 4)
    named = explain_layout(SMALL, plain, cluster, "tp2 pp2 ep4 mbs1 distopt=on", memory_fn=fake_memory,
                           time_fn=fake_time)
    assert named.config.use_distributed_optimizer is True  # the label's own choice wins
    with pytest.raises(InvalidConfigError, match="cannot parse layout token 'banana'"):
        explain_layout(SMALL, TRAIN, cluster, "tp2 banana")
    with pytest.raises(InvalidConfigError, match="dp=3 contradicts"):
        explain_layout(SMALL, TRAIN, cluster, "tp2 dp3")


def test_headroom_limiter_and_explanations_from_breakdowns():
    from costmodel.estimate import combine
    from tests.planner.fakes import FakeMemory, FakeTime

    cluster = ClusterSpec(H100, 16)
    cfg = next(iter(enumerate_layouts(SMALL, TRAIN, cluster).configs())).replace(ep=8, etp=1)
    usable = cluster.usable_hbm_bytes
    tight = FakeMemory(0, weights=0.97 * usable, grads=0, optimizer=0, activations=0)
    t = FakeTime(step_time=2.0, terms=(("gemm", 1.0), ("ep_a2a", 0.62)), bottleneck="all-to-all")
    est = combine(cfg, TRAIN, cluster, tight, t)
    assert est.fits and est.limiter == "memory" and "headroom" in est.explanation
    roomy = FakeMemory(0, weights=0.5 * usable, grads=0, optimizer=0, activations=0)
    est = combine(cfg, TRAIN, cluster, roomy, t)
    assert est.limiter == "all-to-all"
    assert est.explanation.startswith("all-to-all 31% of step: EP8 group")
    wide = cfg.replace(ep=16)
    assert "EP16 group spans 2 nodes" in combine(wide, TRAIN, cluster, roomy, t).explanation


def test_memory_fits_and_time_are_called_with_fast_built_configs_equal_to_real_ones():
    """The ConfigMaker shortcut must produce configs equal to (and hashing like) validated constructions."""
    from spec.parallel_config import ParallelConfig

    seen = []

    def spy(model, training, cluster, c):
        seen.append(c)
        return fake_memory(model, training, cluster, c)

    plan(SMALL, TRAIN, ClusterSpec(H100, 8), top=3, space=SearchSpace(mbs_max=2, vpp_max=1), memory_fn=spy,
         time_fn=fake_time, workers=1)
    for c in itertools.islice(seen, 0, None, 7):
        rebuilt = ParallelConfig(**c.to_dict())
        assert rebuilt == c and hash(rebuilt) == hash(c)
    assert fake_memory(SMALL, TRAIN, ClusterSpec(H100, 8), seen[0]).total > 0 and GIB > 0


@pytest.mark.parametrize("name,gpus,gbs", [("small-moe", 16, 64), ("mixtral-8x7b", 16, 32)])
def test_real_cost_models_keep_the_monotone_properties_the_ranker_uses(name, gpus, gbs):
    """On the real memory and time models: fitting counts equal brute force, top-10 equals the exhaustive ranking."""
    from costmodel.memory import peak_memory_bytes

    model = get_model(name)
    training = TrainingSpec(seq_length=1024, global_batch_size=gbs)
    cluster = ClusterSpec(H100, gpus)
    space = SearchSpace(mbs_max=2, vpp_max=2)
    enum = enumerate_layouts(model, training, cluster, space)
    fitting = sum(1 for c in enum.configs() if peak_memory_bytes(model, training, cluster, c) <= cluster.usable_hbm_bytes)
    lazy = plan(model, training, cluster, top=10, space=space, workers=1, rank_by="point")
    full = plan(model, training, cluster, top=10, space=space, exhaustive=True, workers=1, rank_by="point")
    assert lazy.fitting == full.fitting == fitting
    assert 0 < fitting
    assert lazy.order_violations == 0 and lazy.bound_violations == 0
    assert lazy.time_calls < full.time_calls / 3
    assert [e.time.step_time for e in lazy.ranked] == pytest.approx([e.time.step_time for e in full.ranked])
    assert full.pareto and full.pareto[0].time.step_time == pytest.approx(full.ranked[0].time.step_time)


def test_robust_rank_past_the_top_n_equals_the_exhaustive_robust_ranking(monkeypatch):
    """Ranked by the intervals' pessimistic ends, the best-first queue that keeps picking until no remaining
    candidate can rank better finds the exhaustive ranking's top 10 (uncapped here), and its list is ordered by
    rank time; the default cap stops earlier and says so."""
    import planner.rank as rank

    model = get_model("small-moe")
    training = TrainingSpec(seq_length=1024, global_batch_size=64)
    cluster = ClusterSpec(H100, 16)
    # a space small enough for the exhaustive ranking to be cheap, large enough that the capped queue stops early
    space = SearchSpace(mbs_max=2, vpp_max=1)
    full = plan(model, training, cluster, top=10, space=space, exhaustive=True, workers=1)
    monkeypatch.setattr(rank, "ROBUST_MIN_SHORTLIST", 0)  # a shortlist of 10 x top
    capped = plan(model, training, cluster, top=10, space=space, workers=1)
    assert capped.robust_shortlist == 100
    monkeypatch.setattr(rank, "ROBUST_SHORTLIST", 10**6)
    exact = plan(model, training, cluster, top=10, space=space, workers=1)
    keys = [e.rank_time for e in exact.ranked]
    assert exact.rank_by == "robust" and exact.robust_exact
    assert keys == sorted(keys) == pytest.approx([e.rank_time for e in full.ranked])
    assert all(e.rank_time == e.interval.step_time.high >= e.time.step_time for e in exact.ranked)
    assert not capped.robust_exact and capped.time_calls < exact.time_calls
    assert [e.rank_time for e in capped.ranked] == sorted(e.rank_time for e in capped.ranked)
    point = plan(model, training, cluster, top=10, space=space, workers=1, rank_by="point")
    assert [e.time.step_time for e in point.ranked] == sorted(e.time.step_time for e in point.ranked)
    assert keys != [e.rank_time for e in point.ranked]  # the two orders differ on this cluster


@pytest.mark.parametrize("rank_by", ["robust", "point"])
def test_the_ranking_does_not_depend_on_the_worker_count_or_on_how_many_are_asked_for(rank_by):
    """The scan split over processes (each slice with its own queue) ranks as the one process does, and the best
    3 are the first 3 of the best 10 — also where the robust shortlist cuts the queue (DeepSeek-V3 on 1,024
    H100s: intervals ~3x the point estimate; once, a split scan's slices each kept their own shortlist, so the
    answer changed with the number of cores and the best 3 missed the best 10's first). A quarter of that
    cluster still has tens of thousands of fitting layouts, so the robust shortlist still cuts the queue."""
    model = get_model("deepseek-v3")
    training = TrainingSpec(seq_length=4096, global_batch_size=2048)
    cluster = ClusterSpec(H100, 256)
    space = SearchSpace(mbs_max=1, vpp_max=2)
    one = plan(model, training, cluster, top=10, space=space, workers=1, rank_by=rank_by, megatron=True)
    two = plan(model, training, cluster, top=10, space=space, workers=2, rank_by=rank_by, megatron=True)
    three = plan(model, training, cluster, top=3, space=space, workers=2, rank_by=rank_by, megatron=True)
    assert two.workers == 2 and one.workers == 1
    labels = [e.config.label() for e in one.ranked]
    assert labels == [e.config.label() for e in two.ranked]
    assert [e.config.label() for e in three.ranked] == labels[:3]
    assert one.robust_exact == two.robust_exact
    assert not one.robust_exact or rank_by == "point"  # the shortlist did cut the robust queue
