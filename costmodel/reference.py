"""Published end-to-end measurements (shared/validation/reference.json) as cost-model predictions.

Each function takes one table of the reference file and the hardware profile to price it with, and returns
``(label, predicted, published)`` rows. The tables describe Megatron/NeMo runs, so every training spec here
sets ``gradient_accumulation_fusion`` (Megatron's fused weight-gradient accumulation) and
``sequence_parallel_regather`` (Megatron all-gathers a sequence-parallel input again for the weight gradient),
and the fp8 tables ``transformer_engine_fp8`` (Transformer Engine's fp8 casts).
Nothing in the cost model is fitted to these rows: they are what its error is published against
(tests/costmodel, bench/validate_reference.py).
"""

from __future__ import annotations

from dataclasses import replace

from spec.catalog import get_hardware
from spec.hardware import ClusterSpec, HardwareProfile
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from costmodel.step_time import estimate_step_time, layer_times
from spec.training_spec import TrainingSpec

Row = tuple[str, float, float]


def nemo_model(name: str, dims: dict) -> ModelSpec:
    """A NeMo 24.07 performance-recipe model (GPT-3 or Llama) from the reference file's dimensions."""
    gpt = name.startswith("gpt3")
    return ModelSpec(name=name, num_layers=dims["layers"], hidden_size=dims["hidden"],
                     num_attention_heads=dims["heads"], num_query_groups=dims.get("kv_heads"),
                     ffn_hidden_size=dims["ffn"], vocab_size=dims["vocab"], swiglu=dims.get("swiglu", False),
                     normalization="layernorm" if gpt else "rmsnorm", add_bias_linear=gpt, add_qkv_bias=gpt,
                     position_embedding_type="learned_absolute" if gpt else "rope", max_position_embeddings=8192)


def nemo_rows(table: dict, hardware: HardwareProfile) -> list[Row]:
    """(label, predicted tokens/s/GPU, published) for the NeMo 24.07 fp8 H100 dense rows."""
    out = []
    for values in table["rows"]:
        r = dict(zip(table["columns"], values))
        model = nemo_model(r["model"], table["models"][r["model"]])
        training = TrainingSpec(seq_length=r["seq"], global_batch_size=r["gbs"], precision="fp8",
                                gradient_accumulation_fusion=True, sequence_parallel_regather=True,
                                transformer_engine_fp8=True)
        # NeMo's performance recipes run SP with TP comm overlap, the distributed optimizer and both DP overlaps
        config = ParallelConfig(world_size=r["gpus"], tp=r["tp"], pp=r["pp"], cp=r["cp"], vpp=r["vpp"],
                                micro_batch_size=r["mbs"], tp_comm_overlap=r["tp"] > 1)
        b = estimate_step_time(model, training, ClusterSpec(hardware, r["gpus"]), config)
        out.append((f"{r['model']} {r['gpus']}gpu {config.label()}", b.tokens_per_s_per_gpu, r["tokens_per_gpu_s"]))
    return out


def korthikanti_rows(table: dict, hardware: HardwareProfile) -> list[Row]:
    """(label, predicted s/iteration, published) for the A100 fp16 rows of arXiv 2205.05198."""
    out = []
    for r in table["rows"]:
        model = ModelSpec(name=r["model"], num_layers=r["layers"], hidden_size=r["hidden"],
                          num_attention_heads=r["heads"], ffn_hidden_size=4 * r["hidden"], vocab_size=table["vocab"],
                          swiglu=False, normalization="layernorm", add_bias_linear=True, add_qkv_bias=True,
                          position_embedding_type="learned_absolute", max_position_embeddings=table["seq"],
                          attention_dropout=0.1, hidden_dropout=0.1)
        # 2022 Megatron: unfused softmax attention, no TP comm overlap
        training = TrainingSpec(seq_length=table["seq"], global_batch_size=r["gbs"], precision="fp16",
                                flash_attention=False, gradient_accumulation_fusion=True,
                                sequence_parallel_regather=True)
        for mode, knobs in (("full_recompute", dict(sequence_parallel=False, recompute_granularity="full")),
                            ("sp_selective", dict(sequence_parallel=True, recompute_granularity="selective"))):
            config = ParallelConfig(world_size=r["gpus"], tp=r["tp"], pp=r["pp"], vpp=r["vpp"] or 1,
                                    micro_batch_size=r["mbs"], **knobs)
            b = estimate_step_time(model, training, ClusterSpec(hardware, r["gpus"]), config)
            out.append((f"{r['model']} {mode}", b.step_time, r["iter_s"][mode]))
    return out


