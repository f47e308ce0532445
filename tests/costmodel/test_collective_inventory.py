"""The collectives the cost model prices are the ones the executor issues: counted on CPU ranks, call by call.

Two gloo ranks train two steps of a small multi-latent-attention model (sigmoid routing: the expert bias's
loads are summed once per step) and a small GQA model (also with the load-balancing loss, whose counts are
summed over TP and CP in every forward) under each layout;
during the second step every collective the executor issues is recorded (``torch.distributed``'s functions
and the names modules bound from it, patched in the ranks): its op, group (by the executor's group names),
buffer bytes and phase (forward, backward, or full recomputation's re-run forward during backward). The
micro-batch's calls are compared with :func:`costmodel.collective_inventory.micro_batch_inventory`:
the same calls per phase, op and group, the same sizes, the same bytes. A call added to (or dropped from)
the executor without the model, or the other way round, fails here.

Gradient reduction over DP·CP and EDP (the once-per-step collectives, which the overlapped reducer may start
during the last backward) is not a micro-batch's and is left out.
"""

from __future__ import annotations

import collections
import dataclasses
import sys

import pytest
import torch
import torch.distributed as dist

import executor.parallel.collectives as coll
import executor.parallel.ring_attention as ring
from costmodel import collective_inventory as inv
from executor.data import global_batch, micro_batches
from executor.launch_local import launch
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.train_step import Trainer
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from spec.router_options import RouterOptions
from spec.training_spec import TrainingSpec

pytestmark = pytest.mark.slow

SEQ, MICRO = 32, 2
# GQA, shared experts; 2 layers: the first dense, the second MoE (every kind of layer once; the model's
# inventory counts per layer, and each recorded layer costs the gloo ranks tens of collectives a step)
GQA = get_model("tiny-moe-shared").with_layers(2)
# DeepSeek-V2-Lite in miniature: multi-latent attention without a query LoRA, shared experts, first layer dense
MLA = dataclasses.replace(GQA, name="tiny-mla-inventory", num_query_groups=None, multi_latent_attention=True,
                          q_lora_rank=None, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12,
                          moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
                          moe_router_topk_scaling_factor=2.5)
# (model, router options) of each run
CASES = {"gqa": (GQA, None), "mla": (MLA, None),
         "gqa-aux": (GQA, RouterOptions(moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="seq_aux_loss"))}
# DeepSeek-V2-Lite's measured layout (bench/results/issue16) and one change at a time
LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2-allgather": dict(tp=2, etp=2, moe_token_dispatcher_type="allgather"),
    "tp2-ep2-allgather": dict(tp=2, ep=2, moe_token_dispatcher_type="allgather"),
    "etp2": dict(etp=2),
    "cp2": dict(cp=2),
    "cp2-p2p": dict(cp=2, cp_comm_type="p2p"),
    "cp2-a2a": dict(cp=2, cp_comm_type="a2a"),
    "cp2-p2p-core": dict(cp=2, cp_comm_type="p2p", recompute_granularity="selective", recompute_modules=("core_attn",)),
    "ep2": dict(ep=2),
    "dp2": dict(),
    "tp2-recompute": dict(tp=2, recompute_granularity="full"),
    "tp2-allgather-recompute": dict(tp=2, etp=2, moe_token_dispatcher_type="allgather", recompute_granularity="full"),
    "tp2-allgather-selective": dict(tp=2, etp=2, moe_token_dispatcher_type="allgather",
                                    recompute_granularity="selective", recompute_modules=("mlp", "moe")),
    "tp2-selective-shared": dict(tp=2, recompute_granularity="selective", recompute_modules=("mlp", "shared_experts")),
}
STEP_GROUPS = ("dp", "dp_cp", "edp")  # gradient reduction: once per step
_OPS = {"all_reduce": "all_reduce", "all_to_all_single": "all_to_all", "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter", "all_gather_single": "all_gather",
        "reduce_scatter_single": "reduce_scatter", "all_gather": "all_gather_list", "broadcast": "broadcast",
        "batch_isend_irecv": "p2p"}


def _config(layout: str, world: int = 2) -> ParallelConfig:
    cfg = LAYOUTS[layout]
    return ParallelConfig(world_size=world, sequence_parallel=cfg.get("tp", 1) > 1, **cfg)


