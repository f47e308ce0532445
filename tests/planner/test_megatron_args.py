"""Megatron-LM arguments of a layout, including the uneven pipeline layout string."""

from __future__ import annotations

import re

from spec.catalog import get_model
from spec.pipeline_layout import layer_chunks
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from planner.megatron_args import format_megatron_args, megatron_args, pipeline_layout


def expand(layout: str) -> list[str]:
    """Read a layout string the way its documentation describes: '(x)*n' and 'c*n' repeat, '|' splits chunks."""
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout.replace(",", ""))
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def test_uneven_layout_string_places_every_layer_like_layer_chunks():
    for layers, pp, vpp, mtp in [(61, 16, 1, 1), (61, 8, 2, 1), (94, 8, 4, 0), (56, 4, 3, 0), (5, 2, 2, 0)]:
        chunks = expand(pipeline_layout(layers, pp, vpp, mtp))
        assert len(chunks) == pp * vpp
        want = layer_chunks(layers, pp, vpp)
        for j, chunk in enumerate(chunks):
            assert chunk.count("t") == len(want[j % pp][j // pp])
        assert chunks[0].startswith("E") and chunks[-1].endswith("m" * mtp + "L")
        assert "".join(chunks).count("E") == 1 and "".join(chunks).count("L") == 1


def flags(args: list[list[str]]) -> dict[str, list[str]]:
    return {a[0]: a[1:] for a in args}


def test_args_of_an_interleaved_moe_layout():
    model = get_model("mixtral-8x22b")  # 56 layers
    training = TrainingSpec(seq_length=4096, global_batch_size=256)
    cfg = ParallelConfig(128, tp=2, pp=4, vpp=2, ep=8, etp=1, micro_batch_size=1, recompute_granularity="selective",
                         recompute_modules=("core_attn", "moe_act", "layernorm"))
    f = flags(megatron_args(cfg, model, training))
    assert f["--tensor-model-parallel-size"] == ["2"] and f["--pipeline-model-parallel-size"] == ["4"]
    assert f["--num-virtual-stages-per-pipeline-rank"] == ["2"] and "--pipeline-model-parallel-layout" not in f
    assert f["--expert-model-parallel-size"] == ["8"] and f["--expert-tensor-parallel-size"] == ["1"]
    assert f["--context-parallel-size"] == ["1"] and "--sequence-parallel" in f
    assert f["--micro-batch-size"] == ["1"] and f["--global-batch-size"] == ["256"] and f["--seq-length"] == ["4096"]
    assert f["--recompute-granularity"] == ["selective"]
    assert f["--recompute-modules"] == ["core_attn", "moe_act", "layernorm"]
    assert f["--moe-token-dispatcher-type"] == ["alltoall"] and "--moe-grouped-gemm" in f
    assert "--use-distributed-optimizer" in f and "--overlap-grad-reduce" in f and "--overlap-param-gather" in f
    assert "--bf16" in f


def test_args_of_full_recompute_uneven_pp_capacity_fp8_and_plain_optimizer():
    model = get_model("deepseek-v3")
    training = TrainingSpec(seq_length=4096, global_batch_size=8192, precision="fp8", routing_mode="capacity",
                            moe_expert_capacity_factor=1.25)
    cfg = ParallelConfig(1024, tp=1, pp=16, ep=64, micro_batch_size=1, recompute_granularity="full",
                         moe_token_dispatcher_type="allgather", use_distributed_optimizer=False,
                         overlap_param_gather=False)
    f = flags(megatron_args(cfg, model, training))
    assert f["--pipeline-model-parallel-layout"] == [pipeline_layout(61, 16, 1, 1)]
    assert "--num-virtual-stages-per-pipeline-rank" not in f and "--sequence-parallel" not in f
    assert f["--recompute-granularity"] == ["full"] and f["--recompute-method"] == ["uniform"]
    assert f["--recompute-num-layers"] == ["1"]
    assert f["--moe-token-dispatcher-type"] == ["allgather"] and f["--moe-expert-capacity-factor"] == ["1.25"]
    assert "--use-distributed-optimizer" not in f and "--overlap-param-gather" not in f
    assert f["--fp8-format"] == ["hybrid"] and "--bf16" in f
    text = format_megatron_args(cfg, model, training)
    assert text.startswith("--tensor-model-parallel-size 1 \\\n--pipeline-model-parallel-size 16")
    # the layout holds shell metacharacters ('|', '(', '*'): quoted, it survives a shell as one argument
    import shlex
    words = shlex.split(text.replace("\\\n", " "))
    assert words[words.index("--pipeline-model-parallel-layout") + 1] == pipeline_layout(61, 16, 1, 1)


def test_cp_comm_type_is_spelled_out_with_cp_in_megatrons_words():
    model, training = get_model("mixtral-8x22b"), TrainingSpec(seq_length=131072, global_batch_size=64)
    spelled = {}
    for label in ("cp4", "cp4 cp_comm=p2p", "cp4 cp_comm=a2a", "cp4 cp_comm=a2a+p2p:2x2"):
        got = flags(megatron_args(ParallelConfig.parse(label, world_size=64), model, training))
        spelled[label] = (got["--cp-comm-type"], got.get("--hierarchical-context-parallel-sizes"))
    # foldtune's default (allgather) is not Megatron's (p2p): always given
    assert spelled == {"cp4": (["all_gather"], None), "cp4 cp_comm=p2p": (["p2p"], None),
                       "cp4 cp_comm=a2a": (["a2a"], None), "cp4 cp_comm=a2a+p2p:2x2": (["a2a+p2p"], ["2", "2"])}
    assert "--cp-comm-type" not in flags(megatron_args(ParallelConfig(64, tp=8), model, training))


def test_shared_expert_overlap_is_megatrons_flag():
    model = get_model("deepseek-v2-lite")
    training = TrainingSpec(seq_length=4096, global_batch_size=64)
    cfg = ParallelConfig(16, ep=16)
    assert "--moe-shared-expert-overlap" not in flags(megatron_args(cfg, model, training))
    f = flags(megatron_args(cfg.replace(moe_shared_expert_overlap=True), model, training))
    assert "--moe-shared-expert-overlap" in f and "--overlap-moe-expert-parallel-comm" not in f


def test_cuda_graphs_export_megatrons_graph_scopes():
    """Megatron's Transformer Engine graphs with the scopes foldtune captures: the attention ('attn') and, in an
    MoE model, the router with the pre-MLP norm and the shared experts ('moe_router'); only 'attn' where the MoE
    block is recomputed, and nothing with the knob off."""
    model = get_model("deepseek-v2-lite")
    training = TrainingSpec(seq_length=4096, global_batch_size=64)
    cfg = ParallelConfig(16, ep=16)
    assert "--cuda-graph-impl" not in flags(megatron_args(cfg, model, training))
    f = flags(megatron_args(cfg.replace(cuda_graphs=True), model, training))
    assert f["--cuda-graph-impl"] == ["transformer_engine"] and f["--cuda-graph-scope"] == ["attn", "moe_router"]
    recomputed = cfg.replace(cuda_graphs=True, recompute_granularity="selective", recompute_modules=("moe",))
    assert flags(megatron_args(recomputed, model, training))["--cuda-graph-scope"] == ["attn"]
    assert "--cuda-graph-scope attn moe_router" in format_megatron_args(cfg.replace(cuda_graphs=True), model,
                                                                        training)
