"""Selective recompute of MLA's up projections (Megatron's mla_up_proj, with core_attn): the block keeps what the
memory model counts for it, gives the same gradients as without recompute, and re-runs the up projections in
backward (one process, CPU, fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spec import ParallelConfig, TrainingSpec, get_model
from costmodel.memory import layer_activation_bytes
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.saved_tensors import saved_storage_bytes

SEQ, MBS = 16, 2
MLA = dataclasses.replace(get_model("tiny-moe-shared"), name="tiny-mla", num_query_groups=None,
                          multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16,
                          qk_pos_emb_head_dim=8, v_head_dim=12)
UP = ("core_attn", "mla_up_proj")


def _model(modules: tuple[str, ...]) -> tuple[MoEGPT, ParallelConfig]:
    config = ParallelConfig(world_size=1, micro_batch_size=MBS, recompute_granularity="selective" if modules else "none",
                            recompute_modules=modules)
    torch.manual_seed(0)
    return MoEGPT(MLA, build_parallel_state(config, 0), ExecutorOptions(), seq_length=SEQ), config


def _attention_saved(modules: tuple[str, ...]) -> float:
    model, _ = _model(modules)
    attention = model.layers[0].attention
    x = torch.randn(SEQ, MBS, MLA.hidden_size, requires_grad=True)
    rope = (model.rope_cos[:SEQ], model.rope_sin[:SEQ])
    return saved_storage_bytes(lambda: attention(x, rope), [*model.parameters(), *model.buffers()])


def test_up_projection_recompute_drops_what_the_memory_model_drops():
    training = TrainingSpec(seq_length=SEQ, global_batch_size=MBS, precision="fp32")

    def modelled(modules):
        config = _model(modules)[1]
        return sum(v for n, v in layer_activation_bytes(MLA, training, config, False)
                   if n.startswith(("act.attn.", "act.mla.")))

    # the executor and the model drop the same bytes going from core_attn to core_attn + mla_up_proj
    # (q, k after RoPE and the kv up projection's output); what both keep otherwise is test_saved_activations'
    saved_core, saved_up = _attention_saved(("core_attn",)), _attention_saved(UP)
    assert saved_up < saved_core
    assert saved_core - saved_up == pytest.approx(modelled(("core_attn",)) - modelled(UP))


def test_gradients_equal_without_recompute_and_up_projections_rerun():
    grads = []
    calls = []
    for modules in ((), UP):
        model, _ = _model(modules)
        block = model.layers[0].attention
        original = block._qkv
        block._qkv = lambda *a, _f=original: (calls.append(modules), _f(*a))[1]
        ids = torch.randint(0, MLA.vocab_size, (MBS, SEQ), generator=torch.Generator().manual_seed(1))
        model(ids, ids.roll(-1, 1)).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert calls.count(()) == 1 and calls.count(UP) == 2  # forward, then again in backward
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)
