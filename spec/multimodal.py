"""Vision-language MoE models: a ViT-style vision encoder, a projector into the LLM's hidden size, and any MoE
LLM of the catalog (a :class:`~spec.model_spec.ModelSpec`), plus the image inputs of a training run.

The encoder is the Qwen2/3-VL kind: an image is cut into ``patch_size``² pixel patches (each patch stacks
``temporal_patch_size`` frames: a still image is repeated), embedded by one linear map (a Conv3d whose stride is
its kernel), run through ``num_layers`` pre-norm blocks of *bidirectional* attention (every patch of an image
sees every other patch of the same image, none of another image) and a GELU MLP. The projector (Qwen's
"merger") concatenates each ``spatial_merge_size``² neighbourhood of patch vectors and maps it through a
two-layer GELU MLP to the LLM's hidden size: one image *token* of the LLM per neighbourhood. Deepstack
layers (Qwen3-VL) hand the outputs of some encoder blocks, each through its own projector, to the first LLM
layers, added to the hidden states at the image positions.

Sizes are element counts; image sizes are pixels. Pure Python: the cost model and the planner read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from spec._validate import positive_ints, raise_if, require
from spec.errors import SpecError
from spec.limits import MAX_LAYERS, MAX_WIDTH
from spec.model_spec import ModelSpec
from spec.suggest import unknown_fields

#: the encoder MLP's activations: HF's gelu_pytorch_tanh and exact gelu
VISION_ACTIVATIONS = ("gelu_tanh", "gelu")
#: largest image side accepted (pixels), far above any published encoder's native resolution
MAX_IMAGE_SIDE = 1 << 15
#: largest images per training sample
MAX_IMAGES_PER_SAMPLE = 4096


@dataclass(frozen=True)
class VisionEncoderSpec:
    """A ViT-style vision encoder and its projector, in Megatron's argument names.

    ``hidden_size``/``ffn_hidden_size``/``num_attention_heads``/``num_layers``: the encoder's blocks (LayerNorm,
    biased linear layers); ``patch_size``: pixels per patch side; ``temporal_patch_size``: frames per patch;
    ``in_channels``: colour channels; ``spatial_merge_size``: patch neighbourhood side merged into one LLM token;
    ``num_position_embeddings``: the learned position grid (a square, interpolated to each image's grid);
    ``deepstack_layers``: encoder blocks (0-based) whose outputs also feed the LLM's first layers;
    ``out_hidden_size``: the projector's output width, which must equal the LLM's hidden size.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_layers: tuple[int, ...] = ()
    activation: str = "gelu_tanh"
    norm_epsilon: float = 1e-6

    def __post_init__(self) -> None:
        if isinstance(self.deepstack_layers, list):
            object.__setattr__(self, "deepstack_layers", tuple(self.deepstack_layers))
        p: list[str] = []
        positive_ints(p, self, ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                "out_hidden_size", "patch_size", "temporal_patch_size", "in_channels",
                                "spatial_merge_size", "num_position_embeddings"))
        if not p:
            require(p, self.num_layers <= MAX_LAYERS, f"num_layers {self.num_layers} exceeds {MAX_LAYERS}")
            for name in ("hidden_size", "ffn_hidden_size", "out_hidden_size"):
                require(p, getattr(self, name) <= MAX_WIDTH, f"{name} {getattr(self, name)} exceeds {MAX_WIDTH}")
            require(p, self.hidden_size % self.num_attention_heads == 0,
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads})")
            side = int(round(self.num_position_embeddings ** 0.5))
            require(p, side * side == self.num_position_embeddings,
                    f"num_position_embeddings ({self.num_position_embeddings}) must be a square (a grid)")
            require(p, all(isinstance(i, int) and 0 <= i < self.num_layers for i in self.deepstack_layers),
                    f"deepstack_layers {self.deepstack_layers} must be encoder layers in [0, {self.num_layers})")
            require(p, len(set(self.deepstack_layers)) == len(self.deepstack_layers),
                    f"deepstack_layers {self.deepstack_layers} repeat a layer")
        require(p, self.activation in VISION_ACTIVATIONS,
                f"activation must be one of {VISION_ACTIVATIONS}, got {self.activation!r}")
        raise_if(p, "vision encoder")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: in_channels · temporal_patch_size · patch_size²."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merged_hidden_size(self) -> int:
        """The projector's input (and hidden) width: spatial_merge_size² patch vectors concatenated."""
        return self.hidden_size * self.spatial_merge_size ** 2

    @property
    def num_projectors(self) -> int:
        """The main projector and one per deepstack layer."""
        return 1 + len(self.deepstack_layers)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["deepstack_layers"] = list(self.deepstack_layers)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VisionEncoderSpec:
        return _from_dict(cls, "vision encoder", data)