def moe_layer_rows(table: dict, hardware: HardwareProfile) -> list[Row]:
    """(label, predicted ms, published ms) for Megatron's single MoE layer on 8xH100 (TP1 EP8, forward/backward)."""
    out = []
    for r in table["rows"]:
        dims = table["layers"][r["layer"]]
        model = ModelSpec(name=r["layer"], num_layers=1, hidden_size=dims["hidden"], num_attention_heads=32,
                          ffn_hidden_size=dims["moe_ffn"], vocab_size=32000, num_experts=dims["experts"],
                          moe_router_topk=dims["topk"], moe_ffn_hidden_size=dims["moe_ffn"],
                          moe_shared_expert_intermediate_size=dims.get("shared_ffn"))
        training = TrainingSpec(seq_length=table["seq"], global_batch_size=8, precision=r["dtype"],
                                gradient_accumulation_fusion=True, sequence_parallel_regather=True,
                                transformer_engine_fp8=True)
        part = layer_times(model, training, ClusterSpec(hardware, 8), ParallelConfig(world_size=8, ep=table["ep"]))["moe"]
        out.append((f"{r['layer']} {r['dtype']} fwd", part.fwd_time * 1e3, r["fwd_ms"]))
        out.append((f"{r['layer']} {r['dtype']} bwd", part.bwd_time * 1e3, r["bwd_ms"]))
    return out


def calibrated(base: HardwareProfile, measured: HardwareProfile | None) -> HardwareProfile:
    """``base`` with the compute-side fractions of ``measured`` (None: ``base`` unchanged): GEMM, grouped-GEMM
    and attention efficiency curves, HBM efficiency, overlap interference and sustained clock. Network and
    host-launch figures stay ``base``'s: a calibration on foldtune's executor describes its own host, not
    Megatron's. Fractions are of the datasheet peak, so a curve measured on one GH100 card prices another."""
    if measured is None:
        return base
    return replace(base, name=f"{base.name}+{measured.name}", gemm_efficiency=measured.gemm_efficiency,
                   gemm_bwd_efficiency=measured.gemm_bwd_efficiency,
                   grouped_gemm_efficiency=measured.grouped_gemm_efficiency, hbm_efficiency=measured.hbm_efficiency,
                   grouped_gemm_shape_efficiency=measured.grouped_gemm_shape_efficiency,
                   attention_fwd_efficiency=measured.attention_fwd_efficiency,
                   attention_bwd_efficiency=measured.attention_bwd_efficiency,
                   overlap_slowdown=measured.overlap_slowdown,
                   sustained_clock_factor=measured.sustained_clock_factor,
                   source=f"{base.source} + compute of {measured.source}")


def tables(ref: dict, bf16: HardwareProfile | None, fp8: HardwareProfile | None) -> list[dict]:
    """One entry per table of the reference file ``ref``: its ``title``, error ``band`` (None: no bar) and rows
    (label, predicted, published) priced on the datasheet profile and on it with the compute fractions of the
    ``bf16`` / ``fp8`` calibrations (``calibrated``: None where no calibration applies)."""
    h100, a100 = get_hardware("h100-sxm"), get_hardware("a100-80gb")
    out = []
    nemo = ref["nemo_24_07_h100_dense"]
    out.append({"title": "NeMo 24.07 fp8 H100 dense, tokens/s/GPU", "band": 0.15,
                "datasheet": nemo_rows(nemo, h100),
                "calibrated": nemo_rows(nemo, calibrated(h100, fp8)) if fp8 else None})
    kor = ref["korthikanti2022"]
    out.append({"title": "Korthikanti 2022 A100 fp16, s/iteration (no A100 calibration)", "band": None,
                "datasheet": korthikanti_rows(kor, a100), "calibrated": None})
    moe = ref["megatron_moe_layer_8xh100"]
    rows = moe_layer_rows(moe, h100)
    cal = None
    if bf16 or fp8:
        by_dtype = {"bf16": calibrated(h100, bf16), "fp8": calibrated(h100, fp8)}
        cal = []
        for dtype, hw in by_dtype.items():
            sub = {**moe, "rows": [r for r in moe["rows"] if r["dtype"] == dtype]}
            cal += moe_layer_rows(sub, hw)
        order = {label: i for i, (label, _, _) in enumerate(rows)}
        cal.sort(key=lambda r: order[r[0]])
    out.append({"title": "Megatron MoE layer 8xH100 TP1 EP8, ms", "band": None, "datasheet": rows, "calibrated": cal})
    return out
