"""The size of one training checkpoint on disk, predicted from the model alone.

foldtune's checkpoints (executor/train/checkpoint.py) hold every parameter at its full logical shape as the
fp32 master copy plus AdamW's two fp32 moments, whatever the layout or the training precision: 12 bytes per
parameter. The head features' blocks (MTP) are saved too (published totals leave them out). The DCP metadata, the trainer
state and the persistent buffers (router biases) add a few hundred kilobytes: a few percent of a test model's
checkpoint and nothing at real sizes, so they are left out of the prediction.
"""

from __future__ import annotations

from costmodel.multimodal import encoder_params
from costmodel.params import head_block_params, total_param_counts
from spec.head_features import head_features
from spec.model_spec import ModelSpec
from spec.multimodal import VisionLanguageSpec

#: bytes per parameter: fp32 master weight, fp32 first and second AdamW moments
CHECKPOINT_BYTES_PER_PARAM = 3 * 4


def checkpoint_params(model: ModelSpec | VisionLanguageSpec) -> int:
    """Parameters a checkpoint of ``model`` holds (elements): the whole model with its head features' blocks;
    a vision-language model's encoder and projectors too (its checkpoint holds them whole, with Adam's
    moments: executor/vlm/checkpoint.py)."""
    if isinstance(model, VisionLanguageSpec):
        return checkpoint_params(model.llm) + encoder_params(model.vision)
    total, _active = total_param_counts(model)
    return total + sum(depth * head_block_params(model, feature, 1, 1, 1).total
                       for feature, depth in head_features(model))


def checkpoint_bytes(model: ModelSpec | VisionLanguageSpec) -> int:
    """Predicted bytes of one checkpoint of ``model`` (12 bytes per parameter; see the module doc)."""
    return CHECKPOINT_BYTES_PER_PARAM * checkpoint_params(model)
