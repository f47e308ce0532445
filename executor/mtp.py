"""Multi-token prediction (DeepSeek-V3 §2.2; Megatron-Core's MultiTokenPredictionBlock) on the last stage.

Depth k = 1..D (``ModelSpec.mtp_num_layers``) predicts, at every position i, the token k + 1 places ahead:

    e_k = enorm_k(Emb(t_{i+k}))                      the shared word embedding of the input shifted by k
    x_k = eh_proj_k([e_k ; hnorm_k(h_{k-1})])         2h → h, column-parallel over TP (Megatron's order)
    h_k = final_norm_k(layer_k(x_k))                  one decoder layer of the last decoder layer's kind
    L_k = CE(output_layer(h_k), t_{i+k+1})            the shared output layer, over positions i + k < s

``h_0`` is the decoder's output after the model's final norm: Megatron's TransformerBlock applies its final
layernorm before GPTModel hands the hidden states to the MTP block, and each depth passes on its output after
its own final norm. Inputs past the end of the sequence are token 0 and their labels are masked, as
Megatron's ``roll_tensor`` fills and its rolled loss mask drops them. The MTP loss is the mean of L_k over
depths; the model adds it times ``mtp_loss_scaling_factor`` to the main loss (Megatron adds
factor/D · Σ L_k through MTPLossAutoScaler, the same gradient).

The shifted inputs and labels are cut from the full micro-batch labels (labels[i] = t_{i+1}, so t_{i+k} =
labels[i+k-1]) before a CP rank keeps its positions, so the last stage needs no token ids. Each L_k divides
by the micro-batch's count of valid positions, b·(s − k), not a CP rank's own count: CP ranks hold unequal
shares of the masked tail, and only the global count makes the DP·CP gradient average the single-process
loss (Megatron divides by each rank's count).
"""

from __future__ import annotations

import torch

from spec.model_spec import ModelSpec
from executor.kernels.base import KernelBackend
from executor.kernels.triton_rms_norm import pick_rms_norm
from executor.options import ExecutorOptions
from executor.parallel.collectives import all_gather
from executor.parallel.groups import ParallelState
from executor.parallel.sharding import ShardInfo, make_param
from executor.parallel.tensor_parallel import enter_tp
from executor.parallel.vocab import embed, output_cross_entropy
from executor.timing import NULL_TIMER, PhaseTimer


