"""Published Megatron-Core runs with their full recipes, as foldtune prices them.

Each :class:`PublishedRun` is one run that NVIDIA published (a layout that ran, and where stated the throughput it
reached), written as foldtune's specs: the catalog model, the GPU and its count, a layout label and the
``TrainingSpec`` fields of the recipe. :data:`MEMORY_RUNS` are the five layouts that ran on 80 GB H100s (and
one variant with DeepSeek-V3's own fp8 recipe): ``foldtune plan --explain`` must find them fitting
(tests/costmodel/test_published_memory.py). :data:`HEADLINE_RUNS` are the seeds' headline figures
(``python -m bench.headline_figures`` prices them). These rows check the cost model; none of its constants comes
from them.

Every run is Megatron-Core with Transformer Engine, so each sets the switches that price Megatron's implementation
where it differs from foldtune's executor (:data:`MEGATRON_CORE`). Where a recipe used a Megatron feature foldtune
does not price, ``unpriced`` names it (the flex dispatchers DeepEP and HybridEP, CUDA graphs, fine-grained
activation offloading, optimizer-state offloading between steps): the layout is priced without it.

Sources, all public (read at the commits named):
- Megatron-Bridge (github.com/NVIDIA-NeMo/Megatron-Bridge) ``docs/performance-summary-archive.md`` (the 25.09 and
  25.11 H100 rows) and its performance recipes of release 0.2 (branch r0.2.0):
  ``scripts/performance/configs/qwen3/workload_base_configs.py`` and ``qwen3_llm_pretrain.py``
  (``set_qwen3_common_configs``: no recompute, ``grad_reduce_in_fp32 = False``),
  ``scripts/performance/configs/deepseek/workload_base_configs.py`` and ``deepseek_llm_pretrain.py``
  (``layout="Et|(tt|)*30mL"``, ``recompute_modules=["mla_up_proj", "mlp"]``), ``scripts/performance/utils/helpers.py``
  (``cross_entropy_fusion_impl = "te"``, ``fp8_cs``: current scaling), ``src/megatron/bridge/recipes/qwen/qwen3_moe.py``
  (the distributed optimizer; Qwen3-235B accounts the embedding and the loss as pipeline layers),
  ``src/megatron/bridge/models/qwen/qwen_provider.py`` (``moe_permute_fusion``) and ``models/gpt_provider.py``
  (``gradient_accumulation_fusion``).
- Megatron-MoE-ModelZoo (NVIDIA's MoE team), read at commit e865051 of yanring/Megatron-MoE-ModelZoo:
  ``best_practice/qwen3/readme.md`` and ``run_h100_235b.sh``, ``run_gb200_235b.sh``, ``run_gb300_235b.sh``;
  ``best_practice/deepseek-v3/run_deepseek_v3_h100.sh``, ``run_deepseek_v3_gb200.sh``, ``run_deepseek_v3_gb300.sh``;
  ``model_configs/benchmarking/*.yaml`` (distributed optimizer, ``--cross-entropy-fusion-impl``, embedding and
  loss accounting, ``--moe-permute-fusion``) and ``sbatch_benchmarking.sh`` (``PR=fp8``: blockwise, fp8 primary
  weights, bf16 Adam moments, fp32 main grads; ``PR=mxfp8`` likewise with mxfp8); and, as it stood when the
  folding paper came out (commit 78fd4d6 of yanring/Megatron-MoE-ModelZoo),
  ``runtime_configs/benchmarking/runtime.conf`` (the Mixtral-8x22B and Qwen2-57B layouts).
- The headline figures: arXiv 2603.07685 (Megatron-Core MoE: DeepSeek-V3 1,233 / 1,048 TFLOPS/GPU on GB300 /
  GB200, Qwen3-235B 974 / 919) and arXiv 2504.14960 (MoE Parallel Folding: 49.3 % / 39.0 % MFU for Mixtral-8x22B /
  Qwen2-57B-A14B on H100). The report's own configuration table was not in the stored corpus; its layouts are the
  ModelZoo's reproduction scripts for the same systems (the one for Qwen3-235B on GB200 names its 919 TFLOPS).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

#: The switches that price Megatron-Core's implementation where it differs from foldtune's executor (every run
#: here is Megatron-Core with Transformer Engine): its fused weight-gradient accumulation (Megatron's default),
#: its sequence-parallel linears, its loss and its saved tensors.
MEGATRON_CORE: dict[str, Any] = {"gradient_accumulation_fusion": True, "sequence_parallel_regather": True,
                                 "megatron_cross_entropy": True, "megatron_memory": True}
#: fp8 through Transformer Engine with current (tensorwise) scaling: Megatron-Bridge's ``fp8_cs``.
TE_FP8_CS: dict[str, Any] = {"precision": "fp8", "transformer_engine_fp8": True, "fp8_recipe": "tensorwise"}
#: The ModelZoo's ``PR=fp8`` (DeepSeek-V3's recipe) and ``PR=mxfp8``: Transformer Engine's blockwise or mxfp8
#: scaling, fp8 primary weights, fp32 main grads; its bf16 Adam moments (the precision-aware optimizer) are the
#: layout's (:data:`MODELZOO_MOMENTS`).
MODELZOO_FP8: dict[str, Any] = {"precision": "fp8", "transformer_engine_fp8": True, "fp8_recipe": "blockwise",
                                "fp8_param_gather": True}
MODELZOO_MXFP8: dict[str, Any] = {**MODELZOO_FP8, "fp8_recipe": "mxfp8"}
#: The ModelZoo's optimizer state (``--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype
#: bf16``, fp32 master weights): ParallelConfig fields of its layouts.
MODELZOO_MOMENTS: dict[str, Any] = {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}
#: Megatron-Bridge's performance recipes reduce and accumulate gradients in bf16 (``grad_reduce_in_fp32 =
#: False``); Megatron-LM's default with bf16 (the ModelZoo) accumulates them in fp32.
BRIDGE_GRADS: dict[str, Any] = {"main_grads_fp32": False}


@dataclass(frozen=True)
class PublishedRun:
    """One published run: ``model`` (catalog name) on ``gpus`` × ``gpu`` (catalog hardware), its ``layout``
    (ParallelConfig fields), the ``training`` fields of its recipe (TrainingSpec keyword arguments), where it comes
    from, what it reached (``published``: 'tflops_per_gpu' or 'mfu'; empty: a layout that ran, no figure used here)
    and the recipe's Megatron features foldtune does not price (``unpriced``). ``nvlink_domain``: the GPUs of one
    NVLink domain the run's allocation kept together, where it is smaller than the system's (the ModelZoo's GB200
    and GB300 scripts ask Slurm for segments of EP·TP/4 four-GPU trays of one NVL72 rack: ``SEGMENT``); None: the
    catalog's node."""

    key: str
    model: str
    gpu: str
    gpus: int
    layout: tuple[tuple[str, Any], ...]
    training: tuple[tuple[str, Any], ...]
    source: str
    published: tuple[tuple[str, float], ...] = ()
    unpriced: tuple[str, ...] = ()
    nvlink_domain: int | None = None

    def specs(self) -> tuple[ModelSpec, TrainingSpec, ClusterSpec, ParallelConfig]:
        """(model, training, cluster, layout) as foldtune prices the run."""
        hardware = get_hardware(self.gpu)
        if self.nvlink_domain is not None:
            hardware = replace(hardware, gpus_per_node=self.nvlink_domain, nics_per_node=None)
        return (get_model(self.model), TrainingSpec(**dict(self.training)), ClusterSpec(hardware, self.gpus),
                ParallelConfig(world_size=self.gpus, **dict(self.layout)))

    def figure(self, name: str) -> float | None:
        """The published figure ``name`` ('tflops_per_gpu', 'mfu'), or None."""
        return dict(self.published).get(name)


