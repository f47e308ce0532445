"""Tiny random Hugging Face models of every family the executor runs, built offline with transformers' config
classes, and the comparison of their logits and gradients with foldtune's executor.

Routing ties are avoided by construction: every router weight is scaled up (std 0.5 instead of 0.02) so the
router logits of a token differ by O(0.1), and :func:`routing_margin` measures the smallest gap between the
k-th and the (k+1)-th expert score (and between the kept and the dropped group under DeepSeek-V3's group
limit) over the batch; the tests require it to exceed 1e-3, far above fp32 noise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

transformers = __import__("pytest").importorskip("transformers")

VOCAB, HIDDEN, SEQ, BATCH = 256, 64, 16, 2
BASE = dict(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

# family -> (config class name, its keyword arguments)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, norm_topk_prob=False,
                                         mlp_only_layers=[0], rope_parameters=DEFAULT_ROPE)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         head_dim=16, norm_topk_prob=True, rope_parameters=DEFAULT_ROPE)),
    # OLMoE: q/k RMSNorm over all heads at once; its experts' width is intermediate_size
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False,
                                  rope_parameters=DEFAULT_ROPE)),
    "deepseek_v2": ("DeepseekV2Config", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                                             q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                             v_head_dim=16, num_key_value_heads=4, topk_method="greedy",
                                             rope_parameters=DEFAULT_ROPE)),
    "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                                             q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                             v_head_dim=16, num_key_value_heads=4, n_group=2, topk_group=1,
                                             routed_scaling_factor=2.5, num_nextn_predict_layers=0,
                                             rope_parameters=DEFAULT_ROPE)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"rope_type": "default", "rope_theta": 150000.0})),
}


def tiny_hf_model(family: str, seed: int = 0):
    """A transformers model of ``family`` at test widths, every parameter random (norm weights around 1,
    biases, sinks and DeepSeek-V3's expert-score bias included), routers scaled against ties; fp32, eager."""
    cls_name, kwargs = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**BASE, **kwargs})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "e_score_correction_bias" in name:
                p.copy_(0.05 * noise)
            elif name.endswith("sinks"):
                p.copy_(noise)
            elif ".gate.weight" in name or ".router.weight" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.02 * noise if p.dim() > 1 or name.endswith("bias") else noise)
    return model


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) [BATCH, SEQ]: every id distinct, so each embedding row's gradient is one position's."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    return perm[: BATCH * SEQ].view(BATCH, SEQ), perm[BATCH * SEQ: 2 * BATCH * SEQ].view(BATCH, SEQ)


def hf_logits_and_grad(model, ids, labels) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [b, s, V], gradient of the mean cross-entropy w.r.t. the input embeddings [b, s, h])."""
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds).logits.float()
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    return logits.detach(), embeds.grad


def routing_margin(model, ids) -> float:
    """Smallest gap over the batch between the k-th and (k+1)-th expert choice score of every MoE layer (and
    DeepSeek-V3's kept and dropped group score), from the routers' inputs."""
    inputs = []
    routers = [m for n, m in model.named_modules() if n.endswith((".gate", ".router")) and hasattr(m, "weight")]
    hooks = [r.register_forward_pre_hook(lambda m, a: inputs.append((m, a[0].detach()))) for r in routers]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    cfg, margins = model.config, []
    k = cfg.num_experts_per_tok
    for router, x in inputs:
        logits = F.linear(x.reshape(-1, x.shape[-1]).float(), router.weight.float(),
                          getattr(router, "bias", None))
        bias = getattr(router, "e_score_correction_bias", None)
        scores = logits.sigmoid() + bias if bias is not None else logits
        if bias is not None and cfg.n_group > 1:
            groups = scores.view(scores.shape[0], cfg.n_group, -1).topk(2, -1).values.sum(-1).sort(-1, True).values
            margins.append((groups[:, cfg.topk_group - 1] - groups[:, cfg.topk_group]).min().item())
            continue  # the kept group's experts: their own order below would need the mask
        top = scores.sort(-1, descending=True).values
        margins.append((top[:, k - 1] - top[:, k]).min().item())
    return min(margins)
