"""The MoE GPT decoder built from a ModelSpec, sharded for one rank of a folded layout.

``MoEGPT(spec, state, options, seq_length)`` builds embedding, decoder layers (attention + dense MLP or
MoE per ``spec.moe_layer_pattern()``), final norm and LM head. Pass ``spec.with_layers(n)`` for a proxy
with fewer layers. ``forward(ids, labels)`` takes this DP rank's micro-batch at full sequence length
([b, s] token ids) and returns a :class:`LossOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from costmodel.model_spec import ModelSpec
from executor.attention import Attention, rope_tables
from executor.kernels import get_backend
from executor.mlp import SwiGLUMLP
from executor.moe import MoELayer
from executor.options import ExecutorOptions, check_model_supported
from executor.parallel.collectives import all_reduce_
from executor.parallel.groups import ParallelState
from executor.parallel.sharding import ShardInfo, make_param
from executor.parallel.tensor_parallel import enter_tp
from executor.parallel.vocab import cross_entropy, embed
from executor.timing import NULL_TIMER, PhaseTimer


@dataclass
class LossOutput:
    """``loss``: what this rank back-propagates (CE + its share of router losses); ``ce``/``router_loss``
    detached, ``router_loss`` already summed over TP (the micro-batch's value)."""

    loss: torch.Tensor
    ce: torch.Tensor
    router_loss: torch.Tensor


class DecoderLayer(torch.nn.Module):
    def __init__(self, spec: ModelSpec, options: ExecutorOptions, state: ParallelState, layer: int, moe: bool,
                 kernels, device, dtype, timer: PhaseTimer):
        super().__init__()
        self.kernels, self.options, self.timer = kernels, options, timer
        self.attention = Attention(spec, options, state, layer, kernels, device, dtype, timer)
        info = ShardInfo(f"layers.{layer}.mlp_norm.weight", (spec.hidden_size,), tp_partial=True)
        self.mlp_norm = make_param(info, state, "ones", 0.0, options.seed, device, dtype)
        if moe:
            self.mlp = MoELayer(spec, options, state, layer, kernels, device, dtype, timer)
        else:
            self.mlp = SwiGLUMLP(f"layers.{layer}.mlp.", spec.hidden_size, spec.ffn_hidden_size, options, state,
                                 device, dtype, timer)
        self.is_moe = moe

    def forward(self, x_SBH: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x_SBH + self.attention(x_SBH, rope)
        h = self.timer.mark(x, "other", "norm")
        h = self.kernels.rms_norm(h, self.mlp_norm, self.options.norm_epsilon)
        h = self.timer.mark(h, "norm", "other")
        if self.is_moe:
            y, router_loss = self.mlp(h)
            return x + y, router_loss
        return x + self.mlp(h), None


class MoEGPT(torch.nn.Module):
    def __init__(self, spec: ModelSpec, state: ParallelState, options: ExecutorOptions | None = None,
                 seq_length: int | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, timer: PhaseTimer = NULL_TIMER):
        super().__init__()
        check_model_supported(spec)
        options = options or ExecutorOptions()
        device = torch.device(device)
        self.spec, self.state, self.options, self.timer = spec, state, options, timer
        self.kernels = get_backend(options.kernel_backend)
        self.seq_length = seq_length or spec.max_position_embeddings
        self.padded_vocab = spec.padded_vocab_size(state.tp.size)
        h = spec.hidden_size

        def vocab_param(name):
            info = ShardInfo(name, (self.padded_vocab, h), tp_dim=0, rows=spec.vocab_size)
            return make_param(info, state, "normal", options.init_method_std, options.seed, device, dtype)

        self.embedding = vocab_param("embedding.weight")
        self.layers = torch.nn.ModuleList(
            DecoderLayer(spec, options, state, i, bool(m), self.kernels, device, dtype, timer)
            for i, m in enumerate(spec.moe_layer_pattern()))
        info = ShardInfo("final_norm.weight", (h,), tp_partial=True)
        self.final_norm = make_param(info, state, "ones", 0.0, options.seed, device, dtype)
        self.lm_head = vocab_param("lm_head.weight") if spec.untie_embeddings_and_output_weights else None
        cos, sin = rope_tables(self.seq_length, spec.head_dim, options.rotary_base, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def moe_layers(self) -> list[MoELayer]:
        return [layer.mlp for layer in self.layers if layer.is_moe]

    def forward(self, ids_BS: torch.Tensor, labels_BS: torch.Tensor) -> LossOutput:
        """Mean cross-entropy of the micro-batch plus router losses; every TP rank returns the same CE."""
        timer, state = self.timer, self.state
        s = ids_BS.shape[1]
        timer.switch("embedding")
        x = embed(ids_BS.t(), self.embedding, self.padded_vocab, state)  # [s/tp, b, h]
        x = timer.mark(x, "embedding", "other")
        rope = (self.rope_cos[:s], self.rope_sin[:s])
        router_loss = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x, layer_loss = layer(x, rope)
            if layer_loss is not None:
                router_loss = router_loss + layer_loss
        x = timer.mark(x, "other", "lm_head_loss")
        x = self.kernels.rms_norm(x, self.final_norm, self.options.norm_epsilon)
        x = enter_tp(x, state)
        head = self.lm_head if self.lm_head is not None else self.embedding
        logits = F.linear(x, head)
        ce = cross_entropy(logits, labels_BS.t(), self.spec.vocab_size, self.padded_vocab, state).mean()
        loss = ce + router_loss
        loss = timer.mark(loss, "lm_head_loss", "other")
        with torch.no_grad():
            total_router = all_reduce_(router_loss.detach().clone(), state.tp)
        return LossOutput(loss, ce.detach(), total_router)
