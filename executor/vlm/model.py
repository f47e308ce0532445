"""A vision-language MoE model: :class:`~executor.vlm.vision.VisionEncoder` feeding the executor's
:class:`~executor.model.MoEGPT` (the LLM, any folded layout: data and expert parallel, tensor (sequence) and
context parallel, each rank writing the image tokens of the sequence positions it holds; pipelined chunk by
chunk through :meth:`VisionLanguageMoE.forward_chunk`, the image tokens entering the first stage).
With ``encoder_group`` the encoder runs colocated in its own tensor-parallel group over the LLM's ranks, behind
the boundary communicators of :mod:`executor.vlm.boundary`. Under the separate placement a rank builds one part
(``parts``): the encoder on the encoder's ranks, the LLM on the LLM's, the tokens moved by
:mod:`executor.vlm.separate`.

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
    # ``ids`` on the host, where the batch was made there: the model reads where the image tokens sit from it
    # rather than from the device (each such read would wait for the GPU to drain its queue)
    ids_host: torch.Tensor | None = None


class VisionLanguageMoE(torch.nn.Module):
    """The encoder (``encoder``) and this rank's LLM (``llm``); ``mrope_section``: the LLM's RoPE split.
    ``parts``: "both", or only "encoder" / "llm" (the other attribute None); ``llm_seed``: the CPU and device
    generators are re-seeded with it before the LLM's weights are drawn (None: they follow the encoder's)."""

    def __init__(self, spec: VisionLanguageSpec, state: ParallelState, options: ExecutorOptions | None = None,
                 seq_length: int | None = None, mrope_section: tuple[int, int, int] = (24, 20, 20),
                 vision_rotary_base: float = 10000.0, device="cpu", dtype: torch.dtype = torch.float32,
                 encoder_group: Group | None = None, parts: str = "both", llm_seed: int | None = None):
        super().__init__()
        if parts not in ("both", "encoder", "llm"):
            raise ValueError(f"parts must be 'both', 'encoder' or 'llm', got {parts!r}")
        if sum(mrope_section) != spec.llm.rotary_head_dim // 2:
            raise InvalidConfigError(f"mrope_section {mrope_section} must sum to the LLM's rotary pairs "
                                     f"({spec.llm.rotary_head_dim // 2})")
        self.spec, self.state, self.mrope_section = spec, state, tuple(mrope_section)
        self.encoder_group = encoder_group
        self.encoder = VisionEncoder(spec.vision, vision_rotary_base, device, dtype, encoder_group) \
            if parts != "llm" else None
        if llm_seed is not None:  # the LLM's weights then depend neither on the encoder's shards nor on its ranks
            torch.manual_seed(llm_seed)
        self.llm = MoEGPT(spec.llm, state, options, seq_length, device, dtype) if parts != "encoder" else None

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
        """(this rank's LLM input [s/(cp·tp), b, h], rope tables of its CP share, a function that writes image
        rows into its sequence slice, its labels); ``encoded``: (tokens, deepstack tokens) another rank encoded
        (the separate placement), else this model's encoder runs.

        Under CP the rank keeps its load-balanced share of the sequence (``MoEGPT.cp_positions``), under TP
        (sequence parallel) the contiguous ``1/tp`` of that share the embedding's reduce-scatter leaves it: the
        image tokens, the deepstack tokens and the multimodal RoPE tables follow the positions it holds."""
        llm, spec, tp = self.llm, self.spec, self.state.tp
        device = batch.ids.device
        is_image, keep_host, keep, (cos, sin) = self._tables(batch)
        tokens, deep = self.encode(batch) if encoded is None else encoded
        b, per_sample_tokens = batch.ids.shape[0], int(is_image[0].sum())
        if tokens.shape[0] != b * per_sample_tokens:
            raise ValueError(f"the images make {tokens.shape[0]} tokens, the text marks {int(is_image.sum())}")
        ids, labels = batch.ids[:, keep], batch.labels[:, keep]
        order = (torch.cumsum(is_image[0].long(), 0) - 1)[keep_host]  # each kept position's index among images'
        chunk = keep_host.numel() // tp.size
        rows = slice(tp.rank * chunk, (tp.rank + 1) * chunk)  # the sequence-parallel slice this rank holds
        held = is_image[0, keep_host][rows]  # [s/(cp·tp)]: alike in every sample
        local = torch.nonzero(held).flatten()  # the held image rows, in sequence order
        picks = order[rows][local].to(device, non_blocking=True)
        # row r of sample j sits at r·b + j of the [s/(cp·tp), b, h] activations flattened: sample-major, as the
        # picked tokens below are ordered
        into = (local[None, :] * b + torch.arange(b)[:, None]).flatten().to(device, non_blocking=True)

        def place(x_SBH: torch.Tensor, values: torch.Tensor, add: bool) -> torch.Tensor:
            width = values.shape[-1]
            mine = values.view(b, per_sample_tokens, width)[:, picks].reshape(-1, width).to(x_SBH.dtype)
            flat = x_SBH.reshape(-1, x_SBH.shape[-1])
            out = flat.index_add(0, into, mine) if add else flat.index_copy(0, into, mine)
            return out.view(x_SBH.shape)

        x = place(embed(ids.t(), llm.embedding, llm.padded_vocab, self.state), tokens, add=False)
        return x, (cos[keep], sin[keep]), place, deep, labels

    def _kept_positions(self, seq_length: int) -> torch.Tensor:
        """The sequence positions this rank keeps (its CP share, else all), on the host; read from the device
        once per length."""
        cached = getattr(self, "_kept", None)
        if cached is None or cached[0] != seq_length:
            positions = self.llm.cp_positions
            kept = torch.arange(seq_length) if positions is None else positions.cpu()
            self._kept = cached = (seq_length, kept)
        return cached[1]

    def _tables(self, batch: VLBatch):
        """(where the image tokens are [b, s], the sequence positions this rank keeps (its CP share), both on the
        host; those positions on the device; the multimodal RoPE tables (cos, sin) of every position). Read from
        the host, so the step never waits for the device to tell where the images are."""
        llm, spec = self.llm, self.spec
        device = batch.ids.device
        ids_host = batch.ids_host if batch.ids_host is not None else batch.ids.cpu()
        is_image = ids_host == spec.image_token_id
        if not torch.equal(is_image, is_image[:1].expand_as(is_image)):
            raise ValueError("every sample of a batch must place its image tokens alike (multimodal RoPE tables "
                             "are shared by the batch)")
        per_sample = len(batch.grids) // batch.ids.shape[0]
        positions = mrope_positions(is_image[0], list(batch.grids[:per_sample]),
                                    spec.vision.spatial_merge_size).to(device, non_blocking=True)
        tables = mrope_tables(positions, spec.llm.rotary_head_dim, llm.options.rotary_base, self.mrope_section)
        keep_host = self._kept_positions(batch.ids.shape[1])
        return is_image, keep_host, keep_host.to(device, non_blocking=True), tables

    def forward_chunk(self, chunk: int, batch: VLBatch, x: torch.Tensor | None, encoded) -> LossOutput:
        """Pipeline chunk ``chunk`` of the LLM (pp > 1): on the model's first chunk its input is the micro-batch
        with ``encoded`` image tokens (the encoder ran before the schedule) and the deepstack tokens join its
        first layers; elsewhere ``x`` is the previous chunk's activations and the batch gives the multimodal
        RoPE tables and labels."""
        llm = self.llm
        if llm.is_first_chunk(chunk):
            x, rope, place, deep, labels = self._inputs(batch, encoded)
            if len(deep) > len(llm.chunk_layers[chunk]):
                raise InvalidConfigError(f"the first pipeline chunk holds {len(llm.chunk_layers[chunk])} layers; "
                                         f"the deepstack tokens join the first {len(deep)}")
        else:
            _, _, keep, (cos, sin) = self._tables(batch)
            rope, labels, deep, place = (cos[keep], sin[keep]), batch.labels[:, keep], [], None
        router_loss = x.new_zeros((), dtype=torch.float32)
        for index, position in enumerate(llm.chunk_layers[chunk]):
            x, layer_loss = llm.layers[position](x, rope)
            router_loss = router_loss + layer_loss
            if index < len(deep):
                x = place(x, deep[index], add=True)
        return llm.chunk_output(chunk, x, router_loss, rope, labels, batch.labels)

    def _decoder(self, batch: VLBatch, encoded=None):
        x, rope, place, deep, labels = self._inputs(batch, encoded)
        router_loss = x.new_zeros((), dtype=torch.float32)
        for index, layer in enumerate(self.llm.layers):
            x, layer_loss = layer(x, rope)
            router_loss = router_loss + layer_loss
            if index < len(deep):  # deepstack: the encoder's earlier features join the first LLM layers
                x = place(x, deep[index], add=True)
        return x, router_loss, rope, labels

    @torch.no_grad()
    def logits(self, batch: VLBatch) -> torch.Tensor:
        """fp32 logits [b, s, vocab_size] (tp = cp = 1)."""
        if self.state.tp.size > 1 or self.state["cp"].size > 1:
            raise InvalidConfigError("logits are read with tp = cp = 1; training runs any tp and cp")
        x, _, _, _ = self._decoder(batch)
        llm = self.llm
        x = llm.kernels.rms_norm(x, llm.final_norm, llm.options.norm_epsilon)
        weight = llm.lm_head if llm.lm_head is not None else llm.embedding
        return F.linear(x, weight).float()[..., : self.spec.llm.vocab_size].transpose(0, 1).contiguous()

    def forward(self, batch: VLBatch, encoded=None) -> LossOutput:
        """Mean cross-entropy of the micro-batch's labels plus the LLM's router losses (``encoded``: as
        :meth:`_inputs` takes it). pp = 1: a pipelined LLM runs chunk by chunk (:meth:`forward_chunk`)."""
        if self.state["pp"].size > 1:
            raise RuntimeError("a pipelined LLM runs chunk by chunk: use executor.vlm.train's schedule")
        x, router_loss, rope, labels = self._decoder(batch, encoded)
        return self.llm.chunk_output(0, x, router_loss, rope, labels, batch.labels)
