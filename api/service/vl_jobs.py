"""A tuning job of a vision-language MoE model: resolve its model and image inputs, and refuse at submission
what no runner could search (docs/multimodal.md). The rules it names:

- ``images_need_encoder``: images per sample given for a model without a vision encoder;
- ``vl_needs_images``: a vision-language model without its images per sample;
- ``vl_text_only_option``: an option that only a text-only job has (a proxy, verify, precision search);
- ``image_tokens_seq`` / ``image_grid``: images whose tokens leave no text, or whose sides do not split into the
  encoder's merged patches;
- then the planner's and the executor's (``layout_fits``, ``executor_vl_layout``, ...) through
  :func:`planner.multimodal.runnable_multimodal`, the runner's own call.
"""

from __future__ import annotations

from dataclasses import dataclass

from api.service.errors import RuleViolation
from api.schemas.jobs import JobCreate
from planner.multimodal import runnable_multimodal
from spec.errors import FoldtuneError, SpecError
from spec.hardware import ClusterSpec
from spec.multimodal import ImageInputs, VisionLanguageSpec
from spec.training_spec import TrainingSpec
from spec.vl_catalog import get_vl_model, is_vl_model

# where a rejection of the planner or the executor points in the request
_LOC = {"layout_fits": "body.cluster", "executor_vl_layout": "body.cluster", "image_tokens_seq": "body.images"}


@dataclass(frozen=True)
class VLWorkload:
    model: VisionLanguageSpec
    images: ImageInputs


def vl_workload(request: JobCreate) -> VLWorkload | None:
    """The vision-language model and images of a job request; None for a text-only one. RuleViolation for a
    mismatch of model and images, or an option a vision-language job does not take."""
    name = request.model or ""
    vl = None
    if request.model is not None and is_vl_model(name):
        try:
            vl = get_vl_model(name)
        except FoldtuneError as exc:
            raise RuleViolation("body.model", "known_model", str(exc)) from None
    if request.images is not None and vl is None:
        named = request.model or (request.model_spec.name if request.model_spec is not None else "the model")
        raise RuleViolation("body.images", "images_need_encoder",
                            f"model {named!r} has no vision encoder: images per sample are for a vision-language "
                            "model (qwen3-vl-30b-a3b, tiny-vl-moe, ENCODER+LLM; docs/multimodal.md)")
    if vl is None:
        return None
    if request.images is None:
        raise RuleViolation("body.images", "vl_needs_images",
                            f"{vl.name} is a vision-language model: give images (images_per_sample, image_height, "
                            "image_width)")
    for given, field in ((request.proxy is not None or request.num_layers_override is not None, "body.proxy"),
                         (request.kind == "verify", "body.kind"), (request.search_precision, "body.search_precision")):
        if given:
            raise RuleViolation(field, "vl_text_only_option",
                                f"{field.split('.', 1)[1]} is a text-only job's option; a vision-language job "
                                "searches its multimodal layouts at the training's precision")
    try:
        images = request.images.inputs()
        images.grid(vl.vision)
    except SpecError as exc:
        raise RuleViolation("body.images", "image_grid", str(exc)) from None
    return VLWorkload(vl, images)


def check_vl_runnable(work: VLWorkload, training: TrainingSpec, cluster: ClusterSpec, max_trials: int) -> None:
    """RuleViolation unless the runner would find a multimodal layout to search (the images fit the sequence,
    some layout fits and the executor runs it)."""
    try:
        work.images.check_fits(work.model.vision, training.seq_length)
    except SpecError as exc:
        raise RuleViolation("body.images", "image_tokens_seq", str(exc)) from None
    result = runnable_multimodal(work.model, training, work.images, cluster, keep=max_trials)
    if result.rejection is not None:
        rule = result.rejection.rule
        raise RuleViolation(_LOC.get(rule, "body"), rule, result.rejection.reason)