def _training(seq: int, gbs: int, **fields: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted({"seq_length": seq, "global_batch_size": gbs, **MEGATRON_CORE, **fields}.items()))


def _layout(**fields: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(fields.items()))


_EMBEDDING_AND_LOSS = {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}
_EP_OVERLAP = {"overlap_moe_expert_parallel_comm": True}


_DEEPSEEK_H100 = _layout(tp=2, pp=8, vpp=4, ep=64, recompute_granularity="selective",
                         recompute_modules=("mla_up_proj", "mlp"), pipeline_layout="Et|(tt|)*30mL", **_EP_OVERLAP)
_DEEPSEEK_GB = {"recompute_granularity": "selective", "recompute_modules": ("mlp",),
                "pipeline_layout": "Et*4|(tttt|)*14tmL"}

MEMORY_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        "qwen3-30b-a3b-h100-fp8", "qwen3-30b-a3b", "h100-sxm", 16, _layout(pp=2, vpp=24, ep=8, micro_batch_size=2),
        _training(4096, 512, cross_entropy_fusion_impl="te", **TE_FP8_CS, **BRIDGE_GRADS),
        "Megatron-Bridge 25.11, DGX-H100 (docs/performance-summary-archive.md; recipe r0.2.0 "
        "QWEN3_30B_A3B_H100_FP8_CS_BASE_CONFIG: pp2, ep8, mbs2, gbs 512, no recompute)",
        (("tflops_per_gpu", 121.0),)),
    PublishedRun(
        "qwen3-235b-a22b-h100-fp8", "qwen3-235b-a22b", "h100-sxm", 256,
        _layout(tp=2, pp=8, vpp=4, ep=32, **_EP_OVERLAP, **_EMBEDDING_AND_LOSS),
        _training(4096, 2048, cross_entropy_fusion_impl="te", **TE_FP8_CS, **BRIDGE_GRADS),
        "Megatron-Bridge 25.11, DGX-H100 (recipe r0.2.0 QWEN3_235B_A22B_H100_FP8_CS_BASE_CONFIG: moe_a2a_overlap, "
        "gbs 2048; the embedding and the loss accounted as pipeline layers by the base recipe)",
        (("tflops_per_gpu", 233.0),)),
    PublishedRun(
        "qwen3-235b-a22b-h100-bf16", "qwen3-235b-a22b", "h100-sxm", 256,
        _layout(tp=2, pp=8, vpp=4, ep=32, **_EP_OVERLAP, **_EMBEDDING_AND_LOSS),
        _training(4096, 2048, precision="bf16", cross_entropy_fusion_impl="te", **BRIDGE_GRADS),
        "Megatron-Bridge release 0.2 recipe QWEN3_235B_A22B_H100_BF16_BASE_CONFIG (the layout of the fp8 one, bf16)"),
    PublishedRun(
        "qwen3-235b-a22b-h100-pp32", "qwen3-235b-a22b", "h100-sxm", 256,
        _layout(tp=2, pp=32, vpp=3, ep=8, recompute_granularity="selective",
                recompute_modules=("layernorm", "moe_act"), **_EMBEDDING_AND_LOSS),
        _training(4096, 2048, precision="bf16", cross_entropy_fusion_impl="te"),
        "Megatron-MoE-ModelZoo best_practice/qwen3/readme.md, H100 intra-node EP row (A2A dispatcher, recompute norm "
        "and act, 200 TFLOPS/GPU); model_configs/benchmarking/Qwen3-235B-A22B.yaml",
        (("tflops_per_gpu", 200.0),)),
    PublishedRun(
        "deepseek-v3-h100-fp8", "deepseek-v3", "h100-sxm", 1024,
        _DEEPSEEK_H100,
        _training(4096, 8192, cross_entropy_fusion_impl="te", **TE_FP8_CS, **BRIDGE_GRADS),
        "Megatron-Bridge 25.09, DGX-H100, dropless (338 TFLOPS/GPU with current scaling); recipe r0.2.0 "
        "DEEPSEEK_V3_H100_BASE_CONFIG and deepseek_v3_h100_config",
        (("tflops_per_gpu", 338.0),), ("DeepEP flex dispatcher (priced as alltoall)",)),
    PublishedRun(
        "deepseek-v3-h100-modelzoo", "deepseek-v3", "h100-sxm", 1024,
        _layout(**dict(_DEEPSEEK_H100), **MODELZOO_MOMENTS),
        _training(4096, 8192, **MODELZOO_FP8),
        "Megatron-MoE-ModelZoo best_practice/deepseek-v3/run_deepseek_v3_h100.sh (PR=fp8: blockwise, "
        "--fp8-param-gather, bf16 moments; native fused loss)",
        (), ("DeepEP flex dispatcher (priced as alltoall)",)),
)

