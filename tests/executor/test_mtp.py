"""Multi-token prediction: the shifted inputs and labels, and the loss against a direct computation from ids."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from spec.catalog import get_model
from executor.data import global_batch
from executor.model import MoEGPT
from executor.mtp import shifted_tokens
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state


def test_shifted_tokens_take_the_next_tokens_and_mask_the_tail():
    tokens = torch.arange(10, 17).unsqueeze(0)  # t_0 .. t_6; ids are t_0..t_5, labels t_1..t_6
    labels = tokens[:, 1:]
    inputs, targets, valid = shifted_tokens(labels, 2)
    assert inputs.tolist() == [[12, 13, 14, 15, 0, 0]]  # t_{i+2}, zero past the end
    assert targets.tolist() == [[13, 14, 15, 16, 0, 0]]  # t_{i+3}
    assert valid.tolist() == [[True, True, True, True, False, False]]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_loss_equals_the_deepseek_v3_formula(depths):
    """Depth k: eh_proj([enorm(Emb(t_{i+k})); hnorm(h_{k-1})]) → layer → final norm → shared head, CE against
    t_{i+k+1} over positions i + k < s; h_0 is the decoder output after the final norm (Megatron's order)."""
    spec = dataclasses.replace(get_model("tiny-moe-shared"), name="tiny-mtp", mtp_num_layers=depths)
    options = ExecutorOptions(moe_aux_loss_coeff=1e-2, mtp_loss_scaling_factor=0.3)
    s = 16
    model = MoEGPT(spec, single_process_state(), options, s)
    batch = global_batch(spec.vocab_size, s, 2, options.seed, 0)  # [b, s + 1] tokens
    ids, labels = batch[:, :-1], batch[:, 1:]
    out = model(ids, labels)

    eps, v = options.norm_epsilon, spec.vocab_size
    rope = (model.rope_cos, model.rope_sin)
    with torch.no_grad():
        x = F.embedding(ids.t(), model.embedding)
        for layer in model.layers:
            x, _ = layer(x, rope)
        h = _rms(x, model.final_norm, eps)
        losses = []
        for k, depth in enumerate(model.mtp.depths, start=1):
            shifted = torch.zeros_like(ids)
            shifted[:, : s - k] = ids[:, k:]  # t_{i+k}, 0 past the end (Megatron's roll)
            e = _rms(F.embedding(shifted.t(), model.embedding), depth.enorm, eps)
            y = torch.cat([e, _rms(h, depth.hnorm, eps)], -1) @ depth.eh_proj.t()
            y, _ = depth.layer(y, rope)
            h = _rms(y, depth.final_norm, eps)
            logits = (h @ model.lm_head.t())[: s - k, :, :v]  # positions with a token k + 1 ahead
            targets = batch[:, k + 1:].t()  # t_{i+k+1}
            losses.append(F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1)))
        expected = torch.stack(losses).mean()

    torch.testing.assert_close(out.mtp_loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss.detach(), out.ce + out.router_loss + 0.3 * out.mtp_loss, rtol=1e-6, atol=1e-6)
    out.loss.backward()  # the MTP loss trains the shared embedding, the head and every MTP parameter
    for name, p in model.mtp.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