class _Recorder:
    """Every collective call: (phase, op, group name, bytes). ``phase`` is 'step' outside forward_backward."""

    def __init__(self):
        self.names: dict[int, str] = {}
        self.calls: list[tuple[str, str, str, int]] = []
        self.micro = False
        self.in_backward = 0  # inside a collective autograd function's backward
        self.in_ring = 0  # inside the ring attention's forward (whose backward may recompute it first)
        self.depth = 0  # inside a recorded call (a renamed collective calling the other name)

    def phase(self) -> str:
        if not self.micro:
            return "step"
        if torch._C._current_graph_task_id() == -1:
            return "forward"
        return "backward" if self.in_backward and not self.in_ring else "recompute"

    def wrap(self, name, fn):
        op = _OPS[name]

        def recorded(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            group = kwargs.get("group")
            if op == "p2p":  # batch_isend_irecv([P2POp, ...]): the group and the bytes this rank sends
                group = args[0][0].group
                tensor = [o.tensor for o in args[0] if o.op is dist.isend]
            elif op in ("all_gather", "reduce_scatter"):  # (output, input): the full-size buffer
                tensor = args[0] if op == "all_gather" else args[1]
            else:
                tensor = args[1] if op == "all_to_all" else args[0]  # all-to-all: (output, input)
            if isinstance(tensor, list):
                nbytes = sum(t.numel() * t.element_size() for t in tensor)
            else:
                nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
            self.calls.append((self.phase(), op, self.names.get(id(group), "?"), nbytes))
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
        return recorded

    def install(self) -> None:
        wrapped = {}
        for name in _OPS:
            fn = getattr(dist, name, None)
            if fn is not None:
                wrapped[fn] = self.wrap(name, fn)
                setattr(dist, name, wrapped[fn])
        for module_name, module in list(sys.modules.items()):  # names bound at import (collectives.py's aliases)
            if module_name.startswith("executor"):
                for attr, value in list(vars(module).items()):
                    if callable(value) and value in wrapped:
                        setattr(module, attr, wrapped[value])
        for cls in (coll._AllGather, coll._ReduceScatter, coll._AllReduce, coll._AllToAll, coll._AllGatherV,
                    coll._ReduceScatterV, ring._RingAttention):
            cls.backward = staticmethod(self._marked(cls.backward))
        ring._RingAttention.forward = staticmethod(self._in_ring(ring._RingAttention.forward))

    def _in_ring(self, forward):
        def run(ctx, *args):
            self.in_ring += 1
            try:
                return forward(ctx, *args)
            finally:
                self.in_ring -= 1
        return run

    def _marked(self, backward):
        def run(ctx, *grads):
            self.in_backward += 1
            try:
                return backward(ctx, *grads)
            finally:
                self.in_backward -= 1
        return run


def _worker(rank: int, world: int, cases: list[str], layouts: list[str]) -> dict:
    """Per case of ``CASES``, the calls of every layout of ``layouts`` (one world for all: a launch per case
    would only build the same groups again)."""
    recorder = _Recorder()
    recorder.install()
    return {case: _record(recorder, rank, world, *CASES[case], layouts) for case in cases}


def _record(recorder: _Recorder, rank: int, world: int, spec, router: RouterOptions | None,
            layouts: list[str]) -> dict:
    out = {}
    for layout in layouts:
        config = _config(layout, world)
        dp = world // (config.tp * config.cp * config.pp)
        gbs = MICRO * config.micro_batch_size * dp
        training = TrainingSpec(seq_length=SEQ, global_batch_size=gbs, precision="bf16")
        state = build_parallel_state(config, rank)
        recorder.names = {id(g.pg): name for name, g in state.groups.items() if g.pg is not None}
        torch.manual_seed(0)
        net = MoEGPT(spec, state, ExecutorOptions.for_training(training, router, model=spec), SEQ, torch.device("cpu"),
                     torch.bfloat16)
        trainer = Trainer(net)
        forward_backward = trainer.forward_backward

        def counted(micro, forward_backward=forward_backward):
            recorder.micro = True
            try:
                return forward_backward(micro)
            finally:
                recorder.micro = False
        trainer.forward_backward = counted
        for step in range(2):  # the second step is recorded
            recorder.calls = []
            batch = global_batch(spec.vocab_size, SEQ, gbs, 0, step)
            trainer.step(micro_batches(batch, state.dp.size, state.dp.rank, config.micro_batch_size,
                                       torch.device("cpu")))
        out[layout] = recorder.calls
    return out


@pytest.fixture(scope="module")
def recorded():
    """case -> per rank, layout -> its calls."""
    result = launch(_worker, 2, (list(CASES), list(LAYOUTS)), backend="gloo", timeout_s=600, start_method="fork")
    assert result.ok, result.failure_reason
    return {case: [rank[case] for rank in result.results] for case in CASES}


def _micro_calls(ranks: list[dict], layout: str) -> list[list[tuple[str, str, str, int]]]:
    """Per rank, the calls of forward_backward on groups a micro-batch uses (gradient reduction left out)."""
    return [[c for c in rank[layout] if c[0] != "step" and c[2] not in STEP_GROUPS] for rank in ranks]


def _by_key(calls) -> dict[tuple[str, str, str], tuple[float, float, collections.Counter]]:
    """(phase, op, group) -> (calls, bytes, Counter of call sizes) per micro-batch."""
    out: dict = {}
    for phase, op, group, nbytes in calls:
        count, total, sizes = out.get((phase, op, group), (0.0, 0.0, collections.Counter()))
        sizes[nbytes] += 1
        out[(phase, op, group)] = (count + 1 / MICRO, total + nbytes / MICRO, sizes)
    return out


def _model_calls(case: str, layout: str) -> list[tuple[str, str, str, int]]:
    spec, router = CASES[case]
    config = _config(layout)
    dp = 2 // (config.tp * config.cp)
    training = TrainingSpec(seq_length=SEQ, global_batch_size=MICRO * dp, precision="bf16")
    return [(c.phase, c.op, c.group, int(c.nbytes))
            for c in inv.micro_batch_inventory(spec, training, config, router) for _ in range(MICRO)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_model_prices_every_collective_the_executor_issues(recorded, case, layout):
    model = _by_key(_model_calls(case, layout))
    for rank, calls in enumerate(_micro_calls(recorded[case], layout)):
        got = _by_key(calls)
        assert "?" not in {key[2] for key in got}, f"a call over a group the executor does not name: {got}"
        assert set(got) == set(model), f"rank {rank}: executor {sorted(got)} vs model {sorted(model)}"
        for key, (count, total, sizes) in got.items():
            m_count, m_total, m_sizes = model[key]
            assert count == m_count, f"rank {rank} {key}: {count} calls a micro-batch, the model {m_count}"
            if key[1] == "all_to_all" and key[2] == "ep":
                continue  # a rank receives what routing sends it: compared over ranks below
            assert sizes == m_sizes, f"rank {rank} {key}: sizes {dict(sizes)} vs the model's {dict(m_sizes)}"
    # all-to-all: each rank sends its tokens' copies; what comes back depends on routing, the sum over ranks not
    a2a = [(k, v) for k, v in model.items() if k[1] == "all_to_all"]
    for key, (_, m_total, _) in a2a:
        mean = sum(_by_key(calls)[key][1] for calls in _micro_calls(recorded[case], layout)) / 2
        assert mean == pytest.approx(m_total), key


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_model_lists_every_once_per_step_collective(recorded, case, layout):
    spec, router = CASES[case]
    config = _config(layout)
    dp = 2 // (config.tp * config.cp)
    training = TrainingSpec(seq_length=SEQ, global_batch_size=MICRO * dp, precision="bf16")
    model = collections.Counter((c.op, c.group, int(c.nbytes)) for c in inv.step_inventory(spec, training, config,
                                                                                               router=router))
    for rank, calls in enumerate(recorded[case]):
        got = collections.Counter((op, group, nbytes) for phase, op, group, nbytes in calls[layout]
                                  if phase == "step" or group in STEP_GROUPS)
        assert got == model, f"rank {rank}: executor {sorted(got.items())} vs model {sorted(model.items())}"


def test_inventory_covers_what_the_measured_layout_issues():
    # DeepSeek-V2-Lite (2 layers) at tp2 etp2 mbs2 seq 4096, allgather dispatcher, full recompute: the 2 x H200
    # trace (bench/results/issue16/h200-0457/trace-deepseek-v2-lite.json) counted per step of 4 micro-batches
    # 84 all-gathers, 60 bf16 and 4 fp32 reduce-scatters and 16 fp32 all-reduces (4 of them once per step)
    model = get_model("deepseek-v2-lite").with_layers(2)
    config = ParallelConfig.parse("tp2 cp1 pp1 vpp1 ep1 etp2 dp1 edp1 mbs2 recompute=full dispatcher=allgather",
                                  world_size=2)
    training = TrainingSpec(seq_length=4096, global_batch_size=8, precision="bf16")
    calls = inv.micro_batch_inventory(model, training, config)
    per_step = collections.Counter()
    for c in calls:
        fp32 = c.op != "all_gather" and c.nbytes < 2**20  # the loss's, the router loss's and the probabilities'
        per_step[(c.op, fp32)] += 4
    assert per_step[("all_gather", False)] == 84
    assert per_step[("reduce_scatter", False)] == 60 and per_step[("reduce_scatter", True)] == 4
    assert per_step[("all_reduce", True)] == 12
