"""EP all-to-all overlap (``overlap_moe_expert_parallel_comm``): one micro-batch's dispatch and combine run
under another micro-batch's compute, as Megatron's combined 1F1B schedule does. This module holds the
mechanism: operations cut at their all-to-alls (:class:`Tape`, :func:`forward_stream`) and the driver that zips
two of them (:class:`Overlap`); which forward runs with which backward is the pipeline schedule's
(``executor/pipeline.py``: with pp = 1, F₀ · [B₀ ‖ F₁] · ... · B_last; with a pipeline, each steady step of its
1F1B or interleaved order).

A merged step runs the forward of one (micro-batch, chunk) together with the backward of another. Each
operation is cut at its EP all-to-alls into *segments* of compute: per MoE layer, [attention, norm, router,
permute] | all-to-all | [experts] | all-to-all | [unpermute, shared experts, residual, and on to the next MoE
layer's attention ...]. A forward is thus compute, exchange, compute, ..., compute, and so is a backward (in
reverse, each exchange the transpose of its forward). The two are zipped so that every exchange of one runs
while the other computes:

    B₀ · [B₁ ‖ F₀] · [F₁ ‖ B₂] · [B₃ ‖ F₂] · [F₃ ‖ B₄] · ...

``[X ‖ Y]``: start exchange X (on GPU by default over the copy engines, executor/parallel/copy_engine_alltoall.py,
or an asynchronous ``all_to_all_single`` on NCCL's own stream: ``ExecutorOptions.ep_overlap_transport``; gloo's
thread on CPU), run compute Y, wait for X. A forward's dispatch is the exception in host order: its split
sizes (rows per EP peer) come from the routing of the segment that just ran, and reading them on the host
blocks it until the GPU has run everything queued before the read. Read at the end of that segment (as
the in-line dispatch does), the host would stop while the other micro-batch's exchange is in flight and
the GPU would then idle until the host had queued the next exchange and compute. So the segment only
starts the sizes' copy to pinned memory (``executor.host_copy``) and an event marks its end; the driver
queues the partner's compute Y first, then waits for the sizes (the GPU busy with Y) and starts X on a side
stream that waits for that event only, so X still runs beside Y.

Per MoE layer this pairs, as Megatron does, the forward's attention with the backward's combine all-to-all,
the forward's dispatch all-to-all with the backward's experts, the forward's experts with the backward's
dispatch all-to-all and the forward's combine all-to-all with the backward's attention. Operations without a
partner (the schedule's warmup forwards and cooldown backwards) run their exchanges in line (the cost model
prices the same: ``costmodel.step_time``).

Gradients equal the in-line run's: each segment's autograd graph starts at detached copies of the tensors
it takes from earlier segments (:class:`Tape`), and the segment's backward hands their gradients to the
segments that made them; the exchanged rows' gradients go back through the transposed all-to-all. A pipeline
chunk's input is the first segment's leaf (its gradient goes back to the previous stage) and its output
activations take the next stage's gradient in the last segment. Only the order of the backward calls
changes, and every parameter accumulates its micro-batches' gradients in the schedule's order. Delayed
weight-gradient computation (Megatron's ``--delay-wgrad-compute``) is not built: a segment's backward computes
its input and weight gradients together before the exchange after it starts.

The exchanges of the whole step are issued in the same order on every rank (the schedule is fixed), so
collectives match across the EP group without any extra synchronisation.

SM carveout (``ExecutorOptions.ep_overlap_sm_carveout``, default 0: off). Beside an exchange the partner's
compute holds every SM: the experts' grouped GEMMs (``torch._grouped_mm``) are persistent CUTLASS kernels
launched with one CTA per SM, so the all-to-all's NCCL kernel waits for SMs to free up, or splits the GEMM's
waves (a profiled 2 x H200 step: the rest of the step grew 6-8 ms with the overlap). With a carveout of n the
driver sets torch's experimental SM carveout (``torch._C._set_sm_carveout_experimental``) to n while it
queues a partner's compute segment under an exchange in flight (:meth:`Overlap.together`; never for the
unpaired warmup forwards and cooldown backwards, nor the segments after one stream has ended), and restores the
previous setting afterwards, exceptions included. The setting is process-wide (``at::Context``) and read
when a kernel is launched, so it also reaches the backward's kernels that autograd's device thread
launches. What honours it (from PyTorch's source, aten/src/ATen/native/cuda/GroupMM.cu and
aten/src/ATen/cuda/CUDABlas.cpp). Measured on 2 × H200 (docs/benchmarks.md): a carveout
of 16 made the overlapped step slower (418.9 ms against 408.9 with none; off 421.7), so it stays off:

- ``torch._grouped_mm`` in bf16 on SM90 (H100/H200), the CUTLASS kernel: launched on (SMs − n) SMs
  (``hw_info.sm_count``). Other GPUs' paths of ``_grouped_mm`` were not read.
- cuBLASLt GEMMs (``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`` = SMs − n): ``addmm`` with a bias through
  ``gemm_and_bias``, ``_scaled_mm``, and every mm/bmm when the preferred BLAS library is cuBLASLt
  (``torch.backends.cuda.preferred_blas_library('cublaslt')`` or ``TORCH_BLAS_PREFER_CUBLASLT=1``).
- Not the default cuBLAS path (``cublasGemmEx``: torch sets no SM count target there), which the dense
  projections without bias take with torch's default BLAS library; not SDPA's flash kernels, Triton
  kernels or elementwise kernels. Kernels replayed from CUDA graphs (``cuda_graphs``) keep the launch
  configuration of their capture, whatever the carveout at replay.

On CPU (the exchange's tensor not on a GPU) the carveout is never set: gloo has no SMs to share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import torch

from executor.options import EP_OVERLAP_TRANSPORTS
from executor.parallel.collectives import all_to_all_start
from executor.parallel.copy_engine_alltoall import copy_engine_for
from executor.parallel.groups import Group
from spec.errors import InvalidConfigError


@dataclass
class Exchange:
    """An all-to-all a segment asks for: send ``in_splits[i]`` rows of ``x`` to member i, receive
    ``out_splits[i]`` from it. ``tag`` names it in the trace ('F3/L1/dispatch'). A dispatch's split sizes
    are still on the device when its segment ends: ``sizes`` then returns (out_splits, in_splits), waiting
    for their copy to the host, and the splits are None until :meth:`resolve`."""

    x: torch.Tensor
    out_splits: list[int] | None
    in_splits: list[int] | None
    group: Group
    tag: str
    source: torch.Tensor | None = None  # forward: ``x`` with its graph, where the returned gradient enters
    sizes: Callable[[], tuple[list[int], list[int]]] | None = None
    ready: object = None  # deferred, on CUDA: an event recorded when ``x`` was complete (Overlap._compute)

    @property
    def deferred(self) -> bool:
        """Whether the host does not know the split sizes yet (reading them is a host sync)."""
        return self.out_splits is None

    def resolve(self) -> None:
        """Fill the split sizes (the host waits for their device-to-host copy, nothing else)."""
        if self.out_splits is None:
            self.out_splits, self.in_splits = self.sizes()


# A micro-batch's forward or backward: runs compute until it yields the next Exchange, receives its
# result through send(), and returns at its end.
Stream = Generator[Exchange, torch.Tensor, None]


@dataclass
class _Segment:
    exports: list[torch.Tensor] = field(default_factory=list)  # tensors later segments take
    imports: list[tuple[tuple[int, int], torch.Tensor]] = field(default_factory=list)  # (export, its leaf here)
    sent: Exchange | None = None  # the exchange that ends this segment
    received: torch.Tensor | None = None  # the leaf holding the rows that started it


class Tape:
    """A micro-batch's forward through one chunk cut into segments, and what its backward needs to run them in
    reverse."""

    def __init__(self):
        self.segments = [_Segment()]
        self.loss: torch.Tensor | None = None  # the last segment's objective, already scaled
        self.output: torch.Tensor | None = None  # the last segment's activations for the next pipeline stage

    def keep(self, *tensors: torch.Tensor) -> list[tuple[int, int]]:
        """Export ``tensors`` from the current segment (as (segment, position) ids); :meth:`take` them back
        in a later one."""
        seg = len(self.segments) - 1
        ids = []
        for t in tensors:
            ids.append((seg, len(self.segments[seg].exports)))
            self.segments[seg].exports.append(t)
        return ids

    def take(self, ids: list[tuple[int, int]]) -> list[torch.Tensor]:
        """The kept tensors as leaves of the current segment (detached; tensors without grad, or kept in this
        same segment, as they are)."""
        out = []
        for i in ids:
            seg, position = i
            t = self.segments[seg].exports[position]
            if t.requires_grad and seg != len(self.segments) - 1:  # from the same segment: the tensor itself
                leaf = t.detach().requires_grad_()
                self.segments[-1].imports.append((i, leaf))
                t = leaf
            out.append(t)
        return out

    def exchange(self, x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group: Group,
                 tag: str, sizes=None) -> Generator[Exchange, torch.Tensor, torch.Tensor]:
        """End the segment at an all-to-all of ``x``; the received rows start the next one (as a leaf).
        Splits None: ``sizes()`` gives them when the driver starts the exchange (:class:`Exchange`)."""
        request = Exchange(x.detach(), out_splits, in_splits, group, tag, source=x, sizes=sizes)
        self.segments[-1].sent = request
        received = yield request
        leaf = received.requires_grad_(x.requires_grad)
        self.segments.append(_Segment(received=leaf))
        return leaf

    def backward(self, tag: str, output_grad: torch.Tensor | None = None) -> Stream:
        """Run the segments' backward calls in reverse, yielding the transposed exchanges between them;
        ``output_grad``: the gradient of :attr:`output` (from the next pipeline stage)."""
        grads: dict[tuple[int, int], torch.Tensor] = {}  # export id -> gradient summed over its takers
        sent_grad: torch.Tensor | None = None
        for k in range(len(self.segments) - 1, -1, -1):
            seg = self.segments[k]
            outputs, gradients = [], []
            if k == len(self.segments) - 1:
                if self.loss is not None and self.loss.requires_grad:  # router losses: constant in dense chunks
                    outputs.append(self.loss)
                    gradients.append(torch.ones_like(self.loss))
                if output_grad is not None:
                    outputs.append(self.output)
                    gradients.append(output_grad)
            for j, t in enumerate(seg.exports):
                g = grads.pop((k, j), None)
                if g is not None:
                    outputs.append(t)
                    gradients.append(g)
            if seg.sent is not None and sent_grad is not None and seg.sent.source.requires_grad:
                outputs.append(seg.sent.source)
                gradients.append(sent_grad)
            sent_grad = None
            if outputs:
                torch.autograd.backward(outputs, gradients)
            for i, leaf in seg.imports:
                if leaf.grad is not None:
                    grads[i] = leaf.grad if i not in grads else grads[i] + leaf.grad
            self.segments[k] = None  # its graph is spent: free its leaves' gradients as soon as sent
            if seg.received is not None and k > 0:
                ex = self.segments[k - 1].sent
                g = seg.received.grad
                if g is None:
                    g = torch.zeros_like(seg.received)
                del seg
                sent_grad = yield Exchange(g, ex.in_splits, ex.out_splits, ex.group, f"{tag}/{ex.tag}")
        self.segments = []


def _as_called(module: torch.nn.Module) -> None:
    """Run ``module``'s forward pre-hooks as calling it would. The staged layer calls the parts of a
    DecoderLayer and its MoELayer, not their forward, but both read parameters they own directly (the MLP
    norm, the shared-expert gate), and the distributed optimizer's overlapped parameter gather waits for
    those in these hooks (``executor.optimizer``, "Overlapped parameter gather")."""
    for hook in list(module._forward_pre_hooks.values()):
        hook(module, ())


def staged_moe_layer(layer, x: torch.Tensor, router_loss: torch.Tensor, rope, tape: Tape,
                     tag: str) -> Generator[Exchange, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A MoE decoder layer (``executor.model.DecoderLayer``) as DecoderLayer.forward computes it, cut at its
    two EP all-to-alls; returns (its output, ``router_loss`` plus its router loss)."""
    moe, dispatcher = layer.mlp, layer.mlp.dispatcher
    _as_called(layer)
    _as_called(moe)
    x1, h = layer.attention_block(x, *rope)
    tokens, routing = moe.route(h)
    rows, ctx = dispatcher.dispatch_preprocess(tokens, routing)
    kept = tape.keep(x1, h, dispatcher.routing_probs(ctx), router_loss + routing.loss)
    exchange = dispatcher.has_exchange(ctx)  # without one (allgather) the layer runs in line
    if exchange:
        # the split sizes stay on the device until the driver starts the exchange: no host sync here, while
        # the other micro-batch's exchange runs under this compute
        def sizes() -> tuple[list[int], list[int]]:
            send, recv = dispatcher.exchange_sizes(ctx)
            return recv, send

        rows = yield from tape.exchange(rows, None, None, dispatcher.exchange_group, f"{tag}/dispatch", sizes)
    dispatched = dispatcher.dispatch_postprocess(rows, ctx)
    y = dispatcher.combine_preprocess(moe.run_experts(dispatched), dispatched)
    if exchange:
        send, recv = dispatcher.exchange_sizes(ctx)
        y = yield from tape.exchange(y, send, recv, dispatcher.exchange_group, f"{tag}/combine")
    x1, h, probs, router_loss = tape.take(kept)
    dispatcher.replace_routing_probs(ctx, probs)
    y = moe.finish(dispatcher.combine_postprocess(y, dispatched), h)
    return x1 + y, router_loss


