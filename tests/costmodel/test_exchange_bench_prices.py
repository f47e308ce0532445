"""costmodel.calibrate.exchange_prices.predict_bench: the cost model's price of every case bench/cp_dispatch_gpu.py
times (its --price), from the named quantities."""

from __future__ import annotations

import pytest

from costmodel.calibrate.exchange_prices import predict_bench
from costmodel.compute import compute_rates
from costmodel.context_parallel import cp_attention_time
from spec import get_hardware


def test_bench_cases_are_priced_from_the_named_quantities():
    hw = get_hardware("h100-sxm")
    pred = predict_bench(hw, hidden=4096, heads=32, kv_heads=8, head_dim=128, seqs=(2048, 4096, 8192), experts=8,
                         topk=2, tokens=(1024, 4096, 16384), bytes_per_element=2)
    assert list(pred["cp"]) == ["2048", "4096", "8192"] and list(pred["dispatch"]) == ["1024", "4096", "16384"]
    rates = compute_rates(hw, "bf16")
    for s, row in pred["cp"].items():
        assert row["cp2_core_ms"] == pytest.approx(1e3 * sum(cp_attention_time(rates, 1, int(s), 2, 32, 128, 128)))
        assert row["cp2_total_ms"] == pytest.approx(row["cp2_core_ms"] + row["cp2_kv_ms"] + row["cp2_proj_ms"])
        assert 1.0 < row["speedup_total"] < 2.0  # less than ideal: shorter chunks, the exchange
        assert row["speedup_core"] < 2.0  # shorter chunks on the slower flash kernel
    for n, row in pred["dispatch"].items():
        # EP2 top-2: the same token rows on the wire each way (module test); allgather also gathers the routing
        assert row["allgather_gather_bytes"] == 2 * int(n) * (4096 * 2 + 2 * 12)
        assert row["alltoall_ms"] > 0 and row["allgather_ms"] > 0
