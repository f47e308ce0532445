"""The MoE GPT decoder built from a ModelSpec, sharded for one rank of a folded layout.

``MoEGPT(spec, state, options, seq_length)`` builds embedding, decoder layers (attention + dense MLP or
MoE per ``spec.moe_layer_pattern()``), final norm and LM head. Pass ``spec.with_layers(n)`` for a proxy
with fewer layers. ``forward(ids, labels)`` takes this DP rank's micro-batch at full sequence length
([b, s] token ids) and returns a :class:`LossOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec.model_spec import ModelSpec
from spec.pipeline_layout import layer_chunks
from executor import recompute
from executor.attention import Attention, rope_tables
from executor.kernels import get_backend
from executor.mlp import SwiGLUMLP
from executor.moe import MoELayer
from executor.options import ExecutorOptions, check_model_supported
from executor.parallel.collectives import all_reduce_
from executor.parallel.context_parallel import causal_mask, cp_positions
from executor.parallel.groups import ParallelState
from executor.parallel.sharding import ShardInfo, make_param
from executor.parallel.tensor_parallel import enter_tp
from executor.parallel.vocab import embed, output_cross_entropy
from executor.timing import NULL_TIMER, PhaseTimer


@dataclass
class LossOutput:
    """``loss``: what this rank back-propagates (CE + its share of router losses); ``ce``/``router_loss``
    detached, ``router_loss`` already summed over TP (the micro-batch's value)."""

    loss: torch.Tensor
    ce: torch.Tensor
    router_loss: torch.Tensor
    hidden: torch.Tensor | None = None  # a pipeline chunk's output activations (all but the last chunk)


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
        config = state.config
        self.recompute_norm = recompute.selective(config, "layernorm")
        self.recompute_mlp = recompute.selective(config, "moe" if moe else "mlp")
        self.recompute_layer = False  # set by the model: full recompute of this layer

    def forward(self, x_SBH: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """(output slice, router loss: zero for a dense layer)."""
        return recompute.run(self.recompute_layer, self._forward, x_SBH, *rope)

    def _forward(self, x_SBH: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        x = x_SBH + self.attention(x_SBH, (cos, sin))
        h = self.timer.mark(x, "other", "norm")
        h = recompute.run(self.recompute_norm, self.kernels.rms_norm, h, self.mlp_norm, self.options.norm_epsilon)
        h = self.timer.mark(h, "norm", "other")
        if self.is_moe:
            y, router_loss = recompute.run(self.recompute_mlp, self.mlp, h)
            return x + y, router_loss
        return x + recompute.run(self.recompute_mlp, self.mlp, h), x.new_zeros((), dtype=torch.float32)


class MoEGPT(torch.nn.Module):
    """This rank's slice of the model: under pipeline parallelism, its stage's virtual chunks only.

    Chunk ``v`` of pipeline rank ``i`` holds the decoder layers ``spec.pipeline_layout.layer_chunks(L, pp,
    vpp)[i][v]``; the embedding lives on the first chunk of the model and the final norm, LM head and loss on
    the last. Parameter names are the full model's, so every layout gathers to the same state.
    """

    def __init__(self, spec: ModelSpec, state: ParallelState, options: ExecutorOptions | None = None,
                 seq_length: int | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, timer: PhaseTimer = NULL_TIMER):
        super().__init__()
        check_model_supported(spec)
        options = options or ExecutorOptions()
        device = torch.device(device)
        self.spec, self.state, self.options, self.timer = spec, state, options, timer
        self.dtype = dtype
        self.kernels = get_backend(options.kernel_backend)
        self.seq_length = seq_length or spec.max_position_embeddings
        self.padded_vocab = spec.padded_vocab_size(state.tp.size)
        h = spec.hidden_size
        config = state.config
        pp = state["pp"]
        self.vpp = config.vpp
        chunks = layer_chunks(spec.num_layers, config.pp, config.vpp)[pp.rank]
        self.first_stage, self.last_stage = pp.rank == 0, pp.rank == pp.size - 1

        def vocab_param(name):
            info = ShardInfo(name, (self.padded_vocab, h), tp_dim=0, rows=spec.vocab_size)
            return make_param(info, state, "normal", options.init_method_std, options.seed, device, dtype)

        self.embedding = vocab_param("embedding.weight") if self.first_stage else None
        pattern = spec.moe_layer_pattern()
        self.layers = torch.nn.ModuleList(
            DecoderLayer(spec, options, state, i, bool(pattern[i]), self.kernels, device, dtype, timer)
            for chunk in chunks for i in chunk)
        # chunk v -> positions in self.layers; full recompute counts layers per virtual stage
        self.chunk_layers: list[list[int]] = []
        for chunk in chunks:
            start = sum(len(c) for c in self.chunk_layers)
            self.chunk_layers.append(list(range(start, start + len(chunk))))
            for index, position in enumerate(self.chunk_layers[-1]):
                self.layers[position].recompute_layer = recompute.full_layer(config, index)
        self.final_norm = self.lm_head = None
        if self.last_stage:
            info = ShardInfo("final_norm.weight", (h,), tp_partial=True)
            self.final_norm = make_param(info, state, "ones", 0.0, options.seed, device, dtype)
            # tied output weights reuse the embedding: only without a pipeline (check_layout says so)
            self.lm_head = vocab_param("lm_head.weight") if spec.untie_embeddings_and_output_weights else None
        cos, sin = rope_tables(self.seq_length, spec.head_dim, options.rotary_base, device)
        cp = state["cp"]
        self.cp_positions = None
        if cp.size > 1:  # this rank's load-balanced share of the sequence and its causal mask
            self.cp_positions = cp_positions(self.seq_length, cp.size, cp.rank, device)
            mask = causal_mask(self.seq_length, cp.size, cp.rank, device)
            for layer in self.layers:
                layer.attention.cp_mask = mask
            cos, sin = cos[self.cp_positions], sin[self.cp_positions]
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def moe_layers(self) -> list[MoELayer]:
        return [layer.mlp for layer in self.layers if layer.is_moe]

    def is_first_chunk(self, chunk: int) -> bool:
        return self.first_stage and chunk == 0

    def is_last_chunk(self, chunk: int) -> bool:
        return self.last_stage and chunk == self.vpp - 1

    def activation_shape(self, micro_batch_size: int) -> tuple[int, int, int]:
        """[s/(tp·cp), b, h]: what one chunk hands the next (a pipeline message)."""
        local = self.seq_length // (self.state.tp.size * self.state["cp"].size)
        return (local, micro_batch_size, self.spec.hidden_size)

    def forward_chunk(self, chunk: int, x_or_ids: torch.Tensor, labels_BS: torch.Tensor) -> LossOutput:
        """Run virtual chunk ``chunk``: its input is token ids [b, s] on the model's first chunk, else the
        previous chunk's activations [s/tp, b, h]. On the last chunk ``loss`` is CE + this chunk's router
        losses; elsewhere ``hidden`` is the output and ``loss`` the chunk's router losses (ce = 0)."""
        timer, state = self.timer, self.state
        if self.cp_positions is not None:  # the full micro-batch comes in; this CP rank keeps its tokens
            if self.is_first_chunk(chunk):
                x_or_ids = x_or_ids[:, self.cp_positions]
            labels_BS = labels_BS[:, self.cp_positions]
        s = labels_BS.shape[1]
        if self.is_first_chunk(chunk):
            timer.switch("embedding")
            x = embed(x_or_ids.t(), self.embedding, self.padded_vocab, state)  # [s/tp, b, h]
            x = timer.mark(x, "embedding", "other")
        else:
            x = x_or_ids
        rope = (self.rope_cos[:s], self.rope_sin[:s])
        router_loss = x.new_zeros((), dtype=torch.float32)
        for position in self.chunk_layers[chunk]:
            x, layer_loss = self.layers[position](x, rope)
            router_loss = router_loss + layer_loss
        # Router losses are per-rank parts of one sum over the sequence, but gradients average over CP.
        router_loss = router_loss * state["cp"].size
        with torch.no_grad():
            total_router = all_reduce_(router_loss.detach().clone(), state.tp)
        if not self.is_last_chunk(chunk):
            return LossOutput(router_loss, router_loss.new_zeros(()), total_router, hidden=x)
        x = timer.mark(x, "other", "lm_head_loss")
        x = self.kernels.rms_norm(x, self.final_norm, self.options.norm_epsilon)
        x = enter_tp(x, state)
        weight = self.lm_head if self.lm_head is not None else self.embedding
        ce = output_cross_entropy(x, weight, labels_BS.t(), self.spec.vocab_size, self.padded_vocab, state,
                                  self.options.cross_entropy_chunk_logits).mean()
        loss = ce + router_loss
        loss = timer.mark(loss, "lm_head_loss", "other")
        return LossOutput(loss, ce.detach(), total_router)

    def forward(self, ids_BS: torch.Tensor, labels_BS: torch.Tensor) -> LossOutput:
        """Mean cross-entropy of the micro-batch plus router losses (the whole model: pp = 1 only)."""
        if self.state["pp"].size > 1 or self.vpp > 1:
            raise RuntimeError("a pipelined model runs chunk by chunk: use executor.pipeline")
        return self.forward_chunk(0, ids_BS, labels_BS)
