"""Shared-expert overlap (``moe_shared_expert_overlap``, Megatron's ``--moe-shared-expert-overlap``) on 2 gloo
processes: the step equals the single-process reference and the in-line run, and the shared experts really run
while the dispatch all-to-all is in flight (started asynchronously, waited for after them)."""

from __future__ import annotations


import pytest

from executor import moe as moe_module
from executor.parallel import collectives
from executor.verify import compare
from executor.buildable import check_buildable, training_for
from spec.errors import InvalidConfigError
from tests.executor.test_equivalence import SCENARIOS
from tests.executor.test_equivalence import runs_with_and_without, traced_layout_worker
from tests.executor.test_equivalence import two_rank_config as _config

OVERLAP = {"moe_shared_expert_overlap": True}
# (layout, scenario, extra fields) on 2 ranks: EP alone, then TP·SP attention folded onto the same ranks as EP
RUNS = [
    ("ep2", "shared", {}),
    ("tp2 ep2 etp1", "shared", {}),
    ("ep2", "shared", {"recompute_granularity": "selective",
                       "recompute_modules": ("core_attn", "moe_act", "layernorm", "shared_experts")}),
]


def test_the_layouts_are_valid_and_built():
    for label, scenario, extra in RUNS:
        config = _config(label, extra).replace(**OVERLAP)
        check_buildable(SCENARIOS[scenario].model, training_for(16, 4, None, False), config)
    # the same layout on a model without shared experts: the rule names what is missing
    with pytest.raises(InvalidConfigError, match=r"\[shared_overlap\] .*needs shared experts"):
        check_buildable(SCENARIOS["base"].model, training_for(16, 4, None, False), _config("ep2", OVERLAP))


_TRACE: list = []  # the order of events in this process (a forked rank appends to its own copy)


def _logged_start(*args, **kwargs):
    """all_to_all_async, logging its start (whether it left an exchange in flight) and its wait."""
    pending = _PLAIN_START(*args, **kwargs)
    _TRACE.append(("start", pending.work is not None))
    _IN_FLIGHT.append(pending)
    plain_wait = pending.wait

    def wait():
        _TRACE.append(("wait",))
        _IN_FLIGHT.remove(pending)
        return plain_wait()
    pending.wait = wait
    return pending


def _logged_shared(self, x):
    """MoELayer.shared_output, logging whether an exchange was in flight when the shared experts ran."""
    _TRACE.append(("shared", any(p.work is not None for p in _IN_FLIGHT)))
    return _PLAIN_SHARED(self, x)


_PLAIN_START, _PLAIN_SHARED = collectives.all_to_all_async, moe_module.MoELayer.shared_output
_IN_FLIGHT: list = []


@pytest.mark.slow
def test_overlapped_step_equals_reference_and_inline_run(monkeypatch):
    monkeypatch.setattr(moe_module, "all_to_all_async", _logged_start)
    monkeypatch.setattr(moe_module.MoELayer, "shared_output", _logged_shared)
    references, results, reports = runs_with_and_without(RUNS, OVERLAP, traced_layout_worker(_TRACE))
    failures = {}
    for i, (label, scenario, extra) in enumerate(RUNS):
        overlapped, inline = results[i]
        problems = compare(references[i], overlapped) + compare(inline, overlapped, rtol=1e-5, atol=1e-7)
        if problems:
            failures[f"{label}/{scenario}/{extra}"] = problems[:6]
    assert not failures, failures
    for got in reports:
        for overlapped, inline in zip(got["traces"][::2], got["traces"][1::2]):
            # every MoE layer's forward: the exchange started asynchronously, the shared experts run while it is
            # in flight, then the wait; the in-line run neither starts one nor overlaps its shared experts
            assert overlapped and len(overlapped) % 3 == 0
            for k in range(0, len(overlapped), 3):
                assert overlapped[k:k + 3] == [("start", True), ("shared", True), ("wait",)], overlapped[k:k + 3]
            assert inline and all(e == ("shared", False) for e in inline)


