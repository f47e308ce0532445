"""Megatron's pipeline placements on two gloo processes equal the single-process run (fp32, rtol 1e-4).

Uneven stages from a layout string (1F1B and interleaved), stages that hold no decoder layer (only the
embedding, only the loss, only the MTP depth and the loss) and the embedding/loss accounted as layers of the
split, each compared with :func:`executor.verify.compare` (losses, step-1 gradients gathered to full shape,
routed tokens, parameters after three AdamW steps) against the run of the same global batch on one process;
one run also recomputes MLA's up projections (mla_up_proj with core_attn).
"""

from __future__ import annotations

import dataclasses

import pytest

from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from spec.pipeline_layout import layer_chunks
from executor.launch_local import launch
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.verify import Scenario, compare, layout_worker, reference

SHARED = get_model("tiny-moe-shared")  # 4 layers, shared experts, first layer dense
LOSSES = ExecutorOptions(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
FOUR = Scenario("four", SHARED, LOSSES, adam_eps=1e-5)
TWO = Scenario("two", SHARED.with_layers(2), LOSSES, adam_eps=1e-5)
MTP = Scenario("mtp", dataclasses.replace(SHARED.with_layers(2), name="tiny-moe-mtp", mtp_num_layers=1), LOSSES,
               adam_eps=1e-5)
MLA = Scenario("mla", dataclasses.replace(SHARED, name="tiny-mla", num_query_groups=None, multi_latent_attention=True,
                                          q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
                                          v_head_dim=12), LOSSES, adam_eps=1e-5)
DEEPSEEK_RECOMPUTE = {"recompute_granularity": "selective",
                      "recompute_modules": ("core_attn", "moe_act", "layernorm", "mla_up_proj")}

# (fields of a pp2 layout, scenario, decoder layers per [rank][chunk] it must build); the runs marked
# placement-only differ from another run only in how the placement is spelled (the executor reads
# layer_chunks either way), so they are checked for their placement and not run again
RUNS = [
    ({"pipeline_layout": "Et|tttL"}, FOUR, ((1,), (3,))),  # uneven 1F1B
    ({"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3}, FOUR, ((1,), (3,))),
    ({"pipeline_layout": "E|t*4L"}, FOUR, ((0,), (4,))),  # the first stage holds only the embedding
    ({"vpp": 2, "pipeline_layout": "E|tt|t|tL"}, FOUR, ((0, 1), (2, 1))),  # interleaved, uneven chunks
    # embedding and loss accounted as layers: 2 + 2 slots in 4 chunks, the model's first and last chunks empty
    ({"vpp": 2, "account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
     TWO, ((0, 1), (1, 0))),
    ({"pipeline_layout": "Ett|mL"}, MTP, ((2,), (0,))),  # the last stage: the MTP depth and the loss only
    # Megatron's DeepSeek recompute set (mla_up_proj with core_attn) on an uneven MLA pipeline
    ({"pipeline_layout": "Et|tttL", **DEEPSEEK_RECOMPUTE}, MLA, ((1,), (3,))),
]


def _config(fields: dict) -> ParallelConfig:
    return ParallelConfig(world_size=2, pp=2, **fields)


def test_each_run_places_the_layers_it_is_meant_to():
    for fields, scenario, want in RUNS:
        c = _config(fields)
        got = layer_chunks(scenario.model.num_layers, c.pp, c.vpp, c.pipeline_split)
        assert tuple(tuple(len(chunk) for chunk in rank) for rank in got) == want, fields


def _worker(rank: int, world_size: int, runs: list) -> dict:
    """:func:`layout_worker`, plus what this rank built: (decoder layers per chunk, has the embedding,
    has the LM head's final norm) per run (a placement is invisible in the results: the math is the same)."""
    out = layout_worker(rank, world_size, runs)
    built = []
    for config, scenario in runs:
        model = MoEGPT(scenario.model, build_parallel_state(config, rank), scenario.options, scenario.seq_length)
        built.append((tuple(len(c) for c in model.chunk_layers), model.embedding is not None,
                      model.final_norm is not None))
    return {**out, "built": built}


@pytest.mark.slow
def test_uneven_and_empty_stages_match_single_process():
    chosen = [run for run in RUNS if "decoder_first_pipeline_num_layers" not in run[0]]
    runs = [(_config(fields), scenario) for fields, scenario, _ in chosen]
    references = [reference(c, scenario) for c, scenario in runs]
    launched = launch(_worker, 2, (runs,), backend="gloo", timeout_s=300, start_method="fork")
    assert launched.ok, launched.failure_reason
    for rank in (0, 1):  # each rank built its chunks; the embedding on rank 0, the loss's norm on rank 1
        got = launched.results[rank]["built"]
        assert [b[0] for b in got] == [want[rank] for _, _, want in chosen]
        assert all(b[1] == (rank == 0 or scenario.model.mtp_num_layers > 0) and b[2] == (rank == 1)
                   for b, (_, scenario, _) in zip(got, chosen))
    failures = {}
    for (c, _), ref, got in zip(runs, references, launched.results[0]["results"]):
        problems = compare(ref, got)
        if problems:
            failures[c.label()] = problems[:6]
    assert not failures, failures