def forward_stream(model, chunk: int, x_or_ids: torch.Tensor, labels: torch.Tensor, num_micro: int, tape: Tape,
                   tag: str, done: Callable) -> Stream:
    """The forward of one micro-batch through virtual chunk ``chunk`` (``MoEGPT.forward_chunk`` cut at the
    all-to-alls) into ``tape``; calls ``done(LossOutput)`` at its end. The objective kept for backward is the
    chunk's loss over ``num_micro``, the output activations (all but the model's last chunk) ``tape.output``."""
    x, rope, labels_BS, full_labels_BS = model.chunk_input(chunk, x_or_ids, labels)
    router_loss = x.new_zeros((), dtype=torch.float32)
    for position in model.chunk_layers[chunk]:
        layer = model.layers[position]
        if layer.is_moe:
            x, router_loss = yield from staged_moe_layer(layer, x, router_loss, rope, tape, f"{tag}/L{position}")
        else:
            x, layer_loss = layer(x, rope)
            router_loss = router_loss + layer_loss
    out = model.chunk_output(chunk, x, router_loss, rope, labels_BS, full_labels_BS)
    tape.loss = out.loss / num_micro
    tape.output = out.hidden
    done(out)


@contextlib.contextmanager
def sm_carveout(sms: int) -> Iterator[None]:
    """Kernels launched inside leave ``sms`` SMs free, where they honour torch's experimental SM carveout
    (module docstring); the previous setting (None: no carveout) is restored on leaving, exceptions
    included."""
    previous = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(previous)


