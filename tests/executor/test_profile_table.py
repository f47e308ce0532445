"""executor.profile_table.measure_table runs its layouts in one set of kept rank processes unless told not to."""

from __future__ import annotations

import pytest

from executor.profile_table import measure_table
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

TRAINING = TrainingSpec(seq_length=32, global_batch_size=4, precision="fp32")
CONFIGS = [ParallelConfig(world_size=2, ep=2), ParallelConfig(world_size=2, tp=2)]


@pytest.mark.slow
@pytest.mark.parametrize("reuse", [True, False])
def test_rows_say_whether_the_ranks_were_kept_and_carry_the_fixed_cost(reuse):
    rows = measure_table(get_model("tiny-moe"), TRAINING, CONFIGS, warmup=1, steps=1, device="cpu", hardware=None,
                         timeout_s=120, reuse=reuse)
    assert [r["ok"] for r in rows] == [True, True], [r["failure_reason"] for r in rows]
    assert [r["reused_ranks"] for r in rows] == [False, reuse]
    assert all(r["fixed_cost_s"] >= r["startup_s"] >= 0 for r in rows)
