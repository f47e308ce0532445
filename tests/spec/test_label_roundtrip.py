"""Every label foldtune prints parses back to the same layout: the whole enumerated space of DeepSeek-V3 on
256 H100s (every layout, micro-batch size, dispatcher, distributed-optimizer setting and recompute option the
planner enumerates), through ``ParallelConfig.parse`` (the one codec) and ``parse_layout`` (what
``plan --explain``, ``profile --layout`` and ``train --layout`` read)."""

from __future__ import annotations

import pytest

from planner.enumerate import enumerate_layouts
from spec.errors import InvalidConfigError
from spec.inputs import build_specs
from spec.parallel_config import ParallelConfig
from spec.validity import parse_layout


def test_every_label_of_a_deepseek_v3_plan_on_256_gpus_parses_back_to_its_layout():
    model, training, cluster = build_specs("deepseek-v3", 256, gpu="h100-sxm", seq_length=4096,
                                           global_batch_size=1024)
    enum = enumerate_layouts(model, training, cluster)
    labels, distopt_off, n = set(), 0, 0
    for config in enum.configs():
        label = config.label()
        assert ParallelConfig.parse(label) == config, label
        labels.add(label)
        n += 1
        if not config.use_distributed_optimizer:
            distopt_off += 1
            if config.micro_batch_size == 1:  # what plan --explain reads, on a quarter of the space
                assert parse_layout(label, 256) == (config, []), label
    assert n == enum.valid > 400_000  # the whole space, not a sample
    assert len(labels) == n  # and no two layouts share a label
    assert 0 < distopt_off < n  # both optimizer settings were covered ('... distopt=off' among them)


def test_distopt_off_label_is_a_valid_layout():
    config = ParallelConfig.parse("tp1 cp1 pp1 vpp1 ep2 etp1 dp4 edp2 mbs1 distopt=off")
    assert not config.use_distributed_optimizer and not config.overlap_param_gather
    assert config.label().endswith("distopt=off")


@pytest.mark.parametrize("text, shown", [("tp2 banana", "'banana'"), ("tp2 distopt=maybe", "'distopt=maybe'"),
                                         ("recompute=full:x", "'recompute=full:x'")])
def test_a_bad_layout_token_lists_the_valid_keys(text, shown):
    with pytest.raises(InvalidConfigError) as info:
        ParallelConfig.read_label(text)
    message = str(info.value)
    assert f"cannot parse layout token {shown}" in message
    for key in ("tpN", "cpN", "ppN", "vppN", "epN", "etpN", "dpN", "edpN", "mbsN", "recompute=", "dispatcher=",
                "distopt={on|off}"):
        assert key in message

