"""Activation offload: what chosen modules save for backward waits in pinned CPU memory instead of the GPU.

``ParallelConfig.activation_offload_modules`` names modules of ``spec.parallel_config.ACTIVATION_OFFLOAD_MODULES``
(core_attn: the attention kernel; layernorm: the RMSNorms; mlp: a dense layer's MLP; moe: the whole MoE
block). While such a module's forward runs (:func:`executor.recompute.run` with ``offload``), every tensor
autograd saves — except parameters and views of them, which live on the GPU anyway — is copied to pinned
CPU memory through ``torch.autograd.graph.saved_tensors_hooks``, and the GPU copy is released as soon as
the forward drops it. On CUDA the device-to-host copy runs on a side stream (it overlaps the forward
compute; the allocator does not reuse the GPU block before the copy ends); in backward the tensor comes
back on the compute stream when autograd unpacks it, without prefetch. On the CPU (tests) a tensor is
copied, which exercises the same path. Values are unchanged: the gradients equal those without offload.
"""

from __future__ import annotations

import torch

from spec.parallel_config import ParallelConfig

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def offloaded(config: ParallelConfig, module: str) -> bool:
    """Whether ``module`` (a name of ``ACTIVATION_OFFLOAD_MODULES``) offloads its saved activations."""
    return module in config.activation_offload_modules


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (a linear layer saves its weight, or its transpose)."""
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _pack(t: torch.Tensor):
    if _is_parameter(t):
        return t
    if not t.is_cuda:
        return (t.device, t.detach().clone(), None)
    stream = _side_stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))  # t is complete
    with torch.cuda.stream(stream):
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = stream.record_event()
    t.record_stream(stream)  # its block is not reused before the copy ends
    return (t.device, host, done)


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, host, done = packed
    if done is None:
        return host
    torch.cuda.current_stream(device).wait_event(done)
    return host.to(device, non_blocking=True)


def hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """The context manager under which a module's saved activations go to the CPU."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
