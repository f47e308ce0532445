"""EP all-to-all overlap (executor/ep_overlap.py) on 2 gloo processes: the overlapped step equals the
single-process reference and the in-line run, and really issues each micro-batch's all-to-alls
asynchronously under another micro-batch's compute."""

from __future__ import annotations

import dataclasses
import functools
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from executor import ep_overlap
from executor.ep_overlap import Exchange
from executor.launch_local import launch
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.pipeline import run_schedule
from executor.verify import compare, layout_worker, reference
from spec.catalog import get_model
from spec.dispatchers import EXECUTOR_DISPATCHERS
from spec.errors import InvalidConfigError, SpecError
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from spec.validity import check, executor_layout_rules
from tests.executor.test_equivalence import SCENARIOS

OVERLAP = {"overlap_moe_expert_parallel_comm": True}
# (layout, world, scenario, extra ParallelConfig fields): 2 micro-batches per rank unless the scenario has 8
# sequences (4 each: F₁‖B₀, F₂‖B₁, F₃‖B₂)
RUNS = [
    ("ep2", 2, "base", {}),
    ("ep2", 2, "shared", {}),  # first layer dense, shared experts
    ("ep2", 2, "capacity_position", {}),  # dropping: the dispatch sizes its buffers on the host
    ("ep2", 2, "gptoss", {}),  # biased experts, windows, sinks
    ("ep2", 2, "mtp", {}),  # MTP's MoE layer runs in line inside the last segment; embedding used twice
    ("ep2", 2, "tied", {}),
    ("ep2", 2, "base8", {}),
    ("ep2", 2, "sigmoid_bias", {}),  # expert bias updated from the step's counts, per-sequence aux loss, mbs 2
    ("ep2", 2, "base", {"use_distributed_optimizer": False, "overlap_grad_reduce": False,
                       "overlap_param_gather": False}),
    ("ep2", 2, "shared", {"recompute_granularity": "selective",
                          "recompute_modules": ("core_attn", "moe_act", "layernorm", "shared_experts")}),
    ("tp2 ep2 etp1", 2, "shared", {}),  # TP·SP attention, the experts' tokens over EP
]


# 4 ranks: the ETP all-gather / reduce-scatter run in line inside the experts' segments
RUNS_4 = [("etp2 ep2", 4, "shared", {}), ("etp2 ep2", 4, "gptoss", {})]


@functools.cache
def _reference(scenario: str) -> dict:
    return reference(ParallelConfig(world_size=1), SCENARIOS[scenario])


@pytest.mark.slow
@pytest.mark.parametrize("world,layouts", [(2, RUNS), (4, RUNS_4)], ids=["2ranks", "4ranks"])
def test_overlapped_step_equals_reference_and_inline_run(world, layouts):
    runs = []
    for label, _, scenario, extra in layouts:
        config = ParallelConfig.parse(label, world_size=world).replace(**extra)
        assert not executor_layout_rules(SCENARIOS[scenario].model, config.replace(**OVERLAP), 16)
        runs += [(config.replace(**OVERLAP), SCENARIOS[scenario]), (config, SCENARIOS[scenario])]
    references = [_reference(scenario) for _, _, scenario, _ in layouts]  # before the fork
    launched = launch(layout_worker, world, (runs,), backend="gloo", timeout_s=600, start_method="fork")
    assert launched.ok, launched.failure_reason
    results = launched.results[0]["results"]
    failures = {}
    for i, (label, _, scenario, extra) in enumerate(layouts):
        overlapped, inline = results[2 * i], results[2 * i + 1]
        name = f"{label}/{scenario}/{extra}"
        problems = compare(references[i], overlapped) + compare(inline, overlapped, rtol=1e-5, atol=1e-7)
        if problems:
            failures[name] = problems[:6]
    assert not failures, failures


def _host_reads(trace: list):
    """Patches that log every read of a tensor's values to the host (``tolist``, ``item``, ``int``) made
    from executor code, as ('host_read', file) in ``trace``, and a function that undoes them."""
    plain = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__int__")}

    def logging(name):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "/executor/" in caller:
                trace.append(("host_read", caller[caller.rindex("/executor/") + 1:]))
            return plain[name](self, *args, **kwargs)
        return read

    for name in plain:
        setattr(torch.Tensor, name, logging(name))
    return lambda: [setattr(torch.Tensor, name, f) for name, f in plain.items()]