def _carveout_applies(x: torch.Tensor) -> bool:
    """Whether an exchange of ``x`` runs on a GPU, where the compute beside it can leave SMs to its NCCL
    kernel (gloo on CPU has none to share)."""
    return x.is_cuda


class Overlap:
    """Drives micro-batch streams two at a time (module docstring). ``trace``, when a list, records the
    order of events: ('start' | 'wait', exchange tag), ('compute', stream tag), and for an exchange whose
    split sizes were still on the device when its segment ended, ('defer', tag) at that point and ('sizes',
    tag) where the host waits for them. ``sm_carveout``: SMs the compute beside an exchange leaves free
    (0: none; module docstring)."""

    def __init__(self, trace: list | None = None, sm_carveout: int = 0, transport: str = "auto"):
        if sm_carveout < 0:
            raise InvalidConfigError(f"ep_overlap_sm_carveout must be >= 0, got {sm_carveout}")
        if transport not in EP_OVERLAP_TRANSPORTS:
            raise InvalidConfigError(f"ep_overlap_transport must be one of {EP_OVERLAP_TRANSPORTS}, "
                                     f"got {transport!r}")
        self.trace = trace
        self.sm_carveout = sm_carveout
        self.transport = transport

    def _log(self, *event) -> None:
        if self.trace is not None:
            self.trace.append(event)

    def _compute(self, stream: Stream, tag: str, value) -> Exchange | None:
        self._log("compute", tag)
        try:
            request = stream.send(value)
        except StopIteration:
            return None
        if request.deferred:
            # the exchange's input is complete once what is queued now has run: remember that point, so that
            # it can start there although the host starts it only after queuing the other's compute
            self._log("defer", request.tag)
            request.ready = _record_event(request.x)
        return request

    def _beside(self, stream: Stream, tag: str, value, ex: Exchange) -> Exchange | None:
        """:meth:`_compute` of the partner stream while ``ex`` runs beside it, with its kernels leaving
        ``sm_carveout`` SMs free for the exchange (on a GPU; elsewhere, and with 0, plainly)."""
        if not self.sm_carveout or not _carveout_applies(ex.x):
            return self._compute(stream, tag, value)
        with sm_carveout(self.sm_carveout):
            return self._compute(stream, tag, value)

    def _start(self, ex: Exchange, beside: bool = False):
        """Start ``ex``; ``beside``: compute of the other micro-batch runs under it. With 'auto' only such an
        exchange goes over the copy engines: in line, nothing shares the SMs, and NCCL's all-to-all alone is
        faster (2 x H200: 0.14 ms against 0.24 ms for the Mixtral EP2 dispatch of one micro-batch,
        bench/ce_alltoall_probe.py). With 'copy_engine' every exchange does."""
        if ex.deferred:
            self._log("sizes", ex.tag)
            ex.resolve()
        self._log("start", ex.tag)
        if over_copy_engines(self.transport, beside, ex.x.is_cuda, ex.group.size):
            engine = copy_engine_for(ex.group, ex.x.device, required=self.transport == "copy_engine")
            if engine is not None:
                return ex.tag, *engine.start(ex.x, ex.out_splits, ex.in_splits, ex.ready)
        return ex.tag, *all_to_all_start(ex.x, ex.out_splits, ex.in_splits, ex.group, ex.ready)

    def _wait(self, pending) -> torch.Tensor:
        tag, out, work = pending
        if work is not None:
            work.wait()
        self._log("wait", tag)
        return out

    def alone(self, stream: Stream, tag: str) -> None:
        """Run ``stream`` to its end, each exchange in line."""
        request, value = self._compute(stream, tag, None), None
        while request is not None:
            value = self._wait(self._start(request))
            request = self._compute(stream, tag, value)

    def together(self, first: Stream, first_tag: str, second: Stream, second_tag: str) -> None:
        """Run both streams to their ends, each exchange of one under the next compute of the other.

        An exchange whose split sizes are known is started before the other's compute is queued. A deferred
        one (a dispatch: its sizes come from the segment that just ran) is started after: reading the sizes
        blocks the host until the GPU has run what was queued before them, and queuing the other's compute
        first keeps the GPU busy meanwhile; the exchange still waits only for its own segment (the event of
        :meth:`_compute`), not for that compute."""
        cur, cur_tag, other, other_tag = first, first_tag, second, second_tag
        request, other_value = self._compute(cur, cur_tag, None), None
        while request is not None:
            if request.deferred:
                # started after the partner's compute is queued, but runs beside it (it waits only for its
                # own segment's event): that compute leaves it SMs as well
                other_request = self._beside(other, other_tag, other_value, request)
                pending = self._start(request, beside=True)
            else:
                pending = self._start(request, beside=True)
                other_request = self._beside(other, other_tag, other_value, request)
            value = self._wait(pending)
            cur, cur_tag, other, other_tag = other, other_tag, cur, cur_tag
            request, other_value = other_request, value
        # ``cur`` has finished; ``other`` still waits for ``other_value``
        while True:
            request = self._compute(other, other_tag, other_value)
            if request is None:
                return
            other_value = self._wait(self._start(request))


