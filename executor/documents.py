"""Packed micro-batches on the model's side: attention within documents, RoPE per document, loss on real tokens.

A packed micro-batch (``data prepare --pack``, :mod:`executor.dataset.packing`) brings segment ids [b, s] beside
its ids and labels. :class:`Documents` holds them over the whole sequence, in global order (every CP rank has the
whole micro-batch), and answers the attention masks the layers need: a query attends to a key when both lie in
one segment and the key is not later (and within the layer's window). On CPU, and under the all-gather and
all-to-all CP types, that boolean mask goes to the masked SDPA (or the sink path); the ring types pass the
segment ids to :func:`executor.parallel.ring_attention.ring_attention`, which masks each block. On CUDA a plain
layer without CP runs :func:`document_attention`: flex attention's block mask skips the blocks that hold no pair
of one document (torch's own kernel, compiled; checked once against the masked path, which serves if the check
fails).

RoPE positions restart at each document (:func:`rope_for`). The loss is Megatron's per-token loss: the sum of the
cross-entropy over the tokens whose label is not :data:`executor.dataset.packing.IGNORE`, over the whole global
batch, divided by the global batch's count of such tokens (:func:`masked_mean`, with the count the trainer
gathers over DP, :func:`loss_tokens`), not a mean of per-micro-batch means: a micro-batch with more real tokens
weighs more. Padding (segment id :data:`executor.dataset.packing.PADDING`) is routed through the experts but
counts in no routing statistic: the MoE layers take :meth:`Documents.real_tokens`
(:class:`executor.router.RealTokens`).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from executor.attention_core import attention_mask, special_attention
from executor.kernels.first_use import assert_agree, checked_once
from executor.dataset.packing import IGNORE, PADDING, segment_positions
from executor.parallel.collectives import all_reduce_
from executor.router import RealTokens
from spec.attention_kinds import GQA, attention_kind
from spec.errors import SpecError
from spec.head_features import head_features


class Documents:
    """Segment ids of one packed micro-batch, ``segments_BS`` [b, s] over the whole sequence in global order
    (:data:`executor.dataset.packing.PADDING` for padding); ``positions``: the global positions this CP rank
    holds (None: all), ``tp``: its TP group (sequence parallel cuts those positions into TP slices in order)."""

    def __init__(self, segments_BS: torch.Tensor, positions: torch.Tensor | None = None, tp=None):
        self.segments = segments_BS
        self._rank_positions, self._tp = positions, tp
        self._masks: dict[tuple, torch.Tensor] = {}  # one per (positions, window): every layer shares it
        self._positions: list[torch.Tensor] = []  # the positions the keys name (held: their ids stay unique)

    @property
    def seq_length(self) -> int:
        return self.segments.shape[1]

    def mask(self, q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """Boolean [b, 1, s_q, s_k] (True = attend) of queries at global ``q_positions`` against keys at
        ``k_positions``: same segment, causal, within ``window``."""
        key = (id(q_positions), id(k_positions), window)
        if key not in self._masks:
            seg = self.segments
            same = seg[:, q_positions].unsqueeze(2) == seg[:, k_positions].unsqueeze(1)
            self._masks[key] = (same & attention_mask(q_positions, k_positions, window)).unsqueeze(1)
            self._positions += [q_positions, k_positions]
        return self._masks[key]

    def real_tokens(self) -> RealTokens:
        """Which of this rank's routed tokens are real (:class:`executor.router.RealTokens`), built once for every
        MoE layer (the count is read back to the host once a micro-batch: a capacity is sized by it)."""
        if not hasattr(self, "_real"):
            real_BS = self.segments != PADDING
            per_sequence = real_BS.sum(1).float()
            mine = real_BS if self._rank_positions is None else real_BS[:, self._rank_positions]
            if self._tp is not None and self._tp.size > 1:  # this TP rank's slice of the sequence
                n = mine.shape[1] // self._tp.size
                mine = mine[:, self._tp.rank * n:(self._tp.rank + 1) * n]
            self._real = RealTokens(mine.t().reshape(-1), per_sequence, int(per_sequence.sum()))
        return self._real

    def block_mask(self):
        """Flex attention's block mask of these documents (:func:`block_mask`), built once for every layer: a
        build costs ~5 ms on an H200, several times the kernel it serves (docs/executor.md)."""
        if not hasattr(self, "_block"):
            self._block = block_mask(self.segments)
        return self._block

    def whole(self, window: int | None) -> torch.Tensor:
        """:meth:`mask` of the whole sequence against itself."""
        if not hasattr(self, "_every"):
            self._every = torch.arange(self.seq_length, device=self.segments.device)
        return self.mask(self._every, self._every, window)


def rope_for(segments_BS: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor,
             positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos and sin [b, s_local, head_dim] at each token's position within its document, from the tables
    ``cos_SD``/``sin_SD`` of positions 0..s−1; ``positions`` the global positions this (CP) rank holds, None for
    all."""
    within = segment_positions(segments_BS)
    if positions is not None:
        within = within[:, positions]
    return cos_SD[within], sin_SD[within]


def masked_mean(ce_SB: torch.Tensor, labels_BS: torch.Tensor, full_labels_BS: torch.Tensor,
                cp_size: int, tokens: torch.Tensor | float | None = None) -> torch.Tensor:
    """Cross-entropy over real tokens: this CP rank's sum over its tokens with a label (``labels_BS``, its share)
    divided by ``tokens``, times ``cp_size`` because gradients and statistics average over the CP ranks.
    ``tokens``: the real tokens per micro-batch of the global batch (:func:`loss_tokens`), so that the step's
    mean over micro-batches and DP ranks is the global per-token mean; None: this micro-batch's own count over
    the whole sequence (``full_labels_BS``), its per-token mean."""
    valid = (labels_BS != IGNORE).t()
    if tokens is None:
        tokens = (full_labels_BS != IGNORE).sum().clamp(min=1)
    return torch.where(valid, ce_SB, 0.0).sum() / tokens * cp_size


