"""Round trip (issue 22, bar 2): HF directory → foldtune under tp2·ep2 (4 gloo processes, one world for several
families) → 5 AdamW steps → export → transformers loads the directory and its logits equal foldtune's (fp32,
rtol 1e-4). The trained logits must also differ from the untrained model's: the steps happened and the export
carries them. In the same world, pp2·ep2 (each stage loads and exports its own layer) with a learning rate of
1e-12: the exported model is the source model."""

from __future__ import annotations

import pytest
import torch

from hf_tiny import batch, hf_logits_and_grad, tiny_hf_model
from spec.parallel_config import ParallelConfig
from executor.hf.roundtrip import RoundTrip, roundtrip_worker
from executor.launch_local import launch

transformers = pytest.importorskip("transformers")
# GQA with a plain SwiGLU router (Mixtral), MLA with group-limited sigmoid routing, the expert bias and shared
# experts (DeepSeek-V3), biases everywhere, sinks, windows and fused interleaved experts (GPT-OSS), a dense
# layer and the gated shared expert (Qwen2-MoE), q/k norms over all heads split over TP (OLMoE)
FAMILIES = ("mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe", "olmoe")


@pytest.mark.slow
def test_hf_to_foldtune_tp2_ep2_to_hf(tmp_path):
    ids, labels = batch(seed=1)
    jobs, before = [], {}
    for family in FAMILIES:
        model = tiny_hf_model(family)
        model.save_pretrained(tmp_path / family)
        before[family] = hf_logits_and_grad(model, ids, labels)[0]
        jobs.append(RoundTrip(ParallelConfig(4, tp=2, ep=2), str(tmp_path / family), str(tmp_path / f"{family}-out"),
                              ids))
    jobs.append(RoundTrip(ParallelConfig(4, pp=2, ep=2), str(tmp_path / "deepseek_v3"), str(tmp_path / "pp-out"),
                          ids, lr=1e-12))
    result = launch(roundtrip_worker, 4, (jobs,), backend="gloo", timeout_s=300, start_method="fork")
    assert result.ok, result.failure_reason
    *trips, pipelined = result.results[0]
    for family, trip in zip(FAMILIES, trips):
        assert len(trip["losses"]) == 5
        exported = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / f"{family}-out", attn_implementation="eager", dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = exported(ids).logits.float()
        torch.testing.assert_close(trip["logits"], theirs, rtol=1e-4, atol=1e-5, msg=family)
        assert (theirs - before[family]).abs().max() > 1e-3, family  # trained, and exported trained
    assert pipelined["logits"] is None and len(pipelined["losses"]) == 5
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pp-out", attn_implementation="eager",
                                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits.float(), before["deepseek_v3"], rtol=1e-4, atol=1e-5)