def over_copy_engines(transport: str, beside: bool, on_gpu: bool, group_size: int) -> bool:
    """Whether an exchange is offered to the copy engines ('auto' may still fall back to NCCL, see
    :func:`copy_engine_for`): on a GPU, over a group of two or more, with 'copy_engine' always, with 'auto'
    when compute runs beside it."""
    wanted = transport == "copy_engine" or (transport == "auto" and beside)
    return wanted and on_gpu and group_size > 1


def _record_event(x: torch.Tensor):
    """An event on the current stream when ``x`` is a CUDA tensor (None on CPU: gloo reads ``x`` when the
    exchange starts, after the host has computed it)."""
    if not x.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def check_overlappable(model) -> None:
    """Raise InvalidConfigError when a MoE layer of ``model`` is recomputed whole (the rule book's
    executor_ep_overlap, re-checked on the built model: the overlapped schedule runs the layer in parts)."""
    for layer in model.decoder_layers():
        if layer.is_moe and (layer.recompute_layer or layer.recompute_mlp):
            raise InvalidConfigError("[executor_ep_overlap] overlap_moe_expert_parallel_comm runs the MoE layer in "
                                     "parts: full recompute and selective recompute of 'moe' do not apply")


def overlap_driver(model, trace: list | None = None) -> Overlap:
    """The :class:`Overlap` driver of ``model``'s overlapped schedule, with the SM carveout and transport of
    ``model.options`` (module docstring); raises InvalidConfigError when a MoE layer cannot be cut
    (:func:`check_overlappable`) or the carveout leaves no SM."""
    check_overlappable(model)
    carveout = model.options.ep_overlap_sm_carveout
    device = model.rope_cos.device
    if carveout and device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if carveout >= sms:  # the GEMMs would be launched on no SM at all
            raise InvalidConfigError(f"ep_overlap_sm_carveout {carveout} leaves no SM of the {sms} on "
                                     f"{torch.cuda.get_device_name(device)}")
    return Overlap(trace, carveout, model.options.ep_overlap_transport)
