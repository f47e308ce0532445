"""What ``foldtune tune`` and ``foldtune train --job`` share as they run service work in this process: the
request checked against the API's own schema, and Ray sized before anything is stored."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from spec.errors import SpecError

Request = TypeVar("Request", bound=BaseModel)


def validated_request(schema: type[Request], body: dict[str, Any], whole: str = "") -> Request:
    """``schema`` validated from ``body``, or one SpecError listing each error as ``loc: message`` (``whole``
    names an error about the body as a whole, which has no location)."""
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise SpecError("; ".join(f"{'.'.join(str(p) for p in e['loc']) or whole}: {e['msg']}"
                                  for e in exc.errors())) from None


def check_ray_has_room(gpu: str, gpus: int) -> None:
    """Start or attach to Ray (the launcher's :func:`attach_ray`), and one clear error before anything is
    stored when its cluster cannot place the job's ``gpus`` ranks."""
    from executor import launch_ray  # starts Ray and imports torch: only for the commands that run ranks

    capacity = launch_ray.attach_ray()
    kind = "CPU" if gpu.lower() == "cpu" else "GPU"
    have = capacity.cpus if kind == "CPU" else capacity.gpus
    if have < gpus:
        hint = " (--gpu cpu runs CPU ranks)" if kind == "GPU" else f" (set FOLDTUNE_RAY_NUM_CPUS >= {gpus})"
        raise SpecError(f"--gpus {gpus} x {gpu} needs {gpus} {kind}s in the Ray cluster, it has {have:g}{hint}")
