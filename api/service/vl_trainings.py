"""A training of a vision-language MoE model under a multimodal layout (docs/multimodal.md): the request's model
and label resolved, its image+text dataset read for the image inputs, and every rule the runner would hit named
at submission. The rules it adds to the trainings':

- ``multimodal_label_needs_encoder``: a label with ``placement=`` or ``enc_`` tokens for a text-only model;
- ``vl_dataset``: the data path holds no image+text dataset (executor.vlm.dataset) that fits the model, or its
  sequence length is not the request's;
- the multimodal rule book's (``enc_heads_tp``, ``enc_images_dp``, ..., the LLM part's) and the executor's
  (``executor_vl_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass

from api.service.errors import RuleViolation
from api.schemas.trainings import TrainingCreate
from costmodel.estimate import estimate
from costmodel.multimodal import estimate_multimodal
from planner.multimodal import llm_cluster
from spec.errors import FoldtuneError
from spec.hardware import ClusterSpec
from spec.layout_codec import read_multimodal_label
from spec.multimodal import VisionLanguageSpec
from spec.multimodal_layout import MultimodalLayout
from spec.training_spec import TrainingSpec
from spec.validity import check_multimodal, executor_multimodal_rules
from spec.vl_dataset import VLDatasetHeader
from spec.vl_catalog import get_vl_model, is_vl_model


@dataclass(frozen=True)
class VLTrainingSource:
    model: VisionLanguageSpec
    layout: MultimodalLayout


def is_multimodal_label(label: str) -> bool:
    """Whether ``label`` has a placement or encoder tokens (a malformed one counts: the codec names its fault)."""
    try:
        tokens = read_multimodal_label(label)
    except FoldtuneError:
        return True
    return tokens.placement is not None or bool(tokens.encoder_sizes)


def vl_training_source(request: TrainingCreate, num_gpus: int) -> VLTrainingSource | None:
    """The vision-language model and multimodal layout of an explicit-layout training request; None for a
    text-only one. RuleViolation for a multimodal label of a text-only model or a label that does not parse."""
    name = request.model or ""
    if request.model is None or not is_vl_model(name):
        if request.layout and is_multimodal_label(request.layout):
            named = request.model or (request.model_spec.name if request.model_spec is not None else "the model")
            raise RuleViolation("body.layout", "multimodal_label_needs_encoder",
                                f"layout {request.layout!r} places a vision encoder, and model {named!r} has none")
        return None
    try:
        vl = get_vl_model(name)
    except FoldtuneError as exc:
        raise RuleViolation("body.model", "known_model", str(exc)) from None
    if request.proxy is not None or request.num_layers_override is not None:
        raise RuleViolation("body.proxy", "vl_text_only_option", "a proxy is a text-only training's option")
    try:
        layout = MultimodalLayout.parse(request.layout or "", world_size=num_gpus)
    except (FoldtuneError, ValueError) as exc:
        raise RuleViolation("body.layout", "layout_parses", str(exc)) from None
    return VLTrainingSource(vl, layout)


def check_vl_training(source: VLTrainingSource, training: TrainingSpec, cluster: ClusterSpec, data_path: str):
    """The dataset's image inputs when the training can run; RuleViolation naming the first rule it breaks. The
    dataset's header is read here (the service has no torch); its tokens are checked by the ranks that load it
    (executor.vlm.dataset: a training whose tokens do not fit fails with the reason)."""
    vision = source.model.vision
    try:
        header = VLDatasetHeader.read(data_path)
        images = header.image_inputs
        images.grid(vision)
    except FoldtuneError as exc:
        raise RuleViolation("body.data_path", "vl_dataset", str(exc)) from None
    if header.seq_length != training.seq_length or header.channels != vision.in_channels:
        raise RuleViolation("body.data_path", "vl_dataset",
                            f"the dataset holds samples of {header.seq_length} tokens with {header.channels}-channel "
                            f"images; the training's seq_length is {training.seq_length}, the encoder reads "
                            f"{vision.in_channels} channels")
    broken = check_multimodal(source.model, training, images, source.layout, cluster)
    broken += executor_multimodal_rules(source.layout, source.model)
    if broken:
        raise RuleViolation("body.layout", broken[0].rule, "; ".join(f"{r.rule}: {r.reason}" for r in broken))
    return images


def predicted_vl_step_time(source: VLTrainingSource, training: TrainingSpec, images,
                           cluster: ClusterSpec) -> float | None:
    """The cost model's seconds per step of the layout (as a tuning job's trials store it); None where it
    cannot price it."""
    try:
        share = llm_cluster(source.layout, cluster)  # a separate encoder's GPUs are not the LLM's
        llm = estimate(source.model.llm, training, share, source.layout.llm)
        return estimate_multimodal(source.model, training, images, source.layout, cluster, llm, share).step_time
    except (FoldtuneError, ValueError):
        return None
