"""Megatron's pipeline placement options: the layout-string grammar, the chunk sizes each option gives, the
label round trip of ParallelConfig and the layers_pp rule's reasons."""

from __future__ import annotations

import pytest

from spec.catalog import get_hardware, get_model
from spec.errors import InvalidConfigError
from spec.hardware import ClusterSpec
from spec.layout_rules import layout_rejections
from spec.parallel_config import ParallelConfig
from spec.pipeline_layout import (MAX_EXPANDED_ITEMS, PipelineLayoutError, PipelineSplit, chunk_sizes, format_layout,
                                  layer_chunks, parse_layout_string)
from spec.training_spec import TrainingSpec
from spec.validity import Validator, pipeline_split


def test_megatron_documentation_example_parses():
    # DeepSeek-V3 on pp16·vpp2: embedding + 3 layers, 29 chunks of 2, a standalone MTP chunk, the loss
    chunks = parse_layout_string("Et*3|(tt|)*29,m|L")
    assert len(chunks) == 32
    assert chunks[0] == "Ettt" and chunks[1:30] == ("tt",) * 29 and chunks[30:] == ("m", "L")
    assert parse_layout_string("E|(t|)*2L") == ("E", "t", "t", "L")
    assert parse_layout_string("E((t)*2|)*2L") == ("Ett", "tt", "L")  # nested repeats
    assert parse_layout_string("E|||L") == ("E", "", "", "L")  # empty chunks


@pytest.mark.parametrize("text,why", [
    ("Ex|L", "unknown symbol 'x'"), ("(Et|L", "unbalanced '('"), ("Et)|L", "unbalanced ')'"),
    ("Et*|L", "not followed by a count"), ("E(t|)*99999999L", f"more than {MAX_EXPANDED_ITEMS}"),
    ("E" + "t" * 5000 + "L", "longer than"),
])
def test_bad_layout_strings_say_why(text, why):
    with pytest.raises(PipelineLayoutError, match=why.replace("(", r"\(").replace(")", r"\)")):
        parse_layout_string(text)


def test_chunk_sizes_of_each_option():
    both = PipelineSplit(embedding=True, loss=True)
    sizes = chunk_sizes(94, 32, 3, both)
    assert sizes[0] == 0 and sizes[-1] == 0 and set(sizes[1:-1]) == {1} and sum(sizes) == 94
    assert chunk_sizes(7, 2, 1, PipelineSplit(embedding=True)) == (3, 4)  # 8 slots, the embedding takes one
    assert chunk_sizes(7, 2, 1, PipelineSplit(loss=True)) == (4, 3)
    assert chunk_sizes(10, 4, 1, PipelineSplit(first=1, last=1)) == (1, 4, 4, 1)
    # vpp 2: chunk j is rank j % 4's virtual stage j // 4; each rank's layers split evenly over its chunks
    assert chunk_sizes(10, 4, 2, PipelineSplit(first=2, last=0)) == (1, 2, 2, 0, 1, 2, 2, 0)
    assert chunk_sizes(5, 2, 1, PipelineSplit(layout="Et|ttttL")) == (1, 4)
    assert chunk_sizes(61, 16, 1) == (4,) * 13 + (3,) * 3  # no option: extra layers on the earliest chunks
    assert layer_chunks(4, 2, 2, PipelineSplit(layout="E|tt|t|tL")) == (((), (2,)), ((0, 1), (3,)))


@pytest.mark.parametrize("layers,pp,vpp,split,mtp,why", [
    (10, 4, 2, PipelineSplit(first=1, last=1), 0, "rank 0 holds 1 layers, not a multiple of vpp (2)"),
    (10, 4, 1, PipelineSplit(first=1, last=2), 0, "do not split evenly over the 2 middle stages"),
    (10, 4, 1, PipelineSplit(first=8, last=4), 0, "exceed num_layers"),
    (10, 1, 1, PipelineSplit(first=10), 0, "need pp > 1"),
    (9, 4, 1, PipelineSplit(embedding=True, loss=True), 0, "11 is not divisible by pp·vpp = 4·1 = 4"),
    (4, 2, 1, PipelineSplit(layout="Ett|mL"), 1, "places 2 decoder layers"),
    (4, 2, 2, PipelineSplit(layout="Ett|ttL"), 0, "has 2 chunks, pp·vpp = 2·2 = 4"),
    (4, 2, 1, PipelineSplit(layout="ttE|ttL"), 0, "'E' must open the first chunk"),
    (4, 2, 1, PipelineSplit(layout="Ett|ttmL"), 0, "places 1 MTP layers"),
    (4, 2, 1, PipelineSplit(layout="Ettm|ttL"), 1, "MTP layers 'm' must directly precede the loss"),
])
def test_options_that_do_not_fit_say_why(layers, pp, vpp, split, mtp, why):
    with pytest.raises(PipelineLayoutError, match=why.replace("(", r"\(").replace(")", r"\)")):
        chunk_sizes(layers, pp, vpp, split, mtp)


