"""An image+text dataset for training a vision-language model: a directory holding ``vl_samples.pt``, one
``torch.save`` of plain tensors (read back with ``weights_only``: :func:`executor.safe_load.load_data`):

- ``ids``: int64 [samples, seq_length] token ids, image tokens marked by the model's image token id, every
  sample placing them alike (multimodal RoPE tables are shared by a batch);
- ``images``: float32 [samples, images_per_sample, channels, height, width], already normalised pixels;
- ``heldout``: how many of the last samples are held out for evaluation;

and its header ``vl_dataset.json`` (:class:`spec.vl_dataset.VLDatasetHeader`), which the service reads without
torch.

Labels are the next token (the last one wraps), as the text-only datasets train. A sample's images become
patches through :func:`executor.vlm.images.patchify`, the patch order of transformers' Qwen2-VL processor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from spec.errors import SpecError
from spec.multimodal import ImageInputs, VisionLanguageSpec
from spec.vl_dataset import VLDatasetHeader
from executor.safe_load import load_data
from executor.vlm.images import patchify
from executor.vlm.model import VLBatch

FILE_NAME = "vl_samples.pt"


def save_vl_dataset(directory: str | Path, ids: torch.Tensor, images: torch.Tensor, heldout: int) -> Path:
    """Write a dataset (see the module docstring) into ``directory``; returns the file."""
    path = Path(directory) / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"ids": ids.long().contiguous(), "images": images.float().contiguous(), "heldout": int(heldout)}, path)
    samples, per, channels, height, width = images.shape
    VLDatasetHeader(samples, int(heldout), ids.shape[1], per, channels, height, width).write(directory)
    return path


@dataclass(frozen=True)
class VLDataset:
    """A loaded dataset: its tensors and the image inputs they hold."""

    ids: torch.Tensor
    images: torch.Tensor
    heldout: int

    @classmethod
    def load(cls, directory: str | Path) -> VLDataset:
        """SpecError naming what is wrong when ``directory`` holds no well-formed image+text dataset."""
        path = Path(directory) / FILE_NAME
        if not path.is_file():
            raise SpecError(f"{directory!s} holds no image+text dataset ({FILE_NAME})")
        data = load_data(path)
        ids, images, heldout = data.get("ids"), data.get("images"), data.get("heldout")
        if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and isinstance(images, torch.Tensor)
                and images.dim() == 5 and images.shape[0] == ids.shape[0] and isinstance(heldout, int)
                and 0 < heldout < ids.shape[0]):
            raise SpecError(f"{path}: needs ids [samples, seq], images [samples, images, C, H, W] of as many "
                            "samples and 0 < heldout < samples")
        return cls(ids, images, heldout)

    @property
    def seq_length(self) -> int:
        return self.ids.shape[1]

    @property
    def image_inputs(self) -> ImageInputs:
        return ImageInputs(self.images.shape[1], self.images.shape[3], self.images.shape[4])

    def check(self, spec: VisionLanguageSpec) -> None:
        """SpecError unless the samples fit ``spec``: ids in its vocabulary, its colour channels, each sample's
        image tokens as many as its images make and placed alike in every sample."""
        vision = spec.vision
        images = self.image_inputs
        if int(self.ids.min()) < 0 or int(self.ids.max()) >= spec.llm.vocab_size:
            raise SpecError(f"token ids must lie in [0, {spec.llm.vocab_size})")
        if self.images.shape[2] != vision.in_channels:
            raise SpecError(f"images have {self.images.shape[2]} channels, the encoder reads {vision.in_channels}")
        marked = self.ids == spec.image_token_id
        expected = images.image_tokens_per_sample(vision)  # SpecError for sides the merged patches do not tile
        if int(marked[0].sum()) != expected or not torch.equal(marked, marked[:1].expand_as(marked)):
            raise SpecError(f"every sample must mark the same {expected} positions with the image token "
                            f"{spec.image_token_id} ({images.images_per_sample} images of "
                            f"{images.image_height}x{images.image_width} px)")

    def batch(self, spec: VisionLanguageSpec, rows: list[int], device="cpu") -> VLBatch:
        """The samples ``rows`` as one micro-batch."""
        ids = self.ids[rows]
        patches, grids = [], []
        for r in rows:
            for image in self.images[r]:
                p, grid = patchify(image, spec.vision)
                patches.append(p)
                grids.append(grid)
        return VLBatch(ids.to(device), ids.roll(-1, dims=1).to(device), torch.cat(patches).to(device), tuple(grids),
                       ids)

    def rank_rows(self, split: str, position: int, global_batch_size: int, dp_size: int, dp_rank: int) -> list[int]:
        """The sample rows data-parallel rank ``dp_rank`` trains at global batch ``position`` of ``split``
        ('train': the first samples, 'heldout': the last), in order, wrapping around the split."""
        count = self.ids.shape[0]
        start, size = (0, count - self.heldout) if split == "train" else (count - self.heldout, self.heldout)
        per = global_batch_size // dp_size
        first = position * global_batch_size + dp_rank * per
        return [start + (first + i) % size for i in range(per)]
