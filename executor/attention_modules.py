"""The executor's module factory per attention kind: the one place that maps a kind to the module it builds.

Each kind of ``spec.attention_kinds`` has a factory here, registered under the kind's name;
:func:`make_attention` builds the one a model selects (``spec.attention_kinds.attention_kind``).
``tests/test_feature_registry.py`` checks that this registry and the cost model's pricings
(``costmodel.attention_pricing.PRICING``) hold exactly the spec's kinds. A factory is called as
``factory(spec, options, state, layer, kernels, device, dtype, timer)`` and returns a ``torch.nn.Module``
whose ``forward(x_SBH, (cos, sin))`` maps this rank's sequence slice [s/tp, b, h] to the attention output
in the same layout, its parameters named ``layers.{layer}.attention.*`` (the names of the kind's
``hf_names``), ``recompute.selective``/``offloaded`` applied to its own modules. ``MoEGPT`` reads its
``window`` (keys before the query, None for full causal) and ``plain`` (the causal kernels take it) and, under
CP or when not plain, sets its ``mask`` ([s/cp, s], True = attend).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.attention import Attention
from executor.mla import MLASelfAttention
from spec.attention_kinds import GQA, MLA, attention_kind
from spec.errors import SpecError
from spec.model_spec import ModelSpec
from spec.registry import Registry

AttentionFactory = Callable[..., torch.nn.Module]

#: attention kind name -> the factory of its module; a kind registers with ``ATTENTION_MODULES.add(name, factory)``
ATTENTION_MODULES: Registry[AttentionFactory] = Registry("attention module")


def make_attention(spec: ModelSpec, *args) -> torch.nn.Module:
    """The attention module of ``spec``'s kind for one decoder layer (arguments as a factory takes them);
    SpecError for a kind the executor does not build."""
    kind = attention_kind(spec)
    factory = ATTENTION_MODULES.get(kind.name)
    if factory is None:
        raise SpecError(f"the executor builds no attention of kind {kind.name!r}; "
                        f"built: {', '.join(ATTENTION_MODULES)}")
    return factory(spec, *args)


ATTENTION_MODULES.add(GQA.name, Attention)
ATTENTION_MODULES.add(MLA.name, MLASelfAttention)
