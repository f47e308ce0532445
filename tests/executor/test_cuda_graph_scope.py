"""CUDA graphs of a layer's static part (``cuda_graphs``): the attention half, the router's logits and the shared
experts computed apart from the rest of the MoE block and handed to it.

On CPU the static part runs eagerly through the same split the graphs use (``DecoderLayer.graphed`` set to the
un-captured :class:`executor.cuda_graphs.StaticHalf`): outputs and every gradient equal the plain layer's. On a
GPU the captured and replayed layer equals the eager one over several micro-batches and steps (skipped on CPU).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spec.catalog import get_model
from spec.errors import SpecError
from spec.parallel_config import ParallelConfig
from spec.proxy import proxy_model
from spec.validity import cuda_graph_scope
from executor import cuda_graphs
from executor.attention import rope_tables
from executor.kernels import get_backend
from executor.model import DecoderLayer
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.timing import NULL_TIMER

GATED = dataclasses.replace(get_model("tiny-moe-shared"), moe_shared_expert_gate=True)
MODELS = {"tiny-moe": get_model("tiny-moe"), "tiny-moe-shared-gated": GATED,
          "deepseek-v2-lite@tiny": proxy_model(get_model("deepseek-v2-lite"), 2, "tiny"),
          "qwen3-30b-a3b@tiny": proxy_model(get_model("qwen3-30b-a3b"), 2, "tiny")}


def _layer(spec, options, layer=1, device="cpu", dtype=torch.float32, config=None):
    torch.manual_seed(0)
    state = single_process_state() if config is None else single_process_state(config)
    moe = bool(spec.moe_layer_pattern()[layer])
    return DecoderLayer(spec, options, state, layer, moe, get_backend("torch"), torch.device(device), dtype,
                        NULL_TIMER)


def _eager_split(layer: DecoderLayer, config: ParallelConfig) -> None:
    """Give ``layer`` the graphs' split without capturing it: its static part as a plain module."""
    spec = layer.mlp.router.spec
    scope = cuda_graph_scope(spec, config, layer.is_moe)
    layer.graphed_moe = tuple(p for p in scope if p in ("router", "shared_experts"))
    layer.graphed = cuda_graphs.StaticHalf(
        layer.attention, layer.mlp_norm, layer.mlp_input_norm, layer.options.norm_epsilon,
        router=layer.mlp.router if "router" in scope else None,
        shared=cuda_graphs.SharedExperts(layer.mlp) if "shared_experts" in scope else None)


def _fwd_bwd(layer, x, rope):
    x = x.detach().clone().requires_grad_(True)
    y, aux = layer(x, rope)
    g = torch.linspace(-1, 1, y.numel(), device=y.device, dtype=y.dtype).view_as(y)
    ((y * g).sum() + aux).backward()
    grads = {"x": x.grad}
    grads.update({n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
    for p in layer.parameters():
        p.grad = None
    return y.detach(), grads


@pytest.mark.parametrize("name", MODELS)
def test_split_static_part_equals_the_plain_layer(name):
    spec = MODELS[name]
    options = ExecutorOptions(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    s, b = 16, 2
    rope = rope_tables(s, spec.rotary_head_dim, 10000.0, torch.device("cpu"))
    split, plain = _layer(spec, options), _layer(spec, options)
    plain.load_state_dict(split.state_dict())
    _eager_split(split, ParallelConfig(world_size=1, cuda_graphs=True))
    want = ("router", "shared_experts") if spec.shared_expert_ffn_hidden_size else ("router",)
    assert split.graphed_moe == want
    for _ in range(2):
        x = torch.randn(s, b, spec.hidden_size)
        y1, g1 = _fwd_bwd(split, x, rope)
        y2, g2 = _fwd_bwd(plain, x, rope)
        torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-6)
        assert set(g1) == set(g2) and "mlp.router.weight" in g1
        for k in g1:
            torch.testing.assert_close(g1[k], g2[k], rtol=1e-5, atol=1e-6, msg=k)


def test_scope_follows_the_moe_knobs():
    spec = GATED
    plain = ParallelConfig(world_size=2, ep=2, cuda_graphs=True)
    assert cuda_graph_scope(spec, plain, moe=False) == ("attention", "mlp_norm")
    assert cuda_graph_scope(spec, plain, moe=True) == ("attention", "mlp_norm", "router", "shared_experts")
    # the shared experts run beside the dispatch, or under their own checkpoint: eager
    assert "shared_experts" not in cuda_graph_scope(spec, plain.replace(moe_shared_expert_overlap=True), True)
    recomputed = plain.replace(recompute_granularity="selective", recompute_modules=("shared_experts",))
    assert cuda_graph_scope(spec, recomputed, True) == ("attention", "mlp_norm", "router")
    # the whole MoE block recomputed or offloaded: none of it captured
    for config in (plain.replace(recompute_granularity="selective", recompute_modules=("moe",)),
                   plain.replace(activation_offload_modules=("moe",))):
        assert cuda_graph_scope(spec, config, True) == ("attention", "mlp_norm")
    assert cuda_graph_scope(get_model("tiny-moe"), plain, True) == ("attention", "mlp_norm", "router")


def test_layout_knob_reaches_the_layer_and_the_override_wins():
    spec = get_model("tiny-moe")
    on = ParallelConfig(world_size=1, cuda_graphs=True)
    with pytest.raises(SpecError, match="needs a CUDA device"):  # the layout's knob, CPU ranks
        _layer(spec, ExecutorOptions(), config=on)
    assert _layer(spec, ExecutorOptions(cuda_graphs=False), config=on).graphed is None
    assert ExecutorOptions().graphs_on(on) and not ExecutorOptions().graphs_on(on.replace(cuda_graphs=False))
    assert ExecutorOptions(cuda_graphs=True).graphs_on(on.replace(cuda_graphs=False))


# ---- on a GPU: the captured layer against eager ----

@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", MODELS)
def test_captured_layer_equals_eager_on_a_gpu(name):
    spec = MODELS[name]
    s, b, dev = 32, 2, torch.device("cuda")
    rope = rope_tables(s, spec.rotary_head_dim, 10000.0, dev)
    options = ExecutorOptions(moe_aux_loss_coeff=1e-2)
    graphed = _layer(spec, dataclasses.replace(options, cuda_graphs=True), device=dev)
    eager = _layer(spec, dataclasses.replace(options, cuda_graphs=False), device=dev)
    eager.load_state_dict(graphed.state_dict())
    assert graphed.graphed_moe[0] == "router"
    for step in range(3):  # the first call captures, later ones replay with new inputs
        x = torch.randn(s, b, spec.hidden_size, device=dev)
        y1, g1 = _fwd_bwd(graphed, x, rope)
        y2, g2 = _fwd_bwd(eager, x, rope)
        torch.testing.assert_close(y1, y2, rtol=1e-4, atol=1e-5)
        assert set(g1) == set(g2)
        for k in g1:
            torch.testing.assert_close(g1[k], g2[k], rtol=1e-4, atol=1e-5, msg=f"step {step} {k}")
    assert len(graphed.graphed.graphs) == 1
