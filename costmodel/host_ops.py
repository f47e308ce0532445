"""Host-side op counts: eager ops and collectives one rank issues, and what issuing them costs.

Its own module so that the dispatcher pricings (``costmodel.dispatch``) and the per-layer counts
(``costmodel.host``) can both build on it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostOps:
    """Kernel-launching eager ops and collectives issued on one rank (forward + backward unless stated)."""

    ops: float
    collectives: float = 0.0

    def __add__(self, other: HostOps) -> HostOps:
        return HostOps(self.ops + other.ops, self.collectives + other.collectives)

    def __mul__(self, k: float) -> HostOps:
        return HostOps(self.ops * k, self.collectives * k)

    __rmul__ = __mul__

    def seconds(self, op_launch_s: float, collective_launch_s: float) -> float:
        """Host seconds to issue these: ops at ``op_launch_s``, collectives at ``collective_launch_s`` each."""
        return self.ops * op_launch_s + self.collectives * collective_launch_s


ZERO = HostOps(0.0)