@dataclass(frozen=True)
class VisionLanguageSpec:
    """A vision-language model: ``vision`` (encoder + projector) feeding the MoE LLM ``llm``.

    ``image_token_id``: the vocabulary id that marks an image token in the text (its embedding is replaced by
    the projector's output). The LLM is any catalog ModelSpec; its hidden size must be the projector's output.
    """

    name: str
    vision: VisionEncoderSpec
    llm: ModelSpec
    image_token_id: int = 0

    def __post_init__(self) -> None:
        p: list[str] = []
        require(p, bool(self.name), "name must not be empty")
        require(p, self.vision.out_hidden_size == self.llm.hidden_size,
                f"the projector's out_hidden_size ({self.vision.out_hidden_size}) must equal the LLM's hidden_size "
                f"({self.llm.hidden_size})")
        require(p, self.llm.is_moe, f"the LLM {self.llm.name!r} must be a MoE model (num_experts set)")
        require(p, 0 <= self.image_token_id < self.llm.vocab_size,
                f"image_token_id ({self.image_token_id}) must lie in [0, vocab_size={self.llm.vocab_size})")
        require(p, len(self.vision.deepstack_layers) <= self.llm.num_layers,
                f"{len(self.vision.deepstack_layers)} deepstack layers feed more LLM layers than the "
                f"{self.llm.num_layers} there are")
        raise_if(p, f"vision-language model {self.name!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "vision": self.vision.to_dict(), "llm": self.llm.to_dict(),
                "image_token_id": self.image_token_id}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VisionLanguageSpec:
        if not isinstance(data, dict) or not isinstance(data.get("vision"), dict) or not isinstance(data.get("llm"), dict):
            raise SpecError("a vision-language model needs the mappings 'vision' and 'llm' and a 'name'")
        rest = {k: v for k, v in data.items() if k not in ("vision", "llm")}
        rest.update(vision=VisionEncoderSpec.from_dict(data["vision"]), llm=ModelSpec.from_dict(data["llm"]))
        return _from_dict(cls, "vision-language model", rest)


@dataclass(frozen=True)
class ImageInputs:
    """The images of each training sample: ``images_per_sample`` still images of ``image_height`` ×
    ``image_width`` pixels (every sample alike, as a synthetic profiling batch is)."""

    images_per_sample: int
    image_height: int = 448
    image_width: int = 448

    def __post_init__(self) -> None:
        p: list[str] = []
        positive_ints(p, self, ("images_per_sample", "image_height", "image_width"))
        if not p:
            require(p, self.images_per_sample <= MAX_IMAGES_PER_SAMPLE,
                    f"images_per_sample {self.images_per_sample} exceeds {MAX_IMAGES_PER_SAMPLE}")
            require(p, max(self.image_height, self.image_width) <= MAX_IMAGE_SIDE,
                    f"image sides must be at most {MAX_IMAGE_SIDE} pixels, got {self.image_height}x{self.image_width}")
        raise_if(p, "image inputs")

    def grid(self, vision: VisionEncoderSpec) -> tuple[int, int]:
        """(rows, columns) of patches of one image; SpecError when a side is not a multiple of
        patch_size · spatial_merge_size (the projector merges whole neighbourhoods)."""
        unit = vision.patch_size * vision.spatial_merge_size
        if self.image_height % unit or self.image_width % unit:
            raise SpecError(f"image {self.image_height}x{self.image_width} px: each side must be a multiple of "
                            f"patch_size · spatial_merge_size = {unit} px")
        return self.image_height // vision.patch_size, self.image_width // vision.patch_size

    def patches_per_image(self, vision: VisionEncoderSpec) -> int:
        """The encoder's sequence length of one image (its attention spans exactly these)."""
        rows, cols = self.grid(vision)
        return rows * cols

    def tokens_per_image(self, vision: VisionEncoderSpec) -> int:
        """LLM tokens one image becomes: its patches / spatial_merge_size²."""
        return self.patches_per_image(vision) // vision.spatial_merge_size ** 2

    def image_tokens_per_sample(self, vision: VisionEncoderSpec) -> int:
        return self.images_per_sample * self.tokens_per_image(vision)

    def check_fits(self, vision: VisionEncoderSpec, seq_length: int) -> None:
        """SpecError when a sample's image tokens leave no room for text in ``seq_length`` tokens."""
        tokens = self.image_tokens_per_sample(vision)
        if tokens >= seq_length:
            raise SpecError(f"{self.images_per_sample} images of {self.image_height}x{self.image_width} px are "
                            f"{tokens} image tokens, not fewer than the sequence length {seq_length}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ImageInputs:
        return _from_dict(cls, "image inputs", data)


#: where a job's or training's stored training spec carries its image inputs (beside the router options, so
#: they are part of the job's signature); absent for a text-only model
IMAGES_KEY = "images"


def with_images(training_spec: dict[str, Any], images: ImageInputs | None) -> dict[str, Any]:
    """``training_spec`` as stored with a job: the image inputs added when there are some."""
    return {**training_spec, IMAGES_KEY: images.to_dict()} if images is not None else dict(training_spec)


def split_images(stored: dict[str, Any]) -> tuple[dict[str, Any], ImageInputs | None]:
    """A stored training spec as the rest of its fields and its image inputs (None: a text-only job)."""
    rest = {k: v for k, v in stored.items() if k != IMAGES_KEY}
    images = stored.get(IMAGES_KEY)
    return rest, (ImageInputs.from_dict(images) if images is not None else None)


def stored_llm(model_spec: dict[str, Any]) -> ModelSpec:
    """The LLM of a stored model spec: a vision-language model's (it has 'vision' and 'llm'), else the model."""
    return ModelSpec.from_dict(model_spec["llm"] if "vision" in model_spec else model_spec)


def stored_model(model_spec: dict[str, Any]) -> ModelSpec | VisionLanguageSpec:
    """A stored model spec read back: a VisionLanguageSpec when it has a vision encoder, else a ModelSpec."""
    return VisionLanguageSpec.from_dict(model_spec) if "vision" in model_spec else ModelSpec.from_dict(model_spec)


def _from_dict(cls, what: str, data: dict[str, Any]):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SpecError(unknown_fields(what, unknown, known))
    try:
        return cls(**data)
    except TypeError as exc:  # a required field is missing
        raise SpecError(f"{what}: {exc}") from None
