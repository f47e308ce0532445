"""Global gradient norm of a folded model and clipping by it.

After gradient reduction every copy of a parameter shard holds the same gradient. A parameter cut into
``n`` distinct shards (over tp, etp and/or ep) has each shard replicated on ``world_size / n`` ranks, so
weighting its local sum of squares by ``n / world_size`` and summing over the whole world counts every
unique shard once — dense, TP-split and expert parameters alike — in one all-reduce.

With the distributed optimizer the reducer leaves each rank only its 1/g slice of every bucket's reduced
gradient (g = the bucket's DP·CP or EDP group); those slices are distinct within the group, so each element
there weighs ``n · g / world_size``. Clipping scales exactly the tensors the optimizer reads next: the
slices, or the parameters' (main) gradients. The last pipeline stage's copy of a parameter the first stage
holds too (``ShardInfo.pp_shared``: the embedding under MTP or tied output weights) weighs 0: its gradient is
the first stage's, counted there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from executor.parallel.groups import ParallelState


def _num_shards(info, state: ParallelState) -> int:
    if info.pp_shared and state["pp"].rank != 0:
        return 0  # the copy of a first-stage parameter: counted on the first stage
    n = 1
    if info.tp_dim is not None:
        n *= state.tp.size
    if info.etp_dim is not None:
        n *= state.etp.size
    if info.ep_dim is not None:
        n *= state.ep.size
    return n


def _grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


class GradClipper:
    """Measures and clips the global gradient norm of one rank's model slice after its reducer has run."""

    def __init__(self, model: torch.nn.Module, state: ParallelState, reducer=None):
        self.model, self.state = model, state
        self.world = state.config.world_size
        self.replicas = self.world // state["pp"].size  # ranks holding some shard of a given parameter
        self.entries = [e for e in getattr(reducer, "entries", []) if getattr(e, "sharded", False)]
        self._weights: dict[tuple[int, int], torch.Tensor] = {}

    def _slice_weights(self, entry_index: int, bucket_index: int) -> torch.Tensor:
        """Per-element weights of this rank's slice of one sharded bucket (padding weighs 0)."""
        key = (entry_index, bucket_index)
        if key not in self._weights:
            entry = self.entries[entry_index]
            bucket, g = entry.buckets[bucket_index], entry.group.size
            parts = [torch.full((p.numel(),), _num_shards(p.shard_info, self.state) * g / self.replicas,
                                dtype=torch.float32, device=p.device) for p in bucket]
            flat = torch.cat(parts)
            padded = -(-flat.numel() // g) * g
            flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
            self._weights[key] = flat.chunk(g)[entry.group.rank]
        return self._weights[key]

    def _pieces(self) -> list[tuple[torch.Tensor, torch.Tensor | float]]:
        if self.entries:
            return [(shard, self._slice_weights(i, j)) for i, entry in enumerate(self.entries)
                    for j, shard in enumerate(entry.shards) if shard is not None]
        out = []
        for p in self.model.parameters():
            g = _grad_of(p)
            if g is not None:
                out.append((g, _num_shards(p.shard_info, self.state) / self.replicas))
        return out

    @torch.no_grad()
    def square_sum(self) -> torch.Tensor:
        """This rank's weighted share of the squared norm (fp32 scalar): summed over the world, the square of the
        full model's gradient norm."""
        device = next(self.model.parameters()).device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for grad, weight in self._pieces():
            total += (grad.float().square() * weight).sum()
        return total

    def gradients(self) -> list[torch.Tensor]:
        """The gradient tensors the optimizer reads next (what clipping scales)."""
        return [g for g, _ in self._pieces()]

    @torch.no_grad()
    def norm(self) -> torch.Tensor:
        """L2 norm of the full model's gradient (fp32 scalar, equal on every rank). Collective over the world."""
        total = self.square_sum()
        if self.world > 1:
            dist.all_reduce(total)
        return total.sqrt()

    @torch.no_grad()
    def clip(self, max_norm: float | None) -> float:
        """Scale gradients so their global norm is at most ``max_norm`` (None or <= 0: only measure); returns
        the norm before clipping."""
        norm = self.norm()
        if max_norm is not None and max_norm > 0:
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            grads = self.gradients()
            if grads:
                torch._foreach_mul_(grads, scale)
        return float(norm)