def _trace_worker(rank: int, world: int, overlap: bool, host_reads: bool = False, switched_off: bool = False):
    import torch.distributed as dist

    from executor.data import global_batch, micro_batches
    from executor.model import MoEGPT
    from executor.parallel.groups import Group, build_parallel_state
    from executor.train_step import Trainer

    model_spec = get_model("tiny-moe-shared")  # 4 layers: dense, then 3 MoE
    config = ParallelConfig(world_size=2, ep=2, overlap_moe_expert_parallel_comm=overlap)
    state = build_parallel_state(config, rank)
    trainer = Trainer(MoEGPT(model_spec, state, SCENARIOS["base"].options, 16))
    trace: list = []
    trainer.ep_overlap_trace = trace
    if switched_off:  # the overlap's layout, its schedule switched off for this step (bench/ep_overlap_paired.py)
        trainer.ep_overlap = False
    plain = dist.all_to_all_single

    def logged(*args, **kwargs):  # every all-to-all, and whether it returned before finishing
        trace.append(("all_to_all", bool(kwargs.get("async_op", False))))
        return plain(*args, **kwargs)

    dist.all_to_all_single = logged
    undo = _host_reads(trace) if host_reads else (lambda: None)
    try:
        micro = micro_batches(global_batch(model_spec.vocab_size, 16, 12, 0, 0), 2, rank, 1)  # 6 per rank (dp2)
        result = trainer.step(micro)
    finally:
        dist.all_to_all_single = plain
        undo()
    return {"trace": trace, "loss": result.loss}


def _hidden_exchanges(trace: list) -> tuple[int, int]:
    """(exchanges started asynchronously and waited for only after another micro-batch's compute,
    all exchanges). A deferred exchange (a dispatch, its sizes read after the partner's compute is queued)
    counts from its 'defer' event: on CUDA it starts at that point of the stream (the event it waits for)."""
    hidden = total = 0
    for i, event in enumerate(trace):
        if event[0] != "start":
            continue
        total += 1
        owner = event[1].split("/")[0]
        asynchronous = trace[i + 1] == ("all_to_all", True)
        origin = next((k for k in range(i - 1, -1, -1) if trace[k] == ("defer", event[1])), i)
        j, others = origin + 1, 0
        while trace[j] != ("wait", event[1]):
            if trace[j][0] == "compute" and trace[j][1] != owner:
                others += 1
            j += 1
        hidden += asynchronous and others > 0
    return hidden, total


@pytest.mark.slow
def test_overlap_issues_each_all_to_all_under_another_micro_batch():
    _reference("base")  # warm torch before the fork
    launched = launch(_trace_worker, 2, (True,), backend="gloo", timeout_s=300, start_method="fork")
    assert launched.ok, launched.failure_reason
    inline = launch(_trace_worker, 2, (False,), backend="gloo", timeout_s=300, start_method="fork")
    assert inline.ok, inline.failure_reason
    for got, plain in zip(launched.results, inline.results):
        trace = got["trace"]
        # 6 micro-batches × 3 MoE layers × 2 exchanges (dispatch, combine), forward and backward
        hidden, total = _hidden_exchanges(trace)
        assert total == 6 * 3 * 2 * 2
        # all but the first forward's and the last backward's: 5 pairs F_{i+1} ‖ B_i of 6 + 6 exchanges
        assert hidden == 5 * 12
        # the first exchange under another micro-batch: the backward of micro-batch 0's last MoE layer's
        # combine, started before the forward of micro-batch 1 computes its first layers
        first = next(i for i, e in enumerate(trace) if e == ("start", "B0/F0/L3/combine"))
        assert trace[first + 2] == ("compute", "F1")
        assert not any(e == ("all_to_all", True) for e in plain["trace"])  # the in-line run: all blocking
        assert got["loss"] == pytest.approx(plain["loss"], rel=1e-5)


