"""Gated MLP (SwiGLU, or the model's gated activation), tensor-parallel with SP: the dense layers' MLP and
the MoE shared experts.

gate/up are column-parallel (ffn/tp rows each), down is row-parallel; input and output are this rank's
sequence slice. With ``bias`` (Megatron's add_bias_linear) gate/up biases split with their rows and the
down bias is replicated and added once after the reduce-scatter (a TP-partial gradient under SP). The three GEMMs go through the kernel backend's ``linear`` (the options' backend unless one
is passed): bf16 ``F.linear`` for 'torch', fp8 for 'torch-fp8'.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from executor.kernels import get_backend
from executor.kernels.base import KernelBackend
from executor.options import ExecutorOptions
from executor.parallel.groups import ParallelState
from executor.parallel.sharding import ShardInfo, make_param
from executor.parallel.tensor_parallel import enter_tp, gathered, leave_tp, scattered, tp_overlap
from executor.timing import NULL_TIMER, PhaseTimer


class SwiGLUMLP(torch.nn.Module):
    def __init__(self, prefix: str, hidden: int, ffn: int, options: ExecutorOptions, state: ParallelState,
                 device: torch.device, dtype: torch.dtype, timer: PhaseTimer = NULL_TIMER, phase: str = "mlp",
                 kernels: KernelBackend | None = None, bias: bool = False,
                 act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.state, self.timer, self.phase = state, timer, phase
        self.kernels = kernels or get_backend(options.kernel_backend)
        self.act = act  # act(gate, up); None: silu(gate) · up

        def param(name, shape, tp_dim=None, init="normal", tp_partial=False):
            info = ShardInfo(prefix + name, shape, tp_dim=tp_dim, tp_partial=tp_partial)
            return make_param(info, state, init, options.init_method_std, options.seed, device, dtype)

        self.w1 = param("w1.weight", (ffn, hidden), 0)  # gate
        self.w3 = param("w3.weight", (ffn, hidden), 0)  # up
        self.w2 = param("w2.weight", (hidden, ffn), 1)  # down
        self.b1 = self.b3 = self.b2 = None
        if bias:
            self.b1 = param("w1.bias", (ffn,), 0, "zeros")
            self.b3 = param("w3.bias", (ffn,), 0, "zeros")
            self.b2 = param("w2.bias", (hidden,), init="zeros", tp_partial=True)

    def forward(self, x_SBH: torch.Tensor) -> torch.Tensor:
        """MLP of already-normalised input (sequence slice in, sequence slice out)."""
        ph = self.phase
        x = self.timer.mark(x_SBH, "other", ph)
        if tp_overlap(self.state):  # the collectives under the GEMMs: their time is the MLP's phase
            y = scattered(gathered(x, self._hidden, self.state), self._down, self.state)
        else:
            x = self.timer.mark(x, ph, "tp_allgather")
            x = enter_tp(x, self.state)
            x = self.timer.mark(x, "tp_allgather", ph)
            y = self.timer.mark(self._down(self._hidden(x)), ph, "tp_reduce_scatter")
            y = self.timer.mark(leave_tp(y, self.state), "tp_reduce_scatter", ph)
        if self.b2 is not None:  # after the reduce-scatter: added once, not once per TP rank
            y = y + self.b2
        return self.timer.mark(y, ph, "other")

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The gated activation of the column-parallel gate and up projections (row-wise)."""
        linear = self.kernels.linear
        gate, up = linear(x, self.w1), linear(x, self.w3)
        if self.b1 is not None:
            gate, up = gate + self.b1, up + self.b3
        return F.silu(gate) * up if self.act is None else self.act(gate, up)

    def _down(self, hidden: torch.Tensor) -> torch.Tensor:
        """The row-parallel down projection's partial sums (row-wise)."""
        return self.kernels.linear(hidden, self.w2)
