"""A multimodal layout: the LLM's folded :class:`~spec.parallel_config.ParallelConfig`, the vision encoder's own
layout (tp, cp, pp, dp) and where the encoder runs (:data:`~spec.layout_codec.PLACEMENTS`).

Only types and ranges are checked here; the rules (the encoder's sizes split its widths, its ranks fold the
world of its placement, ...) are the rule book's (:func:`spec.validity.check_multimodal`). Text and JSON forms:
:class:`~spec.layout_codec.MultimodalCodec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spec._validate import positive_ints, raise_if, require
from spec.layout_codec import PLACEMENTS, MultimodalCodec
from spec.parallel_config import ParallelConfig


@dataclass(frozen=True)
class MultimodalLayout(MultimodalCodec):
    """``llm``: the LLM's layout over its GPUs; ``placement``; the encoder's ``encoder_tp`` (tensor parallel over
    its heads and MLP), ``encoder_cp`` (the patches of each image split over ranks), ``encoder_pp`` (its blocks
    in stages) and ``encoder_dp`` (images split over replicas). Homogeneous: the encoder's sizes are the LLM's
    tp, cp and dp, pp 1 (it runs on the LLM's first pipeline stage)."""

    LLM_LAYOUT = ParallelConfig

    llm: ParallelConfig
    placement: str = "homogeneous"
    encoder_tp: int = 1
    encoder_cp: int = 1
    encoder_pp: int = 1
    encoder_dp: int = 1

    def __post_init__(self) -> None:
        p: list[str] = []
        positive_ints(p, self, ("encoder_tp", "encoder_cp", "encoder_pp", "encoder_dp"))
        require(p, self.placement in PLACEMENTS, f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.placement == "homogeneous" and not p:
            inherited = (self.llm.tp, self.llm.cp, 1, self.llm.dp)
            require(p, self.encoder_sizes == inherited,
                    f"a homogeneous encoder inherits (tp, cp, pp, dp) = {inherited} from the LLM, got "
                    f"{self.encoder_sizes}")
        raise_if(p, "multimodal layout")

    @classmethod
    def homogeneous(cls, llm: ParallelConfig) -> MultimodalLayout:
        """The encoder in the LLM's layout: its tp and cp, dp over the LLM's first pipeline stage."""
        return cls(llm=llm, placement="homogeneous", encoder_tp=llm.tp, encoder_cp=llm.cp, encoder_pp=1,
                   encoder_dp=llm.dp)

    @property
    def encoder_sizes(self) -> tuple[int, int, int, int]:
        return (self.encoder_tp, self.encoder_cp, self.encoder_pp, self.encoder_dp)

    @property
    def encoder_world(self) -> int:
        """GPUs the encoder's groups span (for homogeneous: the LLM's first pipeline stage)."""
        return self.encoder_tp * self.encoder_cp * self.encoder_pp * self.encoder_dp

    @property
    def world_size(self) -> int:
        """All GPUs: the LLM's, plus the encoder's own when separate."""
        return self.llm.world_size + (self.encoder_world if self.placement == "separate" else 0)

    @property
    def is_heterogeneous(self) -> bool:
        return self.placement != "homogeneous"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MultimodalLayout:
        rest = {k: v for k, v in data.items() if k != "llm"}
        return cls(llm=ParallelConfig.from_dict(data["llm"]), **rest)


def layout_from_dict(data: dict[str, Any]) -> ParallelConfig | MultimodalLayout:
    """A stored layout's JSON form read back: a multimodal layout's (it has the LLM's under ``llm``), else a
    ParallelConfig's."""
    return MultimodalLayout.from_dict(data) if "llm" in data else ParallelConfig.from_dict(data)
