"""The vision encoder and its projectors as torch modules, optionally tensor parallel over the encoder's own
group (``group``: :class:`executor.parallel.groups.Group`, None or size one: the whole encoder on this rank).

Under encoder TP the attention heads, the MLP's hidden units and the projectors' hidden units are split over
the group (column-parallel in, row-parallel out, one all-reduce after each row-parallel layer, whose bias is
added once after it); LayerNorms, the patch embedding and the position grid are replicated, their inputs
entering the parallel region through an identity whose backward all-reduces, so every rank holds the same
gradient of them.

Shapes: patches [N, patch_dim] of all images of a batch in merge-window order (:mod:`executor.vlm.positions`),
``grids`` the (rows, cols) patch grid of each image. Attention is bidirectional within an image and never
crosses images. The output is the projector's tokens [N / m², llm hidden] and one such tensor per deepstack
layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spec.multimodal import VisionEncoderSpec
from executor.attention import apply_rope
from executor.parallel.collectives import all_reduce
from executor.parallel.groups import Group
from executor.vlm.boundary import enter_group
from executor.vlm.positions import resampled_positions, vision_rope


def _size(group: Group | None) -> int:
    return 1 if group is None else group.size


class _RowParallel(torch.nn.Module):
    """A linear layer whose input features are split over ``group``: partial products summed by an all-reduce,
    then the (replicated) bias."""

    def __init__(self, in_features: int, out_features: int, group: Group | None, device, dtype):
        super().__init__()
        self.group = group
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features // _size(group), device=device,
                                                     dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if _size(self.group) > 1:
            y = all_reduce(y, self.group)
        return y + self.bias


def _act(name: str):
    return (lambda x: F.gelu(x, approximate="tanh")) if name == "gelu_tanh" else F.gelu


class VisionBlock(torch.nn.Module):
    """Pre-norm block: x + proj(attention(norm1(x))), then x + fc2(act(fc1(norm2(x)))); LayerNorms, biases."""

    def __init__(self, vision: VisionEncoderSpec, device, dtype, group: Group | None = None):
        super().__init__()
        h, kw, tp = vision.hidden_size, {"device": device, "dtype": dtype}, _size(group)
        self.group = group
        self.heads, self.act = vision.num_attention_heads // tp, _act(vision.activation)
        self.norm1 = torch.nn.LayerNorm(h, eps=vision.norm_epsilon, **kw)
        self.norm2 = torch.nn.LayerNorm(h, eps=vision.norm_epsilon, **kw)
        self.qkv = torch.nn.Linear(h, 3 * h // tp, **kw)  # this rank's heads: [q | k | v] of each
        self.proj = _RowParallel(h, h, group, device, dtype)
        self.fc1 = torch.nn.Linear(h, vision.ffn_hidden_size // tp, **kw)
        self.fc2 = _RowParallel(vision.ffn_hidden_size, h, group, device, dtype)

    def attention(self, x_NH: torch.Tensor, lengths: list[int], cos, sin) -> torch.Tensor:
        n = x_NH.shape[0]
        q, k, v = self.qkv(x_NH).reshape(n, 3, self.heads, -1).permute(1, 2, 0, 3).unbind(0)  # [heads, N, d]
        # RoPE in fp32 whatever the weights' dtype, as the encoder was trained
        q = apply_rope(q.float(), cos, sin).to(v.dtype)
        k = apply_rope(k.float(), cos, sin).to(v.dtype)
        if len(set(lengths)) == 1:  # equal images: one batched call, image as the batch dimension
            count, each = len(lengths), lengths[0]
            split = [t.reshape(self.heads, count, each, -1).transpose(0, 1) for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*split)  # [images, heads, each, d]
            out = out.transpose(0, 1).reshape(self.heads, n, -1)
        else:
            out = torch.cat([F.scaled_dot_product_attention(a, b, c) for a, b, c in
                             zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1))], dim=1)
        return self.proj(out.transpose(0, 1).reshape(n, -1))

    def forward(self, x_NH: torch.Tensor, lengths: list[int], cos, sin) -> torch.Tensor:
        x = x_NH + self.attention(enter_group(self.norm1(x_NH), self.group), lengths, cos, sin)
        return x + self.fc2(self.act(self.fc1(enter_group(self.norm2(x), self.group))))


class Projector(torch.nn.Module):
    """m² neighbouring patch vectors → one LLM token: LayerNorm (per patch, or over the merged vector when
    ``merged_norm``: the deepstack projectors), fc1, exact GELU, fc2 into the LLM's hidden size."""

    def __init__(self, vision: VisionEncoderSpec, merged_norm: bool, device, dtype, group: Group | None = None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        merged = vision.merged_hidden_size
        self.merged_norm, self.group = merged_norm, group
        self.norm = torch.nn.LayerNorm(merged if merged_norm else vision.hidden_size, eps=vision.norm_epsilon, **kw)
        self.fc1 = torch.nn.Linear(merged, merged // _size(group), **kw)
        self.fc2 = _RowParallel(merged, vision.out_hidden_size, group, device, dtype)

    def forward(self, x_NH: torch.Tensor) -> torch.Tensor:
        merged = self.fc1.in_features
        x = self.norm(x_NH.reshape(-1, merged)) if self.merged_norm else self.norm(x_NH).reshape(-1, merged)
        return self.fc2(F.gelu(self.fc1(enter_group(x, self.group))))


class VisionEncoder(torch.nn.Module):
    """Patch embedding (a linear map of each flattened patch: Conv3d with stride = kernel), learned positions
    resampled to each image's grid, 2-D RoPE, ``num_layers`` blocks, the projector and the deepstack ones."""

    def __init__(self, vision: VisionEncoderSpec, rotary_base: float = 10000.0, device="cpu",
                 dtype: torch.dtype = torch.float32, group: Group | None = None):
        super().__init__()
        if vision.num_attention_heads % _size(group) or vision.ffn_hidden_size % _size(group):
            raise ValueError(f"encoder tp {_size(group)} must divide the vision heads and MLP width")
        self.group = group
        self.vision, self.rotary_base = vision, rotary_base
        kw = {"device": device, "dtype": dtype}
        self.patch_embed = torch.nn.Linear(vision.patch_dim, vision.hidden_size, **kw)
        self.pos_embed = torch.nn.Parameter(torch.empty(vision.num_position_embeddings, vision.hidden_size, **kw))
        torch.nn.init.normal_(self.pos_embed, std=0.02)
        self.blocks = torch.nn.ModuleList(VisionBlock(vision, device, dtype, group) for _ in range(vision.num_layers))
        self.projector = Projector(vision, False, device, dtype, group)
        self.deepstack = torch.nn.ModuleList(Projector(vision, True, device, dtype, group)
                                             for _ in vision.deepstack_layers)

    def forward(self, patches_NP: torch.Tensor, grids: list[tuple[int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(image tokens [N/m², llm hidden], deepstack tokens: one such tensor per deepstack layer)."""
        v = self.vision
        lengths = [h * w for h, w in grids]
        if sum(lengths) != patches_NP.shape[0]:
            raise ValueError(f"{patches_NP.shape[0]} patches given, the grids {grids} hold {sum(lengths)}")
        x = self.patch_embed(patches_NP.to(self.patch_embed.weight.dtype))
        x = x + torch.cat([resampled_positions(self.pos_embed, h, w, v.spatial_merge_size) for h, w in grids])
        cos, sin = vision_rope(v, grids, self.rotary_base, x.device)
        deep: list[torch.Tensor] = []
        for index, block in enumerate(self.blocks):
            x = block(x, lengths, cos, sin)
            if index in v.deepstack_layers:
                deep.append(self.deepstack[v.deepstack_layers.index(index)](x))
        return self.projector(x), deep
