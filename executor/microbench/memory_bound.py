"""Memory-bound ops as the executor runs them: seconds of one forward + backward per op class and size.

The cost model prices every memory-bound op (norms, activations, residual adds, token permutation) by the
bytes it moves at a bandwidth plus a fixed cost per kernel (``costmodel.compute.memory_time``). A plain
copy (``executor/microbench/hbm.py``) reaches more of the datasheet bandwidth than these ops do, and on a
CPU rank an op's fixed cost is its dispatch through the framework and autograd (tens of microseconds, the
whole of a tiny model's norm), not a GPU's few microseconds of launch gap. This benchmark times each op
class at a few sizes, forward and backward as a training step runs them; the cost model's side
(``costmodel.calibrate.memory_bound``) turns the timings into one curve per class of bytes per kernel ->
achieved / datasheet bandwidth, counting bytes its own way.

Op classes (``CLASSES``), each the executor's own code path:

* ``elementwise``: ``x * y`` (two inputs, one output; backward two products);
* ``norm``: the executor's RMSNorm over the last dim of [rows, width] (``pick_rms_norm``: the fused
  kernel where it runs, else the kernel backend's);
* ``activation``: the experts' SwiGLU on the fused gate/up output [rows, 2 x width], forward and its hand-written
  backward as the experts' single autograd node runs them (``executor/grouped_swiglu.py``);
* ``permute``: the dispatcher's permutation of ``PERMUTE_COPIES`` copies of every token row into expert order
  (``executor.dispatcher.permute``: a gather, the Triton kernel where it runs; backward sums each token's
  copies).

Sizes (``default_sizes``): rows x width, from the tiny models' shape (a few hundred tokens of width 64) up.
On a CPU rank the host is the device: a call is timed by the wall clock, and a small op's time is mostly its
fixed cost (dispatch, autograd), which the tiny models' steps consist of. On a GPU a training step's host
runs ahead of the device, so the calls are captured in a CUDA graph and its replays timed: kernel time only
(the host's issue rate is priced apart, as the host floor: ``executor/microbench/launch.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.dispatcher import permute, slot_rows, sort_by_expert
from executor.grouped_swiglu import _swiglu, _swiglu_grad
from executor.kernels import get_backend
from executor.kernels.triton_rms_norm import pick_rms_norm
from executor.microbench.timing import time_op
from spec.hardware import MEMORY_OP_CLASSES as CLASSES

PERMUTE_COPIES = 2  # top-2 routing: each token row gathered twice
PERMUTE_EXPERTS = 8
NORM_EPS = 1e-6
# (rows, width), small to large, each from the tiny models' shape (a fixed cost's worth of work). CPU: up to tensors
# past the last-level cache of every rank together; GPU: up to tensors well past the H100/H200's 50 MiB L2
CPU_SIZES = ((256, 64), (2048, 128), (8192, 256))
GPU_SIZES = ((256, 64), (4096, 1024), (16384, 4096), (65536, 4096))
GRAPH_CALLS = 20  # calls per CUDA graph (GPU): many small ones, so the replay's own launch is a small share
GRAPH_ELEMENTS = 1 << 26  # above this many elements a tensor, one call per graph (its kernels take milliseconds)


def default_sizes(device: torch.device, quick: bool) -> tuple[tuple[int, int], ...]:
    """The (rows, width) sizes each class is timed at on ``device`` (``quick``: the same: the curve needs the
    small sizes for the fixed cost and the large ones for the bandwidth, and all take seconds together)."""
    del quick
    return CPU_SIZES if device.type == "cpu" else GPU_SIZES


def _op(name: str, rows: int, width: int, device: torch.device,
        dtype: torch.dtype) -> tuple[Callable[[], None], tuple[torch.Tensor, ...]]:
    """(a closure running one forward + backward of class ``name`` at [rows, width], the input tensors autograd
    writes gradients to: none for the activation, whose backward the experts' node computes itself)."""
    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(True)

    if name == "elementwise":
        inputs = (leaf(rows, width), leaf(rows, width))
        forward = lambda: inputs[0] * inputs[1]  # noqa: E731
    elif name == "norm":
        norm = pick_rms_norm(True, get_backend("torch"))
        inputs = (leaf(rows, width), leaf(width))
        forward = lambda: norm(inputs[0], inputs[1], NORM_EPS)  # noqa: E731
    elif name == "activation":  # inside the experts' one autograd node: no graph of its own
        gate_up = torch.randn(rows, 2 * width, device=device, dtype=dtype)
        d_act = torch.randn(rows, width, device=device, dtype=dtype)

        def activation() -> None:
            _swiglu(gate_up)
            _swiglu_grad(gate_up, d_act)
        return activation, ()
    elif name == "permute":  # tokens routed to PERMUTE_COPIES of PERMUTE_EXPERTS experts, sorted by expert
        inputs = (leaf(rows, width),)
        experts = torch.randint(0, PERMUTE_EXPERTS, (rows, PERMUTE_COPIES), device=device)
        slots, _ = sort_by_expert(experts, PERMUTE_EXPERTS)
        row_of_slot = slot_rows(slots, rows, PERMUTE_COPIES)
        forward = lambda: permute(inputs[0], slots, row_of_slot, PERMUTE_COPIES)  # noqa: E731
    else:
        raise ValueError(f"unknown memory-bound op class {name!r}; classes are {', '.join(CLASSES)}")
    grad = torch.randn_like(forward().detach())

    def call() -> None:
        for t in inputs:  # a step's activations get fresh gradients, never accumulated ones
            t.grad = None
        forward().backward(grad)
    return call, inputs


def _device_seconds(call: Callable[[], None], device: torch.device, calls: int, repeats: int) -> float:
    """Device seconds of one ``call`` on a GPU: ``calls`` of them captured in one CUDA graph, replayed. Issued
    one by one, a small op's forward + backward takes the host longer to launch than the GPU to run (autograd,
    Python), and a training step's host runs ahead of its GPU: the graph times the kernels alone."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up (Triton compiles, autograd caches) off the capture
        for _ in range(3):
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    return time_op(graph.replay, device, repeats=repeats) / calls


def measure_memory_bound(sizes: tuple[tuple[int, int], ...], device: torch.device, dtype: torch.dtype,
                         repeats: int = 3) -> list[dict]:
    """Seconds of one forward + backward of each class at each size (the inputs' gradients are reset before
    each call: a step's activations get fresh gradients, never accumulated ones).

    Returns ``[{'op', 'rows', 'width', 'copies', 'elem_bytes', 'seconds'}]``; ``width`` is the row width of
    every input but the activation's, which is its output's (its input is twice as wide); ``copies`` is how
    many times the permutation gathers each row (1 for the other classes)."""
    out = []
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    for name in CLASSES:
        for rows, width in sizes:
            call = _op(name, rows, width, device, dtype)[0]
            if device.type == "cuda":
                seconds = _device_seconds(call, device, 1 if rows * width > GRAPH_ELEMENTS else GRAPH_CALLS, repeats)
            else:
                seconds = time_op(call, device, repeats=repeats)
            out.append({"op": name, "rows": rows, "width": width, "copies": PERMUTE_COPIES if name == "permute" else 1,
                        "elem_bytes": elem_bytes, "seconds": seconds})
    return out
