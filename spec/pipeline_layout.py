"""Which decoder layers each pipeline rank holds: the one placement the executor builds and the
cost model and Megatron arguments describe."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4096)
def layer_chunks(num_layers: int, pp: int, vpp: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Decoder-layer indices of every pipeline rank, one tuple per virtual chunk: ``[stage][chunk]``.

    The model is cut into ``pp·vpp`` consecutive chunks; chunk ``j`` holds ``L // (pp·vpp)`` layers plus
    one more when ``j < L % (pp·vpp)`` (uneven layer counts put the extra layers on the earliest chunks).
    Pipeline rank ``i`` runs chunks ``i, i + pp, i + 2·pp, ...`` (Megatron's interleaved order).
    """
    chunks = pp * vpp
    base, extra = divmod(num_layers, chunks)
    bounds = [0]
    for j in range(chunks):
        bounds.append(bounds[-1] + base + (1 if j < extra else 0))
    return tuple(
        tuple(tuple(range(bounds[v * pp + i], bounds[v * pp + i + 1])) for v in range(vpp))
        for i in range(pp)
    )
