"""The MoE GPT decoder built from a ModelSpec, sharded for one rank of a folded layout.

``MoEGPT(spec, state, options, seq_length)`` builds embedding, decoder layers (attention + dense MLP or
MoE per ``spec.moe_layer_pattern()``), final norm and LM head, and with ``spec.mtp_num_layers`` the
multi-token-prediction depths (:mod:`executor.mtp`). Pass ``spec.with_layers(n)`` for a proxy
with fewer layers. ``forward(ids, labels)`` takes this DP rank's micro-batch at full sequence length
([b, s] token ids) and returns a :class:`LossOutput`; ``forward(ids, labels, segments)`` a packed one
(:mod:`executor.documents`: attention within documents, RoPE per document, loss over labelled tokens only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec.errors import SpecError
from spec.head_features import head_blocks, head_features, last_stage_embeds
from spec.model_spec import ModelSpec
from spec.pipeline_layout import layer_chunks
from spec.validity import cuda_graph_scope
from executor import cuda_graphs, recompute
from executor.offload import offloaded
from executor.attention import rope_tables
from executor.attention_modules import make_attention
from executor.head_modules import make_head
from executor.activation import mlp_activation
from executor.attention_core import attention_mask
from executor.documents import Documents, check_packed, masked_mean, rope_for, targets
from executor.kernels import get_backend
from executor.kernels.triton_rms_norm import pick_rms_norm
from executor.mlp import SwiGLUMLP
from executor.moe import MoELayer
from executor.options import ExecutorOptions, check_model_supported
from executor.parallel.collectives import all_reduce_
from executor.parallel.context_parallel import cp_positions
from executor.parallel.cp_exchange import cp_exchange
from executor.parallel.groups import ParallelState
from executor.parallel.sharding import ShardInfo, make_param
from executor.parallel.tensor_parallel import enter_tp
from executor.parallel.vocab import embed, output_cross_entropy
from executor.timing import NULL_TIMER, PhaseTimer


@dataclass
class LossOutput:
    """``loss``: what this rank back-propagates (CE + its share of router losses + the scaled MTP loss);
    ``ce``/``router_loss``/``mtp_loss`` detached, ``router_loss`` already summed over TP (the micro-batch's
    value), ``mtp_loss`` the mean over depths of the MTP cross-entropies before ``mtp_loss_scaling_factor``
    (zero without MTP and off the last chunk)."""

    loss: torch.Tensor
    ce: torch.Tensor
    router_loss: torch.Tensor
    hidden: torch.Tensor | None = None  # a pipeline chunk's output activations (all but the last chunk)
    mtp_loss: torch.Tensor | None = None

    def stats(self) -> torch.Tensor:
        """[ce, router_loss, mtp_loss] (detached), what a step averages and reports."""
        mtp = self.mtp_loss if self.mtp_loss is not None else torch.zeros_like(self.ce)
        return torch.stack([self.ce, self.router_loss, mtp])


class DecoderLayer(torch.nn.Module):
    def __init__(self, spec: ModelSpec, options: ExecutorOptions, state: ParallelState, layer: int, moe: bool,
                 kernels, device, dtype, timer: PhaseTimer):
        super().__init__()
        self.kernels, self.options, self.timer = kernels, options, timer
        self.attention = make_attention(spec, options, state, layer, kernels, device, dtype, timer)
        info = ShardInfo(f"layers.{layer}.mlp_norm.weight", (spec.hidden_size,), tp_partial=True)
        self.mlp_norm = make_param(info, state, "ones", 0.0, options.seed, device, dtype)
        if moe:
            self.mlp = MoELayer(spec, options, state, layer, kernels, device, dtype, timer)
        else:
            self.mlp = SwiGLUMLP(f"layers.{layer}.mlp.", spec.hidden_size, spec.ffn_hidden_size, options, state,
                                 device, dtype, timer, bias=spec.add_bias_linear, act=mlp_activation(spec))
        self.is_moe = moe
        config = state.config
        self.recompute_norm = recompute.selective(config, "layernorm")
        self.recompute_mlp = recompute.selective(config, "moe" if moe else "mlp")
        self.offload_norm = offloaded(config, "layernorm")
        self.offload_mlp = offloaded(config, "moe" if moe else "mlp")
        self.recompute_layer = False  # set by the model: full recompute of this layer
        self.mlp_input_norm = pick_rms_norm(options.fused_rms_norm, kernels)
        # the layout's cuda_graphs (or the options' override): the static part replayed from CUDA graphs
        # (executor.cuda_graphs); a plain attribute, not a submodule, so parameters and state dicts are the layer's own
        self.graphed = None
        self.graphed_moe: tuple[str, ...] = ()  # what of the MoE block the graphs compute: 'router', 'shared_experts'
        if options.graphs_on(config):
            reason = cuda_graphs.refusal(config, options.kernel_backend, torch.device(device))
            if reason is not None:
                raise SpecError(reason)
            scope = cuda_graph_scope(spec, config, moe)
            self.graphed_moe = tuple(p for p in scope if p in ("router", "shared_experts"))
            half = cuda_graphs.StaticHalf(
                self.attention, self.mlp_norm, self.mlp_input_norm, options.norm_epsilon,
                router=self.mlp.router if "router" in scope else None,
                shared=cuda_graphs.SharedExperts(self.mlp) if "shared_experts" in scope else None)
            self.graphed = cuda_graphs.GraphedStaticHalf(half)

    def forward(self, x_SBH: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """(output slice, router loss: zero for a dense layer). ``rope``: (cos, sin), or with a packed micro-batch
        (cos, sin, its Documents)."""
        return recompute.run(self.recompute_layer, self._forward, x_SBH, *rope)

    def attention_block(self, x_SBH: torch.Tensor, cos, sin, docs: Documents | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual after attention, its normed copy: the MLP's input), both [s/tp, b, h]."""
        return self._static_part(x_SBH, cos, sin, docs)[:2]

    def _static_part(self, x_SBH: torch.Tensor, cos, sin, docs: Documents | None = None) -> tuple[torch.Tensor, ...]:
        """(residual after attention, the MLP's input), then from CUDA graphs what they compute of the MoE block
        (``graphed_moe``: the router's logits, the shared experts' output)."""
        if self.graphed is not None:  # the whole part is one "attention" phase (never packed: check_packed)
            x, h, *moe = self.graphed(self.timer.mark(x_SBH, "other", "attention"), cos, sin)
            return (x, self.timer.mark(h, "attention", "other"), *moe)
        x = x_SBH + self.attention(x_SBH, (cos, sin) if docs is None else (cos, sin, docs))
        h = self.timer.mark(x, "other", "norm")
        h = recompute.run(self.recompute_norm, self.mlp_input_norm, h, self.mlp_norm, self.options.norm_epsilon,
                          offload=self.offload_norm)
        return x, self.timer.mark(h, "norm", "other")

    def _forward(self, x_SBH: torch.Tensor, cos, sin, docs: Documents | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        x, h, *graphed = self._static_part(x_SBH, cos, sin, docs)
        if graphed:  # never recomputed nor offloaded (spec.validity.cuda_graph_scope)
            y, router_loss = self.mlp(h, None, *graphed)  # (logits[, shared]): the scope puts the router first
            return x + y, router_loss
        if self.is_moe:
            real = None if docs is None else docs.real_tokens()
            y, router_loss = recompute.run(self.recompute_mlp, self.mlp, h, real, offload=self.offload_mlp)
            return x + y, router_loss
        return (x + recompute.run(self.recompute_mlp, self.mlp, h, offload=self.offload_mlp),
                x.new_zeros((), dtype=torch.float32))


def rank_positions(spec: ModelSpec, options: ExecutorOptions, state: ParallelState, seq_length: int,
                   layers: list[DecoderLayer], device: torch.device):
    """(rope cos, rope sin, CP positions) of this rank's tokens, and each of ``layers`` given the attention mask
    it needs: under CP the rank holds its load-balanced share of the sequence (positions ``cp_positions``), and
    its layers attend as the layout's CP communication type does (``cp_exchange(...).mask_positions``: the
    allgather type's chunks against every rank's keys, a2a's whole sequences, none for the ring types); without
    CP the whole sequence in order (positions None), masks for the layers with a window or sinks."""
    cos, sin = rope_tables(seq_length, spec.rotary_head_dim, options.rotary_base, device)
    cp = state["cp"]
    positions = None
    every = torch.arange(seq_length, device=device)
    mask_positions = (every, every)
    if cp.size > 1:
        positions = cp_positions(seq_length, cp.size, cp.rank, device)
        mask_positions = cp_exchange(state.config.cp_comm_type).mask_positions(seq_length, cp, device)
        cos, sin = cos[positions], sin[positions]
    # the allgather type's plain layers take the mask too: its masked fallback beside the flash path
    gathered = cp.size > 1 and state.config.cp_comm_type == "allgather"
    if mask_positions is not None:
        queries, keys = mask_positions
        masks = {}  # one mask per window size, shared by the layers that use it
        for layer in layers:
            attention = layer.attention
            if not attention.plain or gathered:
                if attention.window not in masks:
                    masks[attention.window] = attention_mask(queries, keys, attention.window)
                attention.mask = masks[attention.window]
    return cos, sin, positions


class MoEGPT(torch.nn.Module):
    """This rank's slice of the model: under pipeline parallelism, its stage's virtual chunks only.

    Chunk ``v`` of pipeline rank ``i`` holds the decoder layers ``spec.pipeline_layout.layer_chunks(L, pp,
    vpp, split)[i][v]`` (``split``: the layout's Megatron placement options, ``ParallelConfig.pipeline_split``;
    a chunk may hold no decoder layer: only the embedding, only the loss, or nothing but the hand-over of its
    activations); the embedding lives on the first chunk of the model and the final norm, LM head, MTP depths
    and loss on the last. Parameter names are the full model's, so every layout gathers to the same state.
    When the last stage needs the word embedding too (MTP embeds the shifted tokens; tied output weights) and
    pp > 1, it holds its own copy (``ShardInfo.pp_shared``, same name and initial values) whose gradient the
    reducer sums with the first stage's over the embedding group, as Megatron does.
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
        self.final_rms_norm = pick_rms_norm(options.fused_rms_norm, self.kernels)
        self.seq_length = seq_length or spec.max_position_embeddings
        self.padded_vocab = spec.padded_vocab_size(state.tp.size)
        h = spec.hidden_size
        config = state.config
        pp = state["pp"]
        self.vpp = config.vpp
        chunks = layer_chunks(spec.num_layers, config.pp, config.vpp, config.pipeline_split)[pp.rank]
        self.first_stage, self.last_stage = pp.rank == 0, pp.rank == pp.size - 1

        def vocab_param(name, pp_shared=False):
            info = ShardInfo(name, (self.padded_vocab, h), tp_dim=0, rows=spec.vocab_size, pp_shared=pp_shared)
            return make_param(info, state, "normal", options.init_method_std, options.seed, device, dtype)

        tied = not spec.untie_embeddings_and_output_weights
        last_needs_embedding = last_stage_embeds(spec) or tied
        shared = pp.size > 1 and last_needs_embedding
        self.embedding = vocab_param("embedding.weight", shared) \
            if self.first_stage or (self.last_stage and last_needs_embedding) else None
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
        self.heads: list[torch.nn.Module] = []  # head features' modules, each also an attribute by its name
        if self.last_stage:
            info = ShardInfo("final_norm.weight", (h,), tp_partial=True)
            self.final_norm = make_param(info, state, "ones", 0.0, options.seed, device, dtype)
            # tied output weights reuse the embedding (the last stage's copy under pp > 1)
            self.lm_head = vocab_param("lm_head.weight") if not tied else None
            index = spec.num_layers
            for feature, depth in head_features(spec):  # blocks of the last layer's kind, named as layers L, ...
                layers = [DecoderLayer(spec, options, state, index + k, bool(pattern[-1]), self.kernels, device,
                                       dtype, timer) for k in range(depth)]
                index += depth
                for layer in layers:  # Megatron checkpoints a whole MTP layer under full recompute
                    layer.recompute_layer = config.recompute_granularity == "full"
                head = make_head(feature, spec, options, state, layers, self.kernels, device, dtype, timer)
                if hasattr(self, feature.name):
                    raise SpecError(f"head feature {feature.name!r} is named like a part of the model")
                setattr(self, feature.name, head)  # parameters named by the feature (``mtp.depths.…``)
                self.heads.append(head)
        # every MoE layer of the whole model (not only this stage's), in order: the rows of the per-layer routed
        # token counts, the same on every rank so that stages holding disjoint layers can sum them
        head_blocks_moe = [spec.num_layers + k for k in range(head_blocks(spec))] if pattern[-1] else []
        self.moe_layer_numbers: list[int] = [i for i in range(spec.num_layers) if pattern[i]] + head_blocks_moe
        self._moe_row = {number: row for row, number in enumerate(self.moe_layer_numbers)}
        cos, sin, self.cp_positions = rank_positions(spec, options, state, self.seq_length, self.decoder_layers(),
                                                     device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._full_rope: tuple | None = None  # (s, cos, sin) of positions 0..s−1: packed micro-batches index it

    def decoder_layers(self) -> list[DecoderLayer]:
        """This rank's decoder layers, then the head blocks' layers (MTP depths; last stage)."""
        return list(self.layers) + [layer for head in self.heads for layer in head.decoder_layers()]

    def moe_layers(self) -> list[MoELayer]:
        return [layer.mlp for layer in self.decoder_layers() if layer.is_moe]

    def count_routed(self, counts: torch.Tensor | None, moe_layers: list[MoELayer]) -> torch.Tensor:
        """``counts`` [MoE layers of the model, experts] (int64; None: zeros) plus the tokens each of
        ``moe_layers`` routed to each expert in its last forward, in that layer's row."""
        for moe in moe_layers:
            c = moe.last_tokens_per_expert
            if counts is None:
                counts = c.new_zeros((len(self.moe_layer_numbers), c.numel()))
            counts[self._moe_row[moe.layer_number]] += c
        return counts

    def chunk_moe_layers(self, chunk: int) -> list[MoELayer]:
        """The MoE layers virtual chunk ``chunk`` runs (the head blocks' with the model's last chunk)."""
        layers = [self.layers[i] for i in self.chunk_layers[chunk]]
        if self.is_last_chunk(chunk):
            layers += [layer for head in self.heads for layer in head.decoder_layers()]
        return [layer.mlp for layer in layers if layer.is_moe]

    def is_first_chunk(self, chunk: int) -> bool:
        return self.first_stage and chunk == 0

    def is_last_chunk(self, chunk: int) -> bool:
        return self.last_stage and chunk == self.vpp - 1

    def activation_shape(self, micro_batch_size: int) -> tuple[int, int, int]:
        """[s/(tp·cp), b, h]: what one chunk hands the next (a pipeline message)."""
        local = self.seq_length // (self.state.tp.size * self.state["cp"].size)
        return (local, micro_batch_size, self.spec.hidden_size)

    def forward_chunk(self, chunk: int, x_or_ids: torch.Tensor, labels_BS: torch.Tensor,
                      segments_BS: torch.Tensor | None = None, loss_tokens: torch.Tensor | None = None
                      ) -> LossOutput:
        """Run virtual chunk ``chunk``: its input is token ids [b, s] on the model's first chunk, else the
        previous chunk's activations [s/tp, b, h]. On the last chunk ``loss`` is CE + this chunk's router
        losses (+ the MTP depths' router losses and their scaled loss); elsewhere ``hidden`` is the output and
        ``loss`` the chunk's router losses (ce = 0). ``segments_BS``: a packed micro-batch's segment ids (pp = 1);
        ``loss_tokens``: its cross-entropy's divisor (:func:`executor.documents.masked_mean`)."""
        x, rope, labels_BS, full_labels_BS = self.chunk_input(chunk, x_or_ids, labels_BS, segments_BS)
        router_loss = x.new_zeros((), dtype=torch.float32)
        for position in self.chunk_layers[chunk]:
            x, layer_loss = self.layers[position](x, rope)
            router_loss = router_loss + layer_loss
        return self.chunk_output(chunk, x, router_loss, rope, labels_BS, full_labels_BS, loss_tokens)

    def chunk_input(self, chunk: int, x_or_ids: torch.Tensor, labels_BS: torch.Tensor,
                    segments_BS: torch.Tensor | None = None):
        """:meth:`forward_chunk` up to its first layer: (input activations [s/tp, b, h], rope tables (and with
        ``segments_BS`` the micro-batch's Documents), this CP rank's labels, the full labels)."""
        full_labels_BS = labels_BS  # MTP shifts the labels over the whole sequence before CP slicing
        if self.cp_positions is not None:  # the full micro-batch comes in; this CP rank keeps its tokens
            if self.is_first_chunk(chunk):
                x_or_ids = x_or_ids[:, self.cp_positions]
            labels_BS = labels_BS[:, self.cp_positions]
        s = labels_BS.shape[1]
        if self.is_first_chunk(chunk):
            self.timer.switch("embedding")
            x = embed(x_or_ids.t(), self.embedding, self.padded_vocab, self.state)  # [s/tp, b, h]
            x = self.timer.mark(x, "embedding", "other")
        else:
            x = x_or_ids
        if segments_BS is not None:
            return x, self._packed_rope(segments_BS), labels_BS, full_labels_BS
        return x, (self.rope_cos[:s], self.rope_sin[:s]), labels_BS, full_labels_BS

    def _packed_rope(self, segments_BS: torch.Tensor) -> tuple:
        """(cos, sin [b, s/cp, d] at positions within documents, Documents) of a packed micro-batch."""
        check_packed(self.spec, self.state.config, self.options)
        s = segments_BS.shape[1]
        if self._full_rope is None or self._full_rope[0] != s:  # positions 0..s−1, whatever this CP rank holds
            cos, sin = rope_tables(s, self.spec.rotary_head_dim, self.options.rotary_base, segments_BS.device)
            self._full_rope = (s, cos, sin)
        cos, sin = rope_for(segments_BS, *self._full_rope[1:], self.cp_positions)
        return cos, sin, Documents(segments_BS, self.cp_positions, self.state.tp)

    def chunk_output(self, chunk: int, x: torch.Tensor, router_loss: torch.Tensor, rope, labels_BS: torch.Tensor,
                     full_labels_BS: torch.Tensor, loss_tokens: torch.Tensor | None = None) -> LossOutput:
        """:meth:`forward_chunk` after its last layer: ``x`` its output, ``router_loss`` its layers' sum."""
        timer, state = self.timer, self.state
        # Router losses are per-rank parts of one sum over the sequence, but gradients average over CP.
        router_loss = router_loss * state["cp"].size
        with torch.no_grad():
            total_router = all_reduce_(router_loss.detach().clone(), state.tp)
        if not self.is_last_chunk(chunk):
            return LossOutput(router_loss, router_loss.new_zeros(()), total_router, hidden=x)
        x = timer.mark(x, "other", "lm_head_loss")
        x = h0 = self.final_rms_norm(x, self.final_norm, self.options.norm_epsilon)
        x = enter_tp(x, state)
        weight = self.lm_head if self.lm_head is not None else self.embedding
        packed = len(rope) > 2  # the mean over labelled tokens: padding and document ends have none
        ce = output_cross_entropy(x, weight, (targets(labels_BS) if packed else labels_BS).t(), self.spec.vocab_size,
                                  self.padded_vocab, state, self.options.cross_entropy_chunk_logits,
                                  self.options.cross_entropy_keep_logits)
        ce = masked_mean(ce, labels_BS, full_labels_BS, state["cp"].size, loss_tokens) if packed else ce.mean()
        loss = ce + router_loss
        loss = timer.mark(loss, "lm_head_loss", "other")
        if not self.heads:
            return LossOutput(loss, ce.detach(), total_router)
        head_loss = None
        for head in self.heads:
            own_loss, head_router = head(h0, full_labels_BS, rope, self.embedding, weight, self.cp_positions)
            head_router = head_router * state["cp"].size  # as the decoder's router losses above
            with torch.no_grad():
                total_router = total_router + all_reduce_(head_router.detach().clone(), state.tp)
            loss = loss + head.loss_scale * own_loss + head_router
            head_loss = own_loss if head_loss is None else head_loss + own_loss
        return LossOutput(loss, ce.detach(), total_router, mtp_loss=head_loss.detach())

    def forward(self, ids_BS: torch.Tensor, labels_BS: torch.Tensor, segments_BS: torch.Tensor | None = None,
                loss_tokens: torch.Tensor | None = None) -> LossOutput:
        """Mean cross-entropy of the micro-batch plus router losses (the whole model: pp = 1 only); with
        ``segments_BS`` a packed micro-batch (module docstring), whose cross-entropy sum over real tokens is
        divided by ``loss_tokens`` (the global batch's real tokens per micro-batch,
        :func:`executor.documents.loss_tokens`; None: the micro-batch's own count)."""
        if self.state["pp"].size > 1 or self.vpp > 1:
            raise RuntimeError("a pipelined model runs chunk by chunk: use executor.pipeline")
        return self.forward_chunk(0, ids_BS, labels_BS, segments_BS, loss_tokens)