def shifted_tokens(labels_BS: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depth ``depth`` (1-based) inputs, labels and validity, each [b, s], from full-sequence ``labels_BS``
    (labels[i] = token i + 1): inputs t_{i+depth} (0 past the end), labels t_{i+depth+1} (0 where masked),
    valid where i + depth < s."""
    b, s = labels_BS.shape
    inputs, targets = torch.zeros_like(labels_BS), torch.zeros_like(labels_BS)
    if depth < s:
        inputs[:, : s - depth] = labels_BS[:, depth - 1: s - 1]
        targets[:, : s - depth] = labels_BS[:, depth:]
    valid = (torch.arange(s, device=labels_BS.device) < s - depth).expand(b, s)
    return inputs, targets, valid


def gather_hidden_slice(y_SBh: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Output of a column-parallel linear ([s, b, h/tp] per rank) as this rank's sequence slice [s/tp, b, h]:
    all-gather the hidden shards (backward: reduce-scatter, which sums every rank's slice) and keep ours."""
    tp = state.tp
    if tp.size == 1:
        return y_SBh
    full = all_gather(y_SBh.permute(2, 0, 1).contiguous(), tp).permute(1, 2, 0)  # [s, b, h]
    local = full.shape[0] // tp.size
    return full[tp.rank * local:(tp.rank + 1) * local]


class MTPDepth(torch.nn.Module):
    """One prediction depth: enorm, hnorm, eh_proj, a decoder layer (built by the model) and its final norm.

    Its own parameters are named ``mtp.{k}.*`` (k from 0); the decoder layer's are those of decoder layer
    ``num_layers + k``, the index Megatron's layer numbering gives it after the decoder.
    """

    def __init__(self, spec: ModelSpec, options: ExecutorOptions, state: ParallelState, depth: int,
                 layer: torch.nn.Module, kernels: KernelBackend, device, dtype):
        super().__init__()
        h = spec.hidden_size
        self.kernels, self.eps = kernels, options.norm_epsilon
        self.rms_norm = pick_rms_norm(options.fused_rms_norm, kernels)

        def param(name, shape, init, **kw):
            info = ShardInfo(f"mtp.{depth}.{name}", shape, **kw)
            return make_param(info, state, init, options.init_method_std, options.seed, device, dtype)

        self.enorm = param("enorm.weight", (h,), "ones", tp_partial=True)
        self.hnorm = param("hnorm.weight", (h,), "ones", tp_partial=True)
        self.eh_proj = param("eh_proj.weight", (h, 2 * h), "normal", tp_dim=0)
        self.layer = layer
        self.final_norm = param("final_norm.weight", (h,), "ones", tp_partial=True)

    def forward(self, h_SBH: torch.Tensor, e_SBH: torch.Tensor, rope, state: ParallelState):
        """(h_k [s/tp, b, h], router loss) from h_{k-1} and the shifted tokens' embeddings (sequence slices)."""
        x = torch.cat([self.rms_norm(e_SBH, self.enorm, self.eps),
                       self.rms_norm(h_SBH, self.hnorm, self.eps)], dim=-1)
        x = gather_hidden_slice(self.kernels.linear(enter_tp(x, state), self.eh_proj), state)
        x, router_loss = self.layer(x, rope)
        return self.rms_norm(x, self.final_norm, self.eps), router_loss


class MultiTokenPrediction(torch.nn.Module):
    """The D depths of the last pipeline stage and their loss (see the module docstring): the ``mtp`` head
    feature's module (its contract: :mod:`executor.head_modules`)."""

    def __init__(self, spec: ModelSpec, options: ExecutorOptions, state: ParallelState, layers: list,
                 kernels: KernelBackend, device, dtype, timer: PhaseTimer = NULL_TIMER):
        super().__init__()
        self.spec, self.state, self.timer, self.chunk_logits = spec, state, timer, options.cross_entropy_chunk_logits
        self.keep_logits = options.cross_entropy_keep_logits
        self.loss_scale = options.mtp_loss_scaling_factor
        self.padded_vocab = spec.padded_vocab_size(state.tp.size)
        self.depths = torch.nn.ModuleList(
            MTPDepth(spec, options, state, k, layer, kernels, device, dtype) for k, layer in enumerate(layers))

    def decoder_layers(self) -> list[torch.nn.Module]:
        """The depths' decoder layers, depth 1 first."""
        return [depth.layer for depth in self.depths]

    def forward(self, h0_SBH: torch.Tensor, labels_BS: torch.Tensor, rope, embedding_VH: torch.Tensor,
                output_VH: torch.Tensor, cp_positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean over depths of each depth's CE, this rank's router losses of the MTP layers, unscaled).

        ``h0_SBH``: the decoder's normalised output slice [s/tp, b, h]; ``labels_BS``: the micro-batch's labels
        at full sequence length (before CP slicing); ``embedding_VH``/``output_VH``: the shared vocab shards.
        """
        state, timer, spec = self.state, self.timer, self.spec
        b, s = labels_BS.shape
        cp = state["cp"].size
        h = h0_SBH
        total = h0_SBH.new_zeros((), dtype=torch.float32)
        router_loss = h0_SBH.new_zeros((), dtype=torch.float32)
        for k, depth in enumerate(self.depths, start=1):
            inputs, targets, valid = shifted_tokens(labels_BS, k)
            if cp_positions is not None:
                inputs, targets, valid = inputs[:, cp_positions], targets[:, cp_positions], valid[:, cp_positions]
            timer.switch("embedding")
            e = embed(inputs.t(), embedding_VH, self.padded_vocab, state)
            e = timer.mark(e, "embedding", "other")
            h, layer_loss = depth(h, e, rope, state)
            router_loss = router_loss + layer_loss
            x = timer.mark(h, "other", "lm_head_loss")
            ce = output_cross_entropy(enter_tp(x, state), output_VH, targets.t(), spec.vocab_size, self.padded_vocab,
                                      state, self.chunk_logits, self.keep_logits)  # [s_local, b]
            # global mean over the micro-batch's valid positions: CP ranks' parts average to it
            loss_k = (ce * valid.t()).sum() * cp / max(b * (s - k), 1)
            total = total + timer.mark(loss_k, "lm_head_loss", "other")
        return total / len(self.depths), router_loss
