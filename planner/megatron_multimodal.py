"""Megatron-LM arguments of a multimodal layout, or the reason Megatron-LM cannot express it.

What Megatron Core (0.9 on, its encoder-decoder parallelism, used by LLaVA) lets an encoder have of its own:
pipeline stages ahead of the LLM's (``--encoder-pipeline-model-parallel-size``; 0, the default, shares the
LLM's single pipeline stage and is required to be > 0 when the LLM is pipelined) and, with those stages, a
tensor-parallel size up to the LLM's (``--encoder-tensor-model-parallel-size``). The data-parallel and
context-parallel sizes are derived once for both. So:

- ``homogeneous`` exports as the LLM's arguments (the encoder on its first stage), for an LLM at pp = 1;
- ``separate`` exports with the encoder's stages and tensor-parallel size when its dp and cp are the LLM's
  and its tp is at most the LLM's;
- ``colocated`` (the encoder's own process groups over the LLM's GPUs) has no Megatron-LM counterpart.

Every exported layout adds the image arguments of Megatron's vision models (``--img-h``, ``--img-w``,
``--patch-dim``, ``--num-channels``).
"""

from __future__ import annotations

from spec.errors import SpecError
from spec.multimodal import ImageInputs, VisionLanguageSpec
from spec.multimodal_layout import MultimodalLayout
from spec.training_spec import TrainingSpec
from planner.megatron_args import megatron_args, megatron_env, script_text

MEGATRON_MULTIMODAL_RULE = "megatron_multimodal"


def megatron_multimodal_refusal(layout: MultimodalLayout) -> str | None:
    """Why Megatron-LM cannot run ``layout`` (naming what it lacks), or None when it can."""
    llm = layout.llm
    if layout.placement == "colocated":
        return (f"layout {layout.label()!r}: Megatron-LM has no colocated encoder (its own process groups over the "
                "LLM's GPUs); its encoder shares the LLM's first pipeline stage in the LLM's tensor-parallel size "
                "(placement=homogeneous) or takes pipeline stages of its own "
                "(--encoder-pipeline-model-parallel-size > 0: placement=separate)")
    if layout.placement == "homogeneous":
        if llm.pp > 1:
            return (f"layout {layout.label()!r}: Megatron-LM shares a pipeline stage between encoder and LLM only "
                    f"at --pipeline-model-parallel-size 1 (got pp {llm.pp}); with a pipelined LLM the encoder needs "
                    "stages of its own (placement=separate)")
        return None
    problems = []
    if layout.encoder_dp != llm.dp:
        problems.append(f"enc_dp {layout.encoder_dp} is not the LLM's dp {llm.dp} (Megatron-LM derives one "
                        "data-parallel size for both)")
    if layout.encoder_cp != llm.cp:
        problems.append(f"enc_cp {layout.encoder_cp} is not the LLM's cp {llm.cp} (Megatron-LM has no encoder "
                        "context-parallel size)")
    if layout.encoder_tp > llm.tp:
        problems.append(f"enc_tp {layout.encoder_tp} exceeds the LLM's tp {llm.tp} "
                        "(--encoder-tensor-model-parallel-size may not exceed --tensor-model-parallel-size)")
    return f"layout {layout.label()!r}: " + "; ".join(problems) if problems else None


def megatron_multimodal_args(layout: MultimodalLayout, vl: VisionLanguageSpec, training: TrainingSpec,
                             images: ImageInputs) -> list[list[str]]:
    """The LLM's arguments (:func:`planner.megatron_args.megatron_args`), the encoder's placement and the images';
    SpecError with :func:`megatron_multimodal_refusal`'s reason when Megatron-LM cannot express the layout."""
    refusal = megatron_multimodal_refusal(layout)
    if refusal is not None:
        raise SpecError(refusal)
    args = megatron_args(layout.llm, vl.llm, training)
    if layout.placement == "separate":
        args += [["--encoder-pipeline-model-parallel-size", str(layout.encoder_pp)],
                 ["--encoder-tensor-model-parallel-size", str(layout.encoder_tp)]]
    v = vl.vision
    args += [["--img-h", str(images.image_height)], ["--img-w", str(images.image_width)],
             ["--patch-dim", str(v.patch_size)], ["--num-channels", str(v.in_channels)]]
    return args


def megatron_multimodal_env(layout: MultimodalLayout) -> dict[str, str]:
    """The LLM's environment, which an encoder tensor-parallel group needs as well."""
    env = megatron_env(layout.llm)
    if layout.placement == "separate" and layout.encoder_tp > 1:
        env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return env


def megatron_multimodal_script(layout: MultimodalLayout, vl: VisionLanguageSpec, training: TrainingSpec,
                               images: ImageInputs) -> str:
    """:func:`planner.megatron_args.megatron_script`'s shell fragment of :func:`megatron_multimodal_args`."""
    return script_text(megatron_multimodal_env(layout), megatron_multimodal_args(layout, vl, training, images))