HEADLINE_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        "deepseek-v3-gb300", "deepseek-v3", "gb300", 128,
        _layout(pp=4, vpp=4, ep=32, **_DEEPSEEK_GB, **MODELZOO_MOMENTS),
        _training(4096, 4096, **MODELZOO_MXFP8),
        "arXiv 2603.07685 (1,233 TFLOPS/GPU); layout: ModelZoo run_deepseek_v3_gb300.sh",
        (("tflops_per_gpu", 1233.0),), ("HybridEP flex dispatcher (priced as alltoall)", "CUDA graphs"),
        nvlink_domain=32),
    PublishedRun(
        "deepseek-v3-gb200", "deepseek-v3", "gb200", 256,
        _layout(pp=4, vpp=4, ep=64, **_DEEPSEEK_GB, **MODELZOO_MOMENTS),
        _training(4096, 8192, **MODELZOO_MXFP8),
        "arXiv 2603.07685 (1,048 TFLOPS/GPU); layout: ModelZoo run_deepseek_v3_gb200.sh",
        (("tflops_per_gpu", 1048.0),),
        ("HybridEP flex dispatcher (priced as alltoall)", "CUDA graphs",
         "optimizer states offloaded between steps (--offload-optimizer-states)"), nvlink_domain=64),
    PublishedRun(
        "qwen3-235b-a22b-gb300", "qwen3-235b-a22b", "gb300", 64,
        _layout(ep=64, **_EP_OVERLAP, **MODELZOO_MOMENTS),
        _training(4096, 8192, **MODELZOO_MXFP8),
        "arXiv 2603.07685 (974 TFLOPS/GPU); layout: ModelZoo run_gb300_235b.sh (which reports 1,055 for it)",
        (("tflops_per_gpu", 974.0),), ("HybridEP flex dispatcher (priced as alltoall)", "CUDA graphs"),
        nvlink_domain=64),
    PublishedRun(
        "qwen3-235b-a22b-gb200", "qwen3-235b-a22b", "gb200", 256,
        _layout(pp=4, vpp=6, ep=64, micro_batch_size=3, recompute_granularity="selective",
                recompute_modules=("moe_act", "layernorm"), **_EP_OVERLAP, **_EMBEDDING_AND_LOSS,
                **MODELZOO_MOMENTS),
        _training(4096, 3072, **MODELZOO_MXFP8),
        "arXiv 2603.07685 (919 TFLOPS/GPU); layout: ModelZoo run_gb200_235b.sh and best_practice/qwen3/readme.md "
        "(GB200 MXFP8 row, 919 TFLOPS)",
        (("tflops_per_gpu", 919.0),),
        ("HybridEP flex dispatcher (priced as alltoall)", "CUDA graphs",
         "fine-grained activation offloading of expert_fc1 and moe_act"), nvlink_domain=64),
    PublishedRun(
        "mixtral-8x22b-h100", "mixtral-8x22b", "h100-sxm", 128, _layout(tp=2, pp=8, ep=8, tp_comm_overlap=True),
        _training(4096, 256, precision="bf16"),
        "arXiv 2504.14960 (49.3 % MFU); layout: ModelZoo runtime.conf at 78fd4d6 (TP2 PP8 EP8, GBS 256, 16 nodes)",
        (("mfu", 0.493),)),
    PublishedRun(
        "qwen2-57b-a14b-h100", "qwen2-57b-a14b", "h100-sxm", 64, _layout(tp=2, pp=4, vpp=7, ep=4),
        _training(4096, 256, precision="bf16"),
        "arXiv 2504.14960 (39.0 % MFU); layout: ModelZoo runtime.conf at 78fd4d6 (TP2 PP4 VPP7 EP4, GBS 256, 8 nodes)",
        (("mfu", 0.390),), ("the shared expert's overlap with the dispatch (--moe-shared-expert-overlap)",)),
)


