"""The executor's module factory per head feature: the one place that maps a feature to the module it builds.

Each feature of ``spec.head_features`` has a factory here, registered under the feature's name;
:func:`make_head` builds a model's on its last pipeline stage. ``tests/test_feature_registry.py`` checks that
this registry and the cost model's pricings (``costmodel.head_pricing.PRICING``) hold exactly the spec's
features. A factory is called as ``factory(spec, options, state, layers, kernels, device, dtype, timer)``, with
``layers`` the feature's decoder layers (one per block, of the last decoder layer's kind, built by the model),
and returns a ``torch.nn.Module`` that ``MoEGPT`` keeps under the feature's name and that provides:

- ``decoder_layers()``: its blocks' decoder layers, in order (their MoE layers join the last chunk's);
- ``loss_scale``: the weight of its loss in the objective;
- ``forward(h0_SBH, labels_BS, rope, embedding_VH, output_VH, cp_positions)`` -> (its loss, unscaled, and this
  rank's router losses of its layers): ``h0_SBH`` the decoder's normalised output slice [s/tp, b, h],
  ``labels_BS`` the micro-batch's labels before CP slicing, ``embedding_VH`` / ``output_VH`` the vocab shards
  of the word embedding and output layer, ``cp_positions`` this CP rank's positions (None without CP).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.mtp import MultiTokenPrediction
from spec.errors import SpecError
from spec.head_features import MTP, HeadFeature
from spec.registry import Registry

HeadFactory = Callable[..., torch.nn.Module]

#: head feature name -> the factory of its module; a feature registers with ``HEAD_MODULES.add(name, factory)``
HEAD_MODULES: Registry[HeadFactory] = Registry("head module")


def make_head(feature: HeadFeature, *args) -> torch.nn.Module:
    """The module of head feature ``feature`` (arguments as a factory takes them); SpecError for a feature the
    executor does not build."""
    factory = HEAD_MODULES.get(feature.name)
    if factory is None:
        raise SpecError(f"the executor builds no head feature {feature.name!r} ({feature.label}); "
                        f"built: {', '.join(HEAD_MODULES)}")
    return factory(*args)


HEAD_MODULES.add(MTP.name, MultiTokenPrediction)
