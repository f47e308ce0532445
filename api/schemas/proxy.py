"""The proxy fields of the job, plan and training bodies (``num_layers_override``, ``proxy``) and how a
stored job or training shows the proxy it measured. One place, so each body changes by a base class."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from api.schemas.common import BodyIn

from spec.limits import MAX_LAYERS  # the schema's bound; the model's own layer count is checked against its spec
from spec.proxy import proxy_of


class ProxyIn(BodyIn):
    """Run a proxy of the model: the same widths with fewer layers, and/or every feature at test widths."""

    num_layers_override: int | None = Field(
        None, ge=1, le=MAX_LAYERS, description="decoder layers of the proxy (1 to the model's layers); widths "
                                               "and features are the model's")
    proxy: Literal["tiny"] | None = Field(
        None, description="'tiny': every architecture feature of the model at test widths (hidden 64, vocab 256)")


class ProxyOut(BaseModel):
    """The proxy a job or training measures instead of the full model ``of``."""

    of: str = Field(description="the model it is a proxy of")
    proxy: str | None = Field(description="'tiny' for the test-width proxy, else null")
    num_layers: int = Field(description="decoder layers of the proxy")


def proxy_view(model_spec: dict) -> ProxyOut | None:
    """The proxy a stored model spec is (read from the name :func:`spec.proxy.proxy_model` gave it), or None."""
    info = proxy_of(str(model_spec.get("name", "")))
    if not info.is_proxy:
        return None
    return ProxyOut(of=info.base, proxy=info.proxy, num_layers=int(model_spec.get("num_layers", 0)))
