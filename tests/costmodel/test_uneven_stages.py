"""Uneven pipeline stages priced by hand: Qwen3-235B-A22B's 94 layers on pp32·vpp3 with the embedding and the
loss accounted as layers of the split (as Megatron runs it), accepted and priced stage by stage."""

from __future__ import annotations

import pytest

from costmodel.memory import estimate_memory
from costmodel.params import embedding_params, layer_params, stage_layers, stage_param_counts
from costmodel.step_time import estimate_step_time, pipeline_bubble, stage_times
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from spec.validity import check_config

MODEL = get_model("qwen3-235b-a22b")  # 94 MoE layers, untied output layer, no MTP
TRAINING = TrainingSpec(seq_length=4096, global_batch_size=1024)
CLUSTER = ClusterSpec(get_hardware("h100-sxm"), 256)
CONFIG = ParallelConfig(256, tp=2, pp=32, vpp=3, ep=8, account_for_embedding_in_pipeline_split=True,
                        account_for_loss_in_pipeline_split=True)


def test_rejected_without_the_accounting_and_accepted_with_it():
    plain = CONFIG.replace(account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False)
    assert [r.rule for r in check_config(MODEL, TRAINING, CLUSTER, plain)] == ["layers_pp"]
    assert check_config(MODEL, TRAINING, CLUSTER, CONFIG) == []


def test_stages_hold_the_layers_worked_out_by_hand():
    # 94 + 2 = 96 slots in 96 chunks: one each; chunk 0 (rank 0, vstage 0) is the embedding's and chunk 95
    # (rank 31, vstage 2) the loss's, so ranks 0 and 31 hold 2 decoder layers and the others 3
    assert stage_layers(MODEL, CONFIG, 0) == (31, 63)
    assert stage_layers(MODEL, CONFIG, 1) == (0, 32, 64)
    assert stage_layers(MODEL, CONFIG, 31) == (30, 62)
    assert sum(len(stage_layers(MODEL, CONFIG, s)) for s in range(32)) == 94
    layer = layer_params(MODEL, 2, 8, 1, True)
    assert stage_param_counts(MODEL, CONFIG, 1) == layer * 3
    assert stage_param_counts(MODEL, CONFIG, 0) == layer * 2 + embedding_params(MODEL, 2)
    # the last rank: 2 layers, the final norm (replicated) and its own output matrix (split over TP)
    words = MODEL.padded_vocab_size(2) * MODEL.hidden_size // 2
    last = stage_param_counts(MODEL, CONFIG, 31)
    assert last.dense_tp_sharded == 2 * layer.dense_tp_sharded + words
    assert last.dense_replicated == 2 * layer.dense_replicated + MODEL.hidden_size


def test_priced_with_uneven_stages():
    times = stage_times(MODEL, TRAINING, CLUSTER, CONFIG)
    assert len(set(times[1:31])) == 1  # every middle rank holds 3 layers
    assert times[0] < times[1]  # one layer fewer, the embedding lookup is cheap
    m = CONFIG.num_micro_batches(TRAINING.global_batch_size)  # 1024 / (1 · 4) = 256
    assert m == 256
    t = estimate_step_time(MODEL, TRAINING, CLUSTER, CONFIG)
    terms = dict(t.terms)
    slowest = max(times)
    # the bubble: every other rank's time per micro-batch, passed once in chunks of 1/vpp
    assert terms["pp_bubble"] == pytest.approx(pipeline_bubble(times, 3), rel=1e-9)
    assert terms["pp_bubble"] == pytest.approx((sum(times) - slowest) / 3, rel=1e-9)
    assert t.step_time >= m * slowest
    memory = estimate_memory(MODEL, TRAINING, CLUSTER, CONFIG)
    assert memory.total > 0 and 0 <= memory.stage < 32


def test_in_flight_activations_follow_the_chunks_megatron_runs_first():
    """Interleaved warm-up runs chunk (k // pp) % vpp for its k-th forward: on rank 0 the 127 in flight are 32
    of the empty embedding chunk, 32 + 32 of its two one-layer chunks and 31 more of the empty one (64 layers);
    on rank 31, 65 in flight: 32 + 32 of its one-layer chunks and one of the loss's empty chunk (64 layers,
    where an even spread over the rank's chunks would say 43); a middle rank holds one layer per chunk."""
    from costmodel.memory import _stage_layout, in_flight_chunk_equivalents, in_flight_micro_batches

    split = CONFIG.pipeline_split
    for stage, in_flight, layers_held in ((0, 127, 64), (1, 125, 125), (31, 65, 64)):
        lay = _stage_layout(MODEL, 32, 3, -1, stage, split)
        n = in_flight_micro_batches(32, 3, stage, 256)
        assert n == in_flight
        rank_layers = lay.stored_dense + lay.stored_moe
        assert in_flight_chunk_equivalents(lay, n, 32, 3) * rank_layers / 3 == pytest.approx(layers_held)
