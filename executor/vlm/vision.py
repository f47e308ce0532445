"""The vision encoder and its projectors as torch modules (one process: the encoder's own layouts are the next
step; the LLM under it runs any folded layout the executor runs).

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
from executor.vlm.positions import resampled_positions, vision_rope


def _act(name: str):
    return (lambda x: F.gelu(x, approximate="tanh")) if name == "gelu_tanh" else F.gelu


class VisionBlock(torch.nn.Module):
    """Pre-norm block: x + proj(attention(norm1(x))), then x + fc2(act(fc1(norm2(x)))); LayerNorms, biases."""

    def __init__(self, vision: VisionEncoderSpec, device, dtype):
        super().__init__()
        h, kw = vision.hidden_size, {"device": device, "dtype": dtype}
        self.heads, self.act = vision.num_attention_heads, _act(vision.activation)
        self.norm1 = torch.nn.LayerNorm(h, eps=vision.norm_epsilon, **kw)
        self.norm2 = torch.nn.LayerNorm(h, eps=vision.norm_epsilon, **kw)
        self.qkv = torch.nn.Linear(h, 3 * h, **kw)
        self.proj = torch.nn.Linear(h, h, **kw)
        self.fc1 = torch.nn.Linear(h, vision.ffn_hidden_size, **kw)
        self.fc2 = torch.nn.Linear(vision.ffn_hidden_size, h, **kw)

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
        x = x_NH + self.attention(self.norm1(x_NH), lengths, cos, sin)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class Projector(torch.nn.Module):
    """m² neighbouring patch vectors → one LLM token: LayerNorm (per patch, or over the merged vector when
    ``merged_norm``: the deepstack projectors), fc1, exact GELU, fc2 into the LLM's hidden size."""

    def __init__(self, vision: VisionEncoderSpec, merged_norm: bool, device, dtype):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        merged = vision.merged_hidden_size
        self.merged_norm = merged_norm
        self.norm = torch.nn.LayerNorm(merged if merged_norm else vision.hidden_size, eps=vision.norm_epsilon, **kw)
        self.fc1 = torch.nn.Linear(merged, merged, **kw)
        self.fc2 = torch.nn.Linear(merged, vision.out_hidden_size, **kw)

    def forward(self, x_NH: torch.Tensor) -> torch.Tensor:
        merged = self.fc1.in_features
        x = self.norm(x_NH.reshape(-1, merged)) if self.merged_norm else self.norm(x_NH).reshape(-1, merged)
        return self.fc2(F.gelu(self.fc1(x)))


class VisionEncoder(torch.nn.Module):
    """Patch embedding (a linear map of each flattened patch: Conv3d with stride = kernel), learned positions
    resampled to each image's grid, 2-D RoPE, ``num_layers`` blocks, the projector and the deepstack ones."""

    def __init__(self, vision: VisionEncoderSpec, rotary_base: float = 10000.0, device="cpu",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.vision, self.rotary_base = vision, rotary_base
        kw = {"device": device, "dtype": dtype}
        self.patch_embed = torch.nn.Linear(vision.patch_dim, vision.hidden_size, **kw)
        self.pos_embed = torch.nn.Parameter(torch.empty(vision.num_position_embeddings, vision.hidden_size, **kw))
        torch.nn.init.normal_(self.pos_embed, std=0.02)
        self.blocks = torch.nn.ModuleList(VisionBlock(vision, device, dtype) for _ in range(vision.num_layers))
        self.projector = Projector(vision, False, device, dtype)
        self.deepstack = torch.nn.ModuleList(Projector(vision, True, device, dtype)
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