def published_run(key: str) -> PublishedRun:
    """The run called ``key`` in :data:`MEMORY_RUNS` or :data:`HEADLINE_RUNS` (KeyError when there is none)."""
    for run in MEMORY_RUNS + HEADLINE_RUNS:
        if run.key == key:
            return run
    raise KeyError(key)


def implied_step_seconds(run: PublishedRun, tflops_per_gpu: float, mfu: float, step_seconds: float) -> float | None:
    """The step time (seconds) the run's published figure implies for the FLOPs the cost model counts: its
    predicted ``step_seconds`` times the predicted rate over the published one (TFLOP/s per GPU, else MFU against
    the same peak); None when the run publishes neither."""
    published = run.figure("tflops_per_gpu")
    if published:
        return step_seconds * tflops_per_gpu / published
    published = run.figure("mfu")
    if published:
        return step_seconds * mfu / published
    return None


def closing_factors(terms: tuple[tuple[str, float], ...], step_seconds: float,
                    target_seconds: float) -> tuple[tuple[str, float, float | None], ...]:
    """(term, exposed seconds, factor) per term of a step-time breakdown with seconds: the factor on that term
    alone that would move the predicted step (``step_seconds``) onto ``target_seconds``, i.e.
    ``(seconds + target − step) / seconds``; None where no positive factor on the term can (it is smaller than a
    prediction that is too slow)."""
    out = []
    for name, seconds in terms:
        if seconds <= 0:
            continue
        factor = (seconds + target_seconds - step_seconds) / seconds
        out.append((name, seconds, factor if factor > 0 else None))
    return tuple(out)