@pytest.mark.slow
def test_the_overlap_switched_off_between_steps_runs_the_inline_schedule():
    """Trainer.ep_overlap off on a layout built with the overlap: every all-to-all blocking, no exchange
    started under another micro-batch, and the step's loss that of a layout without the overlap."""
    _reference("base")
    switched = launch(_trace_worker, 2, (True, False, True), backend="gloo", timeout_s=300, start_method="fork")
    assert switched.ok, switched.failure_reason
    inline = launch(_trace_worker, 2, (False,), backend="gloo", timeout_s=300, start_method="fork")
    assert inline.ok, inline.failure_reason
    for got, plain in zip(switched.results, inline.results):
        assert got["trace"] and not any(e[0] == "start" or e == ("all_to_all", True) for e in got["trace"])
        assert got["trace"] == plain["trace"]
        assert got["loss"] == plain["loss"]


@pytest.mark.slow
def test_no_host_read_while_an_exchange_is_in_flight():
    """Issue 19: a host read of the routing's split sizes inside the other micro-batch's compute blocks the
    host until the GPU has drained everything queued, the exchange in flight included, and leaves the GPU
    idle until the host has queued the next exchange and compute. Each forward dispatch defers its sizes;
    the driver reads them once, after queuing the partner's compute, and never between an exchange's start
    and its wait."""
    launched = launch(_trace_worker, 2, (True, True), backend="gloo", timeout_s=300, start_method="fork")
    assert launched.ok, launched.failure_reason
    for got in launched.results:
        trace = got["trace"]
        in_flight: set = set()
        for event in trace:
            if event[0] == "start":
                in_flight.add(event[1])
            elif event[0] == "wait":
                in_flight.discard(event[1])
            elif event[0] == "host_read":
                assert not in_flight, (event, in_flight)
        # the sizes of every forward dispatch (6 micro-batches × 3 MoE layers) are read once, where the
        # driver starts it, and nowhere else in the executor during the micro-batches' exchanges
        deferred = [e[1] for e in trace if e[0] == "defer"]
        assert len(deferred) == len(set(deferred)) == 6 * 3
        assert all(tag.endswith("/dispatch") and tag.startswith("F") for tag in deferred)
        for i, event in enumerate(trace):
            if event[0] == "sizes":
                assert trace[i + 1] == ("host_read", "executor/host_copy.py")
                assert trace[i + 2] == ("start", event[1])
        reads = [e for e in trace if e[0] == "host_read"]
        assert reads.count(("host_read", "executor/host_copy.py")) == 6 * 3
        # paired forwards (F1..F5): the partner's compute (B_{i-1}) is queued between the end of the
        # dispatch's segment and the read of its sizes
        for tag in deferred:
            micro = int(tag.split("/")[0][1:])
            if micro == 0:
                continue
            begin = trace.index(("defer", tag))
            end = trace.index(("sizes", tag))
            assert ("compute", f"B{micro - 1}") in trace[begin:end], tag


def test_validity_rule_names_what_the_overlap_is_not_built_with():
    model = get_model("tiny-moe")
    ok = ParallelConfig(world_size=4, ep=2, overlap_moe_expert_parallel_comm=True)
    for built in (ok, dataclasses.replace(ok, pp=2, vpp=2), dataclasses.replace(ok, pp=2)):  # any pipeline
        assert not [r for r in executor_layout_rules(model, built, 16) if r.rule == "executor_ep_overlap"]
    for fields, words in (({"pp": 2, "vpp": 2, "recompute_granularity": "full"}, "full recompute"),
                          ({"recompute_granularity": "full"}, "full recompute"),
                          ({"recompute_granularity": "selective", "recompute_modules": ("moe",)}, "moe"),
                          ({"activation_offload_modules": ("moe",)}, "offload of moe")):
        config = dataclasses.replace(ok, **fields)
        found = [r for r in executor_layout_rules(model, config, 16) if r.rule == "executor_ep_overlap"]
        assert found and words in found[0].reason, fields
    plain = dataclasses.replace(ok, recompute_granularity="full", overlap_moe_expert_parallel_comm=False)
    assert not [r for r in executor_layout_rules(model, plain, 16) if r.rule == "executor_ep_overlap"]
    # the rule book, not the executor, keeps pp > 1 without interleaving off: Megatron's rule (its combined
    # 1F1B runs in the interleaved schedule only)
    deep, training = get_model("tiny-moe-shared"), TrainingSpec(seq_length=16, global_batch_size=8)  # 4 layers
    assert {r.rule for r in check(deep, training, dataclasses.replace(ok, pp=2))} == {"ep_overlap"}
    assert not check(deep, training, dataclasses.replace(ok, pp=2, vpp=2))