def loss_tokens(micro: list[tuple[torch.Tensor, ...]], dp) -> torch.Tensor:
    """Real (labelled) tokens per micro-batch over the global batch, fp32 scalar: this DP rank's micro-batches'
    count, summed over ``dp`` (the data-parallel group, whose ranks hold disjoint rows), divided by the number of
    micro-batches of the step (DP size × ``len(micro)``). A micro-batch's loss divided by it instead of by its own
    count, averaged as every micro-batch's is (over the rank's micro-batches, then DP·CP), is the sum over the
    global batch's real tokens divided by their global count."""
    count = sum((labels != IGNORE).sum() for _, labels, *_ in micro).float()
    count = all_reduce_(count.reshape(1), dp)[0]
    return count.clamp(min=1) / (dp.size * len(micro))


def targets(labels_BS: torch.Tensor) -> torch.Tensor:
    """Labels the cross-entropy can index (ignored ones as 0; :func:`masked_mean` drops their loss)."""
    return labels_BS.clamp(min=0)


def packed_refusal(spec, config, options) -> str | None:
    """Why a model ``spec`` under layout ``config`` with executor ``options`` cannot run packed micro-batches, or
    None."""
    if config.pp > 1 or config.vpp > 1:
        return "packed sequences run with pp = 1 (the pipeline hands stages activations, not document boundaries)"
    if head_features(spec):
        return ("packed sequences do not run with head features such as multi-token prediction (their depths shift "
                "labels across documents)")
    if options.graphs_on(config):
        return "packed sequences do not run with cuda_graphs (the captured attention has one fixed mask)"
    if config.overlap_moe_expert_parallel_comm:
        return "packed sequences do not run with the EP overlap schedule (ep_overlap)"
    if attention_kind(spec).name != GQA.name:  # multi-latent attention keeps its own core
        return f"packed sequences run with {GQA.name} attention only, not {attention_kind(spec).name}"
    return None


def check_packed(spec, config, options) -> None:
    """SpecError naming :func:`packed_refusal`'s reason, if any."""
    reason = packed_refusal(spec, config, options)
    if reason is not None:
        raise SpecError(reason)


_FLEX: dict = {}
_CHECKED: dict[tuple, bool] = {}


def _flex_kernel():
    if "compiled" not in _FLEX:  # flex attention runs its fused kernel only compiled
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["compiled"]


def block_mask(segments_BS: torch.Tensor):
    """Flex attention's block mask of causal attention within the documents of ``segments_BS`` [b, s]: which
    blocks hold a pair of one document (the rest are skipped), and the pairs within them."""
    seg = segments_BS

    def same_document(b, h, q, k):
        return (seg[b, q] == seg[b, k]) & (k <= q)

    b, s = seg.shape
    return create_block_mask(same_document, b, None, s, s, device=seg.device)


def _flex(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, segments_BS: torch.Tensor,
          block=None) -> torch.Tensor:
    block = block_mask(segments_BS) if block is None else block
    return _flex_kernel()(q_BHSD, k_BKSD, v_BKSD, block_mask=block, enable_gqa=q_BHSD.shape[1] != k_BKSD.shape[1])


def _masked(q_BHSD, k_BKSD, v_BKSD, segments_BS):
    every = torch.arange(segments_BS.shape[1], device=segments_BS.device)
    return special_attention(q_BHSD, k_BKSD, v_BKSD, Documents(segments_BS).mask(every, every, None), None)


def check_flex(dtype: torch.dtype, head_dim: int, device: str) -> None:
    """Raise unless flex attention within documents equals the masked SDPA (output and q/k/v gradients) on small
    random GQA tensors of three documents and padding; 2 % of the largest value below fp32."""
    gen = torch.Generator(device=device).manual_seed(0)
    s, tol = 256, (1e-4 if dtype == torch.float32 else 2e-2)
    segments = torch.tensor([1] * 70 + [2] * 100 + [3] * 50 + [4] * 36, device=device).view(1, s)
    tensors = [torch.randn(1, h, s, head_dim, device=device, generator=gen).to(dtype) for h in (4, 2, 2, 4)]
    results = []
    for fn in (_masked, _flex):
        leaves = [t.clone().requires_grad_() for t in tensors[:3]]
        out = fn(*leaves, segments)
        out.backward(tensors[3])
        results.append([out] + [t.grad for t in leaves])
    assert_agree(("out", "dq", "dk", "dv"), *results, tol, "flex document attention {name} differs from the masked path")


def document_attention(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor,
                       docs: Documents) -> torch.Tensor:
    """Causal attention within documents of a plain layer without CP: on CUDA flex attention, whose block mask
    skips every block that pairs no query and key of one document (checked once per dtype, head dim and device
    against the masked path, which serves if the check fails), elsewhere the masked SDPA."""
    if q_BHSD.is_cuda and checked_once(_CHECKED, (q_BHSD.dtype, q_BHSD.shape[-1], str(q_BHSD.device)), check_flex,
                                       "flex document attention"):
        return _flex(q_BHSD, k_BKSD, v_BKSD, docs.segments, docs.block_mask())
    return special_attention(q_BHSD, k_BKSD, v_BKSD, docs.whole(None), None)
