"""planner.accuracy.host_floor_ratios (bench/host_probe_gpu.py --price): a stored probe against the model's host floor, off the device."""

from planner.accuracy import host_floor_ratios
from costmodel.step_time import host_seconds_per_micro_batch
from spec.catalog import get_hardware
from spec.inputs import build_specs
from spec.parallel_config import ParallelConfig
from spec.profile_io import save_profile


def test_ratio_is_measured_over_the_floor_of_each_layout(tmp_path):
    profile = str(save_profile(get_hardware("h200"), tmp_path / "h200.json"))
    training = {"seq_length": 256, "global_batch_size": 8, "precision": "bf16"}
    configs = [ParallelConfig(world_size=1), ParallelConfig(world_size=2, tp=2, recompute_granularity="full")]
    floors = []
    for c in configs:
        spec, train, cluster = build_specs("deepseek-v2-lite", c.world_size, layers=2, profile=profile, **training)
        base, recompute = host_seconds_per_micro_batch(spec, train, cluster, c)
        floors.append((base + recompute) * 1e3)
    probe = {"model": "deepseek-v2-lite@2L", "training": training, "results": [
        {"layout": c.label(), "config": c.to_dict(), "host_ms_per_micro_batch": 2.5 * f}
        for c, f in zip(configs, floors)] + [{"layout": "broken", "failure": "out of memory"}]}
    rows = host_floor_ratios(probe, profile)
    assert [r["layout"] for r in rows] == [c.label() for c in configs]
    assert [round(r["ratio"], 9) for r in rows] == [2.5, 2.5]
    assert floors[0] != floors[1]  # each layout priced on its own floor (TP and recomputation add host work)
