"""planner.accuracy.pooled: a proxy's 1- and 2-GPU tables priced each on its own GPU count, then pooled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.accuracy import compare, merge_tables, pooled, spearman, summarize
from spec.inputs import build_specs

RUN = Path(__file__).resolve().parents[2] / "bench/results/issue16/h200-0545"
TABLES = RUN / "tables/res/mixtral-8x7b"
PROFILE = str(RUN / "h200-calibrated.json")


def _tables():
    one = merge_tables([json.loads((TABLES / f"layout_table-mixtral-8x7b-2L-1-2026-11-27-gpu-shard{i}of2.json")
                                   .read_text()) for i in (0, 1)], "mixtral-8x7b@2L", "test")
    two = json.loads((TABLES / "layout_table-mixtral-8x7b-2L-2-2026-11-27-gpu.json").read_text())
    return one, two


def test_each_table_is_priced_on_its_own_gpu_count_and_the_rows_pooled():
    one, two = _tables()
    got = pooled("mixtral-8x7b", 2, [one, two], 4096, 8, "bf16", profile=PROFILE)
    assert got["layouts"] == len(one["rows"]) + len(two["rows"]) == 22
    # the 2-GPU rows are exactly what costmodel_accuracy reports for the 2-GPU table alone
    spec, training, cluster = build_specs("mixtral-8x7b", 2, layers=2, seq_length=4096, global_batch_size=8,
                                          precision="bf16", distributed_optimizer=True, profile=PROFILE)
    rows, _ = compare(spec, training, cluster, two["rows"])
    alone = summarize(rows)
    assert got["mape_2gpu"] == pytest.approx(alone["mape"]) and got["spearman_2gpu"] == pytest.approx(alone["spearman"])
    # and the pooled figures are over all rows, the 1-GPU ones priced on one GPU
    ones = [r for r in got["rows"] if r["gpus"] == 1]
    spec1, training1, cluster1 = build_specs("mixtral-8x7b", 1, layers=2, seq_length=4096, global_batch_size=8,
                                             precision="bf16", distributed_optimizer=True, profile=PROFILE)
    want = {r["layout"]: r["predicted_s"] for r in compare(spec1, training1, cluster1, one["rows"])[0]}
    assert len(ones) == 6 and {r["layout"]: r["predicted_s"] for r in ones} == pytest.approx(want)
    assert got["spearman"] == pytest.approx(spearman([r["predicted_s"] for r in got["rows"]],
                                                     [r["measured_s"] for r in got["rows"]]))
