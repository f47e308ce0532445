"""The header of an image+text dataset (executor.vlm.dataset): ``vl_dataset.json`` beside its tensors, so a
service without torch reads what it holds (sample count, sequence length, the images' shape) to check a
training before any rank loads the tensors. Sizes are counts; image sides pixels.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spec.errors import SpecError
from spec.multimodal import ImageInputs

HEADER_NAME = "vl_dataset.json"


@dataclass(frozen=True)
class VLDatasetHeader:
    samples: int
    heldout: int
    seq_length: int
    images_per_sample: int
    channels: int
    image_height: int
    image_width: int

    @property
    def image_inputs(self) -> ImageInputs:
        return ImageInputs(self.images_per_sample, self.image_height, self.image_width)

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / HEADER_NAME
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def read(cls, directory: str | Path) -> VLDatasetHeader:
        """SpecError naming what is wrong when ``directory`` holds no readable image+text dataset header."""
        path = Path(directory) / HEADER_NAME
        try:
            data: Any = json.loads(path.read_text())
            header = cls(**{k: int(data[k]) for k in cls.__dataclass_fields__})
        except FileNotFoundError:
            raise SpecError(f"{directory!s} holds no image+text dataset ({HEADER_NAME})") from None
        except (ValueError, TypeError, KeyError) as exc:
            raise SpecError(f"{path}: not an image+text dataset header ({type(exc).__name__}: {exc})") from None
        if min(header.samples, header.seq_length, header.images_per_sample, header.channels) < 1 or \
                not 0 < header.heldout < header.samples:
            raise SpecError(f"{path}: needs positive sizes and 0 < heldout < samples, got {asdict(header)}")
        return header