@pytest.mark.parametrize("dispatcher", EXECUTOR_DISPATCHERS)
def test_staged_forward_without_ep_equals_the_model_forward(dispatcher):
    """One process, ep = 1: no exchange; the staged path must still compute the model's loss and gradients,
    through the stages of every dispatcher's contract (allgather's too, whose layers it runs in line)."""
    spec = get_model("tiny-moe-shared")
    state = build_parallel_state(ParallelConfig(world_size=1, moe_token_dispatcher_type=dispatcher), 0)
    torch.manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (3, 1, 16))
    micro = [(ids[i], torch.roll(ids[i], -1, 1)) for i in range(3)]
    model = MoEGPT(spec, state, SCENARIOS["base"].options, 16)
    # the staged layer calls a MoE layer's parts, not its forward: the pre-hooks (where the distributed
    # optimizer waits for overlapped parameter gathers) must still run once per micro-batch
    called = []
    for layer in model.layers:
        if layer.is_moe:
            for module in (layer, layer.mlp):
                module.register_forward_pre_hook(lambda m, args: called.append(m))
    stats, counts = run_schedule(model, micro, overlap=True)
    assert len(called) == 3 * 2 * 3  # 3 MoE layers, 2 modules each, 3 micro-batches
    staged = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref_stats = torch.zeros(3)
    for x, y in micro:
        out = model(x, y)
        (out.loss / 3).backward()
        ref_stats += out.stats() / 3
    torch.testing.assert_close(stats, ref_stats)
    for n, p in model.named_parameters():
        torch.testing.assert_close(staged[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_only_the_overlapped_ep_group_asks_for_a_high_priority_stream():
    from executor.parallel.groups import GROUP_NAMES, high_priority_stream

    on = ParallelConfig(world_size=4, ep=2, overlap_moe_expert_parallel_comm=True)
    assert high_priority_stream("ep", on)
    assert not [name for name in GROUP_NAMES if name != "ep" and high_priority_stream(name, on)]
    assert not high_priority_stream("ep", on.replace(overlap_moe_expert_parallel_comm=False))  # the baseline


class _Carveout:
    """Stands in for torch's SM carveout setting: records every set, and what the compute saw."""

    def __init__(self, monkeypatch, initial):
        self.value, self.sets = initial, []
        monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental", lambda: self.value)
        monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", self.set)

    def set(self, value):
        self.sets.append(value)
        self.value = value


def _stream(name: str, exchanges: int, seen: list, carveout: _Carveout, deferred: bool = False, fail_at=None):
    """A micro-batch stream of ``exchanges`` exchanges over a group of one (the exchange returns its input);
    each compute segment logs (name, the carveout set while it runs)."""
    group = SimpleNamespace(size=1)
    for k in range(exchanges + 1):
        seen.append((name, carveout.value))
        if k == fail_at:
            raise RuntimeError("compute failed")
        if k == exchanges:
            return
        x = torch.zeros(2)
        if deferred:
            yield Exchange(x, None, None, group, f"{name}/{k}", sizes=lambda: ([2], [2]))
        else:
            yield Exchange(x, [2], [2], group, f"{name}/{k}")


@pytest.mark.parametrize("deferred", [False, True], ids=["known_sizes", "deferred_sizes"])
def test_sm_carveout_is_set_only_beside_an_exchange_and_restored(monkeypatch, deferred):
    carveout = _Carveout(monkeypatch, initial=4)  # a setting made before the step is given back
    monkeypatch.setattr(ep_overlap, "_carveout_applies", lambda x: True)  # as on a GPU
    seen: list = []
    driver = ep_overlap.Overlap(sm_carveout=16)
    driver.alone(_stream("F0", 2, seen, carveout), "F0")
    assert seen == [("F0", 4)] * 3 and carveout.sets == []  # unpaired: nothing to leave SMs for
    seen.clear()
    driver.together(_stream("B0", 2, seen, carveout), "B0", _stream("F1", 3, seen, carveout, deferred), "F1")
    # B0's first segment runs before any exchange; then each compute runs beside the other's exchange;
    # once B0 has ended, F1's last segments run alone
    assert seen == [("B0", 4), ("F1", 16), ("B0", 16), ("F1", 16), ("B0", 16), ("F1", 4), ("F1", 4)]
    assert carveout.sets == [16, 4] * 4 and carveout.value == 4


def test_sm_carveout_is_restored_when_the_compute_beside_fails(monkeypatch):
    carveout = _Carveout(monkeypatch, initial=None)
    monkeypatch.setattr(ep_overlap, "_carveout_applies", lambda x: True)
    seen: list = []
    driver = ep_overlap.Overlap(sm_carveout=8)
    with pytest.raises(RuntimeError, match="compute failed"):
        driver.together(_stream("B0", 2, seen, carveout), "B0", _stream("F1", 2, seen, carveout, fail_at=0), "F1")
    assert seen == [("B0", None), ("F1", 8)]
    assert carveout.sets == [8, None] and carveout.value is None


def test_sm_carveout_is_a_no_op_on_cpu_and_when_zero(monkeypatch):
    carveout = _Carveout(monkeypatch, initial=None)
    for sms in (8, 0):  # CPU tensors (gloo): never set; 0: never set, on any device
        if sms == 0:
            monkeypatch.setattr(ep_overlap, "_carveout_applies", lambda x: True)
        seen: list = []
        ep_overlap.Overlap(sm_carveout=sms).together(_stream("B0", 2, seen, carveout), "B0",
                                                     _stream("F1", 2, seen, carveout), "F1")
        assert len(seen) == 6 and carveout.sets == []
    with pytest.raises(InvalidConfigError):
        ep_overlap.Overlap(sm_carveout=-1)


def test_the_overlapped_schedule_takes_the_carveout_and_transport_from_the_executor_options(monkeypatch):
    spec = get_model("tiny-moe-shared")
    state = build_parallel_state(ParallelConfig(world_size=1), 0)
    options = dataclasses.replace(SCENARIOS["base"].options, ep_overlap_sm_carveout=24,
                                  ep_overlap_transport="copy_engine")
    model = MoEGPT(spec, state, options, 16)
    built = []

    class Recorded(ep_overlap.Overlap):
        def __init__(self, trace=None, sm_carveout=0, transport="nccl"):
            built.append((sm_carveout, transport))
            super().__init__(trace, sm_carveout, transport)

    monkeypatch.setattr(ep_overlap, "Overlap", Recorded)
    ids = torch.randint(0, spec.vocab_size, (2, 1, 16))
    run_schedule(model, [(ids[i], torch.roll(ids[i], -1, 1)) for i in range(2)], overlap=True)
    assert built == [(24, "copy_engine")]


def test_transport_option_round_trips_and_rejects_unknown_names():
    assert ExecutorOptions().ep_overlap_transport == "auto"
    options = ExecutorOptions(ep_overlap_transport="copy_engine")
    assert ExecutorOptions(**options.to_dict()) == options
    with pytest.raises(SpecError, match="ep_overlap_transport must be one of"):
        ExecutorOptions(ep_overlap_transport="nvshmem")
    with pytest.raises(InvalidConfigError, match="ep_overlap_transport must be one of"):
        ep_overlap.Overlap(transport="mpi")


def test_sm_carveout_option_round_trips_and_rejects_negatives():
    options = ExecutorOptions(ep_overlap_sm_carveout=16)
    assert ExecutorOptions().ep_overlap_sm_carveout == 0
    assert ExecutorOptions(**options.to_dict()) == options and options.to_dict()["ep_overlap_sm_carveout"] == 16
    with pytest.raises(SpecError, match="ep_overlap_sm_carveout"):
        ExecutorOptions(ep_overlap_sm_carveout=-1)


def test_which_exchanges_are_offered_to_the_copy_engines():
    offered = ep_overlap.over_copy_engines
    assert offered("auto", True, True, 2) and not offered("auto", False, True, 2)  # in line: NCCL, faster alone
    assert offered("copy_engine", True, True, 2) and offered("copy_engine", False, True, 4)
    assert not any(offered("nccl", beside, True, 2) for beside in (True, False))
    assert not offered("copy_engine", True, False, 2) and not offered("auto", True, False, 2)  # CPU: gloo
    assert not offered("copy_engine", True, True, 1)  # a group of one exchanges nothing