def test_format_layout_reads_back():
    for sizes in [(0, 1, 1, 1, 0), (3, 2, 2, 2, 1), (0, 4), (2,)]:
        text = format_layout(sizes, mtp_num_layers=1)
        assert tuple(chunk.count("t") for chunk in parse_layout_string(text)) == sizes
        assert chunk_sizes(sum(sizes), len(sizes), 1, PipelineSplit(layout=text), 1) == sizes


def test_label_round_trips_every_placement_option():
    configs = [
        ParallelConfig(64, pp=32, vpp=3, ep=2, account_for_embedding_in_pipeline_split=True,
                       account_for_loss_in_pipeline_split=True, overlap_moe_expert_parallel_comm=True),
        ParallelConfig(64, pp=4, decoder_first_pipeline_num_layers=3, decoder_last_pipeline_num_layers=0),
        ParallelConfig(64, pp=16, vpp=2, pipeline_layout="Et*3|(tt|)*29,m|L"),
        ParallelConfig(8, pp=2, account_for_loss_in_pipeline_split=True),
    ]
    for c in configs:
        assert ParallelConfig.parse(c.label()) == c, c.label()
        assert ParallelConfig.from_dict(c.to_dict()) == c
    assert configs[2].pipeline_layout == "Et*3|(tt|)*29m|L"  # cosmetic commas dropped
    # a pasted Megatron string keeps its commas; the layout fixes vpp = 32 chunks / pp 16
    parsed = ParallelConfig.parse("pp16, layout=Et*3|(tt|)*29,m|L dp4")
    assert parsed.vpp == 2 and parsed.pipeline_layout == "Et*3|(tt|)*29m|L"


@pytest.mark.parametrize("fields,why", [
    (dict(pp=2, pipeline_layout="Et|tL", decoder_first_pipeline_num_layers=1), "excludes decoder_first"),
    (dict(pp=2, decoder_first_pipeline_num_layers=1, account_for_loss_in_pipeline_split=True), "exclude account_for"),
    (dict(pp=2, pipeline_layout="Et|tQL"), "unknown symbol 'Q'"),
    (dict(pp=2, decoder_last_pipeline_num_layers=-1), "must be an integer >= 0"),
])
def test_contradictory_options_are_refused(fields, why):
    with pytest.raises(InvalidConfigError, match=why.replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig(8, **fields)


def test_a_layout_string_of_other_chunks_than_pp_vpp_breaks_the_pipeline_chunks_rule():
    config = ParallelConfig(8, pp=2, pipeline_layout="Et|t|tL")  # builds: the rule book judges it
    assert [(r.rule, r.reason) for r in layout_rejections(config)] == [
        ("pipeline_chunks", "pipeline_layout has 3 chunks; pp·vpp = 2·1 = 2 (vpp = chunks / pp)")]
    assert layout_rejections(config.replace(world_size=9, pp=3)) == []


def test_layers_pp_rule_names_the_placement_problem():
    model = get_model("deepseek-v3")  # 61 layers + 1 MTP layer
    v = Validator(model, TrainingSpec(seq_length=4096, global_batch_size=1024), ClusterSpec(get_hardware("h100-sxm"), 512))
    ok = ParallelConfig(512, pp=16, vpp=2, ep=32, pipeline_layout="Et*3|(tt|)*28,t|t|mL")
    assert v.check(ok) == []
    # Megatron's own example puts MTP on a stage of its own: foldtune runs MTP with the loss
    standalone = ok.replace(pipeline_layout="Et*3|(tt|)*29,m|L")
    rules = v.check(standalone)
    assert [r.rule for r in rules] == ["layers_pp"] and "directly precede the loss" in rules[0].reason
    uneven = ParallelConfig(512, pp=16, ep=32, decoder_first_pipeline_num_layers=3, decoder_last_pipeline_num_layers=2)
    assert v.check(uneven) == []  # 56 layers over the 14 middle ranks: 4 each
    assert pipeline_split(61, 16, 1, uneven.pipeline_split, 1) == (3,) + (4,) * 14 + (2,)
    bad = uneven.replace(decoder_last_pipeline_num_layers=3)
    assert "do not split evenly" in v.check(bad)[0].reason
