"""A vision-language MoE model: :class:`~executor.vlm.vision.VisionEncoder` feeding the executor's
:class:`~executor.model.MoEGPT` (the LLM, any folded layout with pp = cp = tp = 1 here, data and expert
parallel: the image tokens replace embedding rows of whole sequences; sharded sequences are not built yet).
With ``encoder_group`` the encoder runs colocated in its own tensor-parallel group over the LLM's ranks, behind
the boundary communicators of :mod:`executor.vlm.boundary`.

The LLM's input: token embeddings with each image token's row replaced, in order, by the projector's outputs
(row-major over [b, s]); the deepstack tokens are added at the same rows after the LLM's first layers, one per
deepstack layer; positions are multimodal RoPE (:func:`executor.vlm.positions.mrope_tables`), which needs every
sample of a batch to place its images alike (a synthetic profiling batch does; a real one is padded to it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spec.errors import InvalidConfigError
from spec.multimodal import VisionLanguageSpec
from executor.model import LossOutput, MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import Group, ParallelState
from executor.parallel.vocab import embed
from executor.vlm.boundary import gather_images, take_share
from executor.vlm.positions import mrope_positions, mrope_tables
from executor.vlm.vision import VisionEncoder


@dataclass(frozen=True)
class VLBatch:
    """One micro-batch: ``ids`` [b, s] (image tokens marked by the model's image_token_id), ``labels`` [b, s],
    ``patches`` [all images' patches, patch_dim] (sample by sample, image by image) and each image's patch
    ``grids`` (rows, cols) in the same order."""

    ids: torch.Tensor
    labels: torch.Tensor
    patches: torch.Tensor
    grids: tuple[tuple[int, int], ...]


class VisionLanguageMoE(torch.nn.Module):
    """The encoder (``encoder``) and this rank's LLM (``llm``); ``mrope_section``: the LLM's RoPE split."""

    def __init__(self, spec: VisionLanguageSpec, state: ParallelState, options: ExecutorOptions | None = None,
                 seq_length: int | None = None, mrope_section: tuple[int, int, int] = (24, 20, 20),
                 vision_rotary_base: float = 10000.0, device="cpu", dtype: torch.dtype = torch.float32,
                 encoder_group: Group | None = None):
        super().__init__()
        for dim in ("tp", "cp", "pp"):
            if state[dim].size > 1:
                raise InvalidConfigError(f"the vision-language model runs with {dim} = 1 until the boundary "
                                         f"communicators are built (got {dim} = {state[dim].size})")
        if sum(mrope_section) != spec.llm.rotary_head_dim // 2:
            raise InvalidConfigError(f"mrope_section {mrope_section} must sum to the LLM's rotary pairs "
                                     f"({spec.llm.rotary_head_dim // 2})")
        self.spec, self.state, self.mrope_section = spec, state, tuple(mrope_section)
        self.encoder_group = encoder_group
        self.encoder = VisionEncoder(spec.vision, vision_rotary_base, device, dtype, encoder_group)
        self.llm = MoEGPT(spec.llm, state, options, seq_length, device, dtype)

    def encode(self, batch: VLBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(this rank's image tokens, its deepstack tokens): encoded here, or by the encoder group from the
        images of all its members (each sends its micro-batch's, alike in shape), this rank's rows taken back."""
        group = self.encoder_group
        patches, start, end = gather_images(batch.patches, group)
        size = 1 if group is None else group.size
        tokens, deep = self.encoder(patches, list(batch.grids) * size)
        merge = self.spec.vision.spatial_merge_size ** 2
        share = (start // merge, end // merge)
        return take_share(tokens, *share, group), [take_share(d, *share, group) for d in deep]

    def _inputs(self, batch: VLBatch, encoded=None):
        """(LLM input [s, b, h], rope, image-row mask [b, s], deepstack tokens); ``encoded``: (tokens, deepstack
        tokens) another rank encoded (the separate placement), else this model's encoder runs."""
        llm, spec = self.llm, self.spec
        is_image = batch.ids == spec.image_token_id
        if not torch.equal(is_image, is_image[:1].expand_as(is_image)):
            raise ValueError("every sample of a batch must place its image tokens alike (multimodal RoPE tables "
                             "are shared by the batch)")
        tokens, deep = self.encode(batch) if encoded is None else encoded
        if tokens.shape[0] != int(is_image.sum()):
            raise ValueError(f"the images make {tokens.shape[0]} tokens, the text marks {int(is_image.sum())}")
        x_SBH = embed(batch.ids.t(), llm.embedding, llm.padded_vocab, self.state)
        x_BSH = x_SBH.transpose(0, 1).masked_scatter(is_image[..., None], tokens.to(x_SBH.dtype))
        per_sample = len(batch.grids) // batch.ids.shape[0]
        positions = mrope_positions(is_image[0].tolist(), list(batch.grids[:per_sample]),
                                    spec.vision.spatial_merge_size).to(x_SBH.device)
        cos, sin = mrope_tables(positions, spec.llm.rotary_head_dim, llm.options.rotary_base, self.mrope_section)
        return x_BSH.transpose(0, 1), (cos, sin), is_image, deep

    def _decoder(self, batch: VLBatch, encoded=None):
        x, rope, is_image, deep = self._inputs(batch, encoded)
        router_loss = x.new_zeros((), dtype=torch.float32)
        for index, layer in enumerate(self.llm.layers):
            x, layer_loss = layer(x, rope)
            router_loss = router_loss + layer_loss
            if index < len(deep):  # deepstack: the encoder's earlier features join the first LLM layers
                rows = is_image[..., None]
                x = x.transpose(0, 1).masked_scatter(rows, x.transpose(0, 1)[is_image] + deep[index]).transpose(0, 1)
        return x, router_loss, rope

    @torch.no_grad()
    def logits(self, batch: VLBatch) -> torch.Tensor:
        """fp32 logits [b, s, vocab_size]."""
        x, _, _ = self._decoder(batch)
        llm = self.llm
        x = llm.kernels.rms_norm(x, llm.final_norm, llm.options.norm_epsilon)
        weight = llm.lm_head if llm.lm_head is not None else llm.embedding
        return F.linear(x, weight).float()[..., : self.spec.llm.vocab_size].transpose(0, 1).contiguous()

    def forward(self, batch: VLBatch, encoded=None) -> LossOutput:
        """Mean cross-entropy of the micro-batch's labels plus the LLM's router losses (``encoded``: as
        :meth:`_inputs` takes it)."""
        x, router_loss, rope = self._decoder(batch, encoded)
        return self.llm.chunk_output(0, x, router_loss, rope, batch.labels, batch.labels)
