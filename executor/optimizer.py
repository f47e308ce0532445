"""Adam with Megatron's mixed-precision recipe, optionally as a distributed optimizer (ZeRO-1).

Recipe (bf16/fp16 parameters): every parameter gets an fp32 ``main_grad`` into which each micro-batch's
gradient is accumulated (a post-accumulate hook adds and frees ``.grad``); the optimizer keeps fp32 master
weights and fp32 Adam moments, steps them, and copies the result back into the low-precision parameters.
That is Megatron's 18 bytes per parameter (2 weight + 4 main grad + 4 master + 4 m + 4 v). For fp32
parameters the parameter is its own master and ``.grad`` its main gradient: plain fp32 AdamW (16 bytes).
In training the main grads are views of the reducer's per-bucket fp32 gradient buffers
(``GradReducer(main_grads=True)``, :func:`executor.parallel.grad_reduce.attach_main_grads`), so an unsharded
unit reads its bucket's buffer as its gradient and zero_grad is one fill per bucket.

State lives in flat units, one per gradient bucket of :class:`GradReducer`. With ``sharded`` (the
distributed optimizer) a unit's master weights and moments are only this rank's 1/size shard of the
bucket, over DP·CP for dense parameters and over EDP for experts: the reducer reduce-scatters the bucket's
gradients into that shard, Adam updates it, and an all-gather over the same group rebuilds the parameters.
Without it a unit is a whole bucket. fp32 parameters (no buffer) have their gradients flattened into a copy
per step.

Overlapped parameter gather (``overlap_param_gather``, Megatron's distributed optimizer): a sharded unit over
a group of two or more keeps its parameters as views of one flat buffer of the padded bucket, in bucket
order. :meth:`MixedPrecisionAdam.step` writes the updated shard into this rank's slice of that buffer and
starts an asynchronous all-gather over the unit's group *in place*, then returns: the gathered values land
directly in the parameters (no copy, no gathered temporary) while the next step's forward runs. Units launch
in the order the forward needs them (by their first parameter in ``model.parameters()`` order; a unit holds
a bucket, whose parameters are in reverse order), and NCCL runs one communicator's collectives in launch
order, so the first layers' parameters arrive first. Every rank launches the same collectives in the same
order inside ``step()``, whatever order the forward later waits in. Before a parameter of a pending unit is
read, the unit's work is waited for (once):

- a forward pre-hook on every module that owns parameters directly, and on its parent (a module may read its
  children's parameters), waits for the units of those parameters;
- the top-level module's own parameters (embedding, final norm, output layer) are read inside
  ``MoEGPT.forward_chunk``, which the pipeline schedules call without ``forward`` and whose output layer comes
  after every decoder layer: its ``_parameters`` is replaced by a dict that waits when a parameter is read
  through the attribute (``nn.Module.__getattr__`` reads ``_parameters[name]``), so the embedding waits at the
  embedding and the output layer at the loss;
- everything else that reads parameters (``model.parameters()``, ``state_dict``, checkpoints, evaluation,
  :func:`executor.parallel.sharding.gather_model`) calls :meth:`MixedPrecisionAdam.finish_param_gather` or
  :func:`finish_param_gather` first, and so does the next ``step()``: a unit is never updated while its
  gather is pending.

Optimizer CPU offload (``offload_fraction`` F, Megatron's ``--optimizer-cpu-offload
--optimizer-offload-fraction``): the first ceil(F·n) elements of this rank's n optimizer elements (units in
order, each unit's shard from its start) keep their fp32 master weights and moments in CPU memory
(:class:`HostPart`). Each step copies their gradients device-to-host into a pinned buffer and steps the GPU
remainder meanwhile; then it runs the same AdamW formula on the CPU and copies the updated weights, already in
the parameters' dtype, host-to-device from a pinned buffer into the unit's shard before its write-back or
gather. The transfers are not overlapped with the CPU step (Megatron's --overlap-cpu-optimizer-d2h-h2d).

Precision-aware state (``state_dtypes``, Megatron's ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` /
``--main-params-dtype``): each of exp_avg, exp_avg_sq and the master weights may be kept in bf16 or fp16 instead
of fp32 (:class:`StateStore`), on the device and in the CPU part alike. The update itself stays fp32: a unit with
such a state is stepped in blocks of :data:`STATE_BLOCK_ELEMENTS` (the CPU part in blocks of
:data:`HOST_STEP_ELEMENTS`), each block widened to fp32, updated by the same AdamW kernel and narrowed back
(round to nearest), so the step's temporaries are a few fp32 blocks, never a whole fp32 copy of the state. bf16 is a
plain cast; fp16 is scaled per block so the block's largest value sits at half fp16's range, as Transformer
Engine's FusedAdam scales per tensor. fp8 moments (Megatron's) are not built (rule ``executor_optimizer_dtypes``).
Checkpoints read and write every state as fp32 (:meth:`_Unit.state`, :meth:`_Unit.load_state`).
"""

from __future__ import annotations

import math
import os
import weakref

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from executor.kernels.aliasing import register_written_through_buffer
from executor.parallel.collectives import all_gather_tensor, all_gather_nograd
from executor.parallel.grad_reduce import (
    GradReducer,
    attach_main_grads,
    grad_or_zeros,
    mark_main_grads_stale,
    padded_numel,
    settle_main_grads,
)
from executor.parallel.groups import Group
from spec.errors import InvalidConfigError

# attach_main_grads: re-exported
__all__ = ["MixedPrecisionAdam", "attach_main_grads", "finish_param_gather", "torch_state_dtypes"]

#: Byte alignment every parameter must keep when it becomes a view of a unit's gather buffer (the base of
#: a CUDA allocation is 512-byte aligned; GEMM and grouped-GEMM kernels want 16-byte aligned operands).
_VIEW_ALIGN_BYTES = 16
#: model -> the optimizer whose parameter gathers may be pending on it (for :func:`finish_param_gather`).
_PENDING_GATHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def finish_param_gather(model: torch.nn.Module) -> None:
    """Wait for every pending parameter all-gather of ``model`` (overlap_param_gather); a no-op otherwise.
    Call before reading parameters other than through a module's forward (``parameters()``, state dicts)."""
    optimizer = _PENDING_GATHERS.get(model)
    if optimizer is not None:
        optimizer.finish_param_gather()


def adamw_step(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
               lr: float, betas: tuple[float, float], eps: float, weight_decay: float, correction1: float,
               root_correction2: float) -> None:
    """One AdamW update in place (torch's formula), on whichever device the tensors live."""
    beta1, beta2 = betas
    if weight_decay:
        master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / root_correction2).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / correction1)


#: Elements the CPU Adam steps at once (its temporaries: two fp32 blocks, 8 MiB).
HOST_STEP_ELEMENTS = 1 << 20
#: Elements of one block of a device unit with a state below fp32: the step widens one block of each such state
#: to fp32 at a time (16 MiB each), and an fp16 state keeps one scale per block. Large enough that a block's
#: few kernels run longer than they take to launch (4 M elements: ~10 us each at HBM speed).
STATE_BLOCK_ELEMENTS = 1 << 22
#: The optimizer state words (spec.optimizer_dtypes) the executor keeps, as torch dtypes.
STATE_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: (exp_avg, exp_avg_sq, master weights): the classic recipe.
FP32_STATES = (torch.float32, torch.float32, torch.float32)
#: The keys of a unit's states, in the order of ``state_dtypes``.
STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")
# an fp16 block is stored as value / scale with the block's largest magnitude at half fp16's range: headroom
# for the narrowing's rounding, as Transformer Engine's FusedAdam leaves
_FP16_HALF_RANGE = torch.finfo(torch.float16).max / 2


def torch_state_dtypes(words: tuple[str, str, str]) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """torch dtypes of a layout's (exp_avg, exp_avg_sq, main_params) words; InvalidConfigError naming the rule
    book's ``executor_optimizer_dtypes`` (re-checked for a model built without executor.buildable) for a word
    the executor does not keep (fp8)."""
    unbuilt = [w for w in words if w not in STATE_TORCH_DTYPES]
    if unbuilt:
        raise InvalidConfigError(f"[executor_optimizer_dtypes] optimizer state dtypes {'/'.join(words)}: the executor keeps "
                         f"its state in {', '.join(STATE_TORCH_DTYPES)}")
    return tuple(STATE_TORCH_DTYPES[w] for w in words)  # type: ignore[return-value]


class StateStore:
    """One optimizer state of a unit (master weights or an Adam moment) kept in ``dtype``, read and written as fp32
    values one block of ``block`` elements at a time (an fp16 state keeps one fp32 scale per block, so blocks are
    read and written whole). ``data`` is the stored tensor; fp32 blocks are views of it, updated in place."""

    def __init__(self, values: torch.Tensor, dtype: torch.dtype, block: int) -> None:
        """``values``: the initial fp32 state, taken over (not copied) when ``dtype`` is fp32."""
        self.dtype, self.block = dtype, block
        n = values.numel()
        self.scales: torch.Tensor | None = None
        if dtype == torch.float32:
            self.data = values
            return
        self.data = torch.empty(n, dtype=dtype, device=values.device)
        if dtype == torch.float16:
            self.scales = torch.zeros(-(-n // block), dtype=torch.float32, device=values.device)
        self.assign(values)

    @classmethod
    def read(cls, n: int, dtype: torch.dtype, block: int, device: torch.device, source) -> StateStore:
        """A state of ``n`` elements whose fp32 values ``source(start, end)`` returns as a new tensor: read whole
        for an fp32 state (taken over), else one block at a time, so no fp32 copy of a narrower state is ever
        whole (building a bucket's fp16 master from a whole fp32 copy made the optimizer's construction, not the
        step, the peak of a 2-layer Mixtral proxy on one GPU)."""
        if dtype == torch.float32:
            return cls(source(0, n), dtype, block)
        store = cls(torch.zeros(0, device=device), dtype, block)
        store.data = torch.empty(n, dtype=dtype, device=device)
        if store.scales is not None:
            store.scales = torch.zeros(-(-n // block), dtype=torch.float32, device=device)
        for start in range(0, n, block):
            store.store(start, source(start, min(start + block, n)))
        return store

    @classmethod
    def zeros(cls, n: int, dtype: torch.dtype, block: int, device: torch.device) -> StateStore:
        """A state of ``n`` zeros, made in its own dtype (no fp32 copy of it on the way)."""
        store = cls(torch.zeros(0, device=device), dtype, block)
        store.data = torch.zeros(n, dtype=dtype, device=device)
        if store.scales is not None:
            store.scales = torch.zeros(-(-n // block), dtype=torch.float32, device=device)
        return store

    @property
    def exact(self) -> bool:
        """Whether the state is kept in fp32 (its blocks are views, written in place)."""
        return self.dtype == torch.float32

    @property
    def nbytes(self) -> int:
        """Bytes the state takes (its fp16 scales included)."""
        extra = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + extra

    def load(self, start: int) -> torch.Tensor:
        """The fp32 values of the block starting at ``start`` (a multiple of ``block``): a view of the state when
        it is fp32, else a new fp32 tensor."""
        end = start + self.block
        if self.exact:
            return self.data[start:end]
        values = self.data[start:end].float()
        if self.scales is not None:
            values.mul_(self.scales[start // self.block])
        return values

    def store(self, start: int, values: torch.Tensor) -> None:
        """Write the block starting at ``start`` from its fp32 ``values`` (round to nearest; nothing to do for a
        view :meth:`load` returned). An fp16 state scales ``values`` in place: pass a block the caller no longer
        reads."""
        target = self.data[start:start + values.numel()]
        if self.exact:
            if values.data_ptr() != target.data_ptr():
                target.copy_(values)
            return
        if self.scales is None:
            target.copy_(values)
            return
        # the block's largest magnitude without a temporary; values (the step's own fp32 block) is scaled in place,
        # and an all-zero block keeps scale 0 (no host sync to test it)
        scale = torch.linalg.vector_norm(values, float("inf")) / _FP16_HALF_RANGE
        self.scales[start // self.block] = scale
        target.copy_(values.mul_(torch.where(scale > 0, scale.reciprocal(), scale)))

    def values(self) -> torch.Tensor:
        """The whole state as fp32 (the stored tensor itself when it is fp32)."""
        if self.exact:
            return self.data
        return torch.cat([self.load(start) for start in range(0, self.data.numel(), self.block)]) \
            if self.data.numel() else self.data.float()

    @torch.no_grad()
    def assign(self, values: torch.Tensor) -> None:
        """Replace the whole state with the fp32 ``values`` (left unchanged)."""
        for start in range(0, values.numel(), self.block):
            block = values[start:start + self.block]
            self.store(start, block if self.exact else block.clone())


def _make_stores(n: int, source, state_dtypes: tuple, block: int, device: torch.device) -> dict[str, StateStore]:
    """A unit's (or CPU part's) three states of ``n`` elements on ``device``: zero moments, and master weights
    whose fp32 values ``source(start, end)`` returns (:meth:`StateStore.read`), in their dtypes."""
    m_dtype, v_dtype, w_dtype = state_dtypes
    return {"exp_avg": StateStore.zeros(n, m_dtype, block, device),
            "exp_avg_sq": StateStore.zeros(n, v_dtype, block, device),
            "master": StateStore.read(n, w_dtype, block, device, source)}


def flat_range(params: list[torch.nn.Parameter], start: int, end: int, device: torch.device) -> torch.Tensor:
    """Elements ``[start, end)`` of ``params`` flattened in order and zero-padded past their end, as a new fp32
    tensor on ``device``: one shard's slice read straight from the parameters, with no fp32 copy of the whole
    bucket on the way."""
    out = torch.zeros(end - start, dtype=torch.float32, device=device)
    offset = 0
    for p in params:
        lo, hi = max(start, offset), min(end, offset + p.numel())
        if lo < hi:
            out[lo - start:hi - start].copy_(p.detach().reshape(-1)[lo - offset:hi - offset])
        offset += p.numel()
        if offset >= end:
            break
    return out


def blocked_step(stores: dict[str, StateStore], grad: torch.Tensor, hyper: tuple,
                 step: torch.Tensor | None = None, out: torch.Tensor | None = None) -> None:
    """AdamW over states kept below fp32: each block widened to fp32, updated (torch's fused kernel when ``step``
    is given, a CPU tensor holding the step count on the states' device; else the chain of in-place ops), narrowed
    back. ``out``: also receives the updated master weights in its dtype (the CPU part's pinned buffer)."""
    lr, (beta1, beta2), eps, weight_decay = hyper[0], hyper[1], hyper[2], hyper[3]
    master = stores["master"]
    block = master.block
    for start in range(0, master.data.numel(), block):
        w, m, v = master.load(start), stores["exp_avg"].load(start), stores["exp_avg_sq"].load(start)
        g = grad[start:start + block]
        if step is not None:
            torch._fused_adamw_([w], [g], [m], [v], [], [step], lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        else:
            adamw_step(w, m, v, g, *hyper)
        if out is not None:
            out[start:start + block].copy_(w)
        master.store(start, w)
        stores["exp_avg"].store(start, m)
        stores["exp_avg_sq"].store(start, v)


def offload_threads(device: torch.device) -> int:
    """CPU threads the offloaded Adam step uses: the cores this process may run on, shared by the GPUs of the
    machine (every rank steps at once); 1 off CUDA (CPU ranks already share the cores). A training rank runs
    with one thread otherwise (executor.launch_local)."""
    if device.type != "cuda":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, torch.cuda.device_count()))


class HostPart:
    """The first ``n`` elements of a unit's shard, stepped on the CPU (optimizer CPU offload): master weights and
    moments in CPU memory (fp32, or the ``state_dtypes`` of a precision-aware optimizer: exp_avg, exp_avg_sq,
    master), a pinned fp32 buffer the gradients arrive in (device to host) and a pinned buffer of the updated
    weights in the parameters' dtype (host to device)."""

    def __init__(self, master: torch.Tensor, dtype: torch.dtype, state_dtypes: tuple = FP32_STATES,
                 pin: bool | None = None) -> None:
        """``master``: the part's initial master weights (copied to the CPU as fp32); ``pin``: page-locked
        buffers (default: whether ``master`` is on a CUDA device, i.e. the parameters are)."""
        pin = master.is_cuda if pin is None else pin
        n = master.numel()
        values = master.to("cpu", dtype=torch.float32, copy=True)
        self.stores = _make_stores(n, lambda lo, hi: values[lo:hi], state_dtypes, HOST_STEP_ELEMENTS,
                                   torch.device("cpu"))
        self.master, self.exp_avg, self.exp_avg_sq = (self.stores[k].data for k in ("master", "exp_avg", "exp_avg_sq"))
        self.grad = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        self.out = torch.empty(n, dtype=dtype, pin_memory=pin)
        self.out.copy_(self.stores["master"].values())

    @property
    def nbytes(self) -> int:
        """Bytes of master weights and moments this part keeps."""
        return sum(store.nbytes for store in self.stores.values())

    def step(self, hyper: tuple, step: torch.Tensor | None = None) -> None:
        """AdamW over the gradients in :attr:`grad`, then the weights in the parameters' dtype into :attr:`out`;
        in blocks of :data:`HOST_STEP_ELEMENTS` (the step's temporaries stay small and in cache). ``step`` (a CPU
        tensor holding the step count): torch's fused AdamW kernel, the one the device part runs, else the
        chain of in-place ops."""
        if not all(store.exact for store in self.stores.values()):
            blocked_step(self.stores, self.grad, hyper, step, self.out)
            return
        lr, (beta1, beta2), eps, weight_decay = hyper[0], hyper[1], hyper[2], hyper[3]
        for start in range(0, self.master.numel(), HOST_STEP_ELEMENTS):
            end = start + HOST_STEP_ELEMENTS
            if step is not None:
                torch._fused_adamw_([self.master[start:end]], [self.grad[start:end]], [self.exp_avg[start:end]],
                                    [self.exp_avg_sq[start:end]], [], [step], lr=lr, beta1=beta1, beta2=beta2,
                                    weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
            else:
                adamw_step(self.master[start:end], self.exp_avg[start:end], self.exp_avg_sq[start:end],
                           self.grad[start:end], *hyper)
            self.out[start:end].copy_(self.master[start:end])


class _Unit:
    """Master weights and moments of one bucket (or this rank's shard of it). ``buffer``: the bucket's fp32
    gradient buffer (unsharded units), read in place as the gradient. With ``host`` (optimizer CPU offload) the
    shard's first ``host_numel`` elements live there and ``master``/``exp_avg``/``exp_avg_sq`` hold the rest."""

    def __init__(self, params: list[torch.nn.Parameter], group: Group, entry=None, index: int = 0,
                 buffer: torch.Tensor | None = None, host_budget: list[int] | None = None,
                 state_dtypes: tuple = FP32_STATES):
        self.params, self.group, self.entry, self.index, self.buffer = params, group, entry, index, buffer
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = padded_numel(params, group.size) // group.size
        begin = group.rank * self.shard_numel  # of the padded bucket, flattened in order
        device = params[0].device
        # optimizer CPU offload: the first elements of the budget left (a one-item list the units share) live on
        # the CPU, created there directly (the whole state never sits on the device at once)
        n = min(host_budget[0], self.shard_numel) if host_budget else 0
        if host_budget:
            host_budget[0] -= n
        self.host: HostPart | None = (HostPart(flat_range(params, begin, begin + n, torch.device("cpu")),
                                               params[0].dtype, state_dtypes, pin=device.type == "cuda")
                                      if n else None)
        # the stored states (StateStore); master, exp_avg and exp_avg_sq are their tensors, fp32 or narrower
        first = begin + n
        self.stores = _make_stores(self.shard_numel - n,
                                   lambda lo, hi: flat_range(params, first + lo, first + hi, device),
                                   state_dtypes, STATE_BLOCK_ELEMENTS, device)
        self.master, self.exp_avg, self.exp_avg_sq = (self.stores[k].data for k in ("master", "exp_avg", "exp_avg_sq"))
        self.exact = all(store.exact for store in self.stores.values())  # every state fp32: the fused fast path
        self.gather_buffer: torch.Tensor | None = None  # overlapped units: the parameters are views of it
        self.work = None  # the pending all-gather into gather_buffer

    @property
    def host_numel(self) -> int:
        """Elements of this shard stepped on the CPU (0 without offload)."""
        return self.shard_numel - self.master.numel()

    @property
    def state_bytes(self) -> int:
        """Bytes of master weights and moments this unit keeps on the parameters' device."""
        return sum(store.nbytes for store in self.stores.values())

    def state(self, key: str) -> torch.Tensor:
        """The whole fp32 shard of ``key`` ('master', 'exp_avg', 'exp_avg_sq') on the parameters' device."""
        local = self.stores[key].values()
        if self.host is None:
            return local
        return torch.cat([self.host.stores[key].values().to(local.device), local])

    @torch.no_grad()
    def load_state(self, key: str, shard: torch.Tensor) -> None:
        """Install the whole fp32 shard of ``key`` (as :meth:`state` returns it)."""
        n = self.host_numel
        if self.host is not None:
            self.host.stores[key].assign(shard[:n].to("cpu", torch.float32))
            if key == "master":
                self.host.out.copy_(self.host.stores["master"].values())
        self.stores[key].assign(shard[n:].to(self.master.device, torch.float32))

    def own_shard(self, out: torch.Tensor) -> None:
        """Write this rank's updated shard in the parameters' dtype into ``out`` (the CPU part from its pinned
        buffer, asynchronously on CUDA)."""
        n = self.host_numel
        if n:
            out[:n].copy_(self.host.out, non_blocking=True)
        master = self.stores["master"]
        if master.exact:
            out[n:].copy_(self.master)
            return
        for start in range(0, self.master.numel(), master.block):
            out[n + start:n + start + master.block].copy_(master.load(start))

    def attach_gather_buffer(self) -> bool:
        """Make the parameters views of one flat buffer of the padded bucket (in bucket order, as the master
        shards are cut), so an all-gather can write them in place. False, changing nothing, where a
        parameter would not start on a :data:`_VIEW_ALIGN_BYTES` boundary."""
        first = self.params[0]
        offsets, offset = [], 0
        for p in self.params:
            if (offset * p.element_size()) % _VIEW_ALIGN_BYTES:
                return False
            offsets.append(offset)
            offset += p.numel()
        flat = torch.zeros(self.shard_numel * self.group.size, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, start in zip(self.params, offsets):
                view = flat[start: start + p.numel()].view(p.shape)
                view.copy_(p)
                p.data = view
        self.gather_buffer = flat
        return True

    @torch.no_grad()
    def launch_gather(self) -> None:
        """Write the master shard into this rank's slice of the parameters and start the in-place all-gather."""
        own = self.gather_buffer.chunk(self.group.size)[self.group.rank]
        self.own_shard(own)  # the same rounding as write_back's
        self.work = all_gather_tensor(self.gather_buffer, own, group=self.group.pg, async_op=True)

    def wait_gather(self) -> None:
        """Wait for the pending all-gather (on CUDA the current stream waits; the host does not)."""
        work, self.work = self.work, None
        if work is not None:
            work.wait()

    def grad_shard(self) -> torch.Tensor:
        if self.entry is not None:
            return self.entry.shards[self.index]
        if self.buffer is not None:
            return self.buffer[: self.shard_numel]
        return _flatten_dense_tensors([grad_or_zeros(p).float() for p in self.params])

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy the (gathered) master weights into the model's parameters, in their dtype."""
        dtype = self.params[0].dtype
        if self.host is None and self.stores["master"].exact:
            shard = self.master.to(dtype)
        else:
            shard = torch.empty(self.shard_numel, dtype=dtype, device=self.master.device)
            self.own_shard(shard)
        flat = all_gather_nograd(shard, self.group)[: self.numel]
        for p, new in zip(self.params, _unflatten_dense_tensors(flat, self.params)):
            p.copy_(new)


class MixedPrecisionAdam:
    """AdamW (torch's formula: decoupled weight decay, bias-corrected moments) over fp32 master state.

    ``reducer`` must be built with ``sharded`` equal to this optimizer's ``sharded``; call :meth:`step` after
    ``reducer.reduce()``. ``overlap_param_gather`` (with ``sharded``): units over groups of two or more
    gather asynchronously, and ``model`` (whose parameters these are) gets the hooks that wait for them (see
    the module docstring). ``offload_fraction``: the share of this rank's optimizer elements stepped on the
    CPU (module docstring). ``state_dtypes``: the torch dtypes of exp_avg, exp_avg_sq and the master weights
    (:func:`torch_state_dtypes` of the layout's words; module docstring).
    """

    def __init__(self, params: list[torch.nn.Parameter], reducer: GradReducer, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 sharded: bool = False, overlap_param_gather: bool = False, model: torch.nn.Module | None = None,
                 fused: bool = True, offload_fraction: float = 0.0, state_dtypes: tuple = FP32_STATES):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.step_count = 0
        # torch's multi-tensor fused AdamW where this torch has it (CPU and CUDA) for the device parts; the
        # chain of in-place ops (adamw_step) is the reference it is tested against (tests/executor/test_fused_adam.py)
        self.fused = fused and hasattr(torch, "_fused_adamw_")
        self._steps: dict[torch.device, torch.Tensor] = {}
        if not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(f"offload_fraction must be in [0, 1], got {offload_fraction}")
        if sharded:
            groups = [(bucket, entry.group, entry, i, None) for entry in reducer.entries
                      for i, bucket in enumerate(entry.buckets)]
        else:
            single = Group("self", (reducer.state.rank,), 0)
            groups = [(bucket, single, None, 0, buffer) for bucket, buffer in reducer.buckets]
        # the first ceil(F·n) of this rank's n optimizer elements, units in order, go to the CPU
        n = sum(padded_numel(bucket, group.size) // group.size for bucket, group, *_ in groups)
        budget = [math.ceil(offload_fraction * n)]
        self.state_dtypes = tuple(state_dtypes)
        self.units = [_Unit(bucket, group, entry, i, buffer, budget, self.state_dtypes)
                      for bucket, group, entry, i, buffer in groups]
        self.host_threads = offload_threads(self.units[0].master.device) if self.units else 1
        self._host_units = [u for u in self.units if u.host is not None]
        covered = sum(len(u.params) for u in self.units)
        if covered != len(self.params):
            raise RuntimeError(f"optimizer units cover {covered} of {len(self.params)} parameters")
        self._overlapped: list[_Unit] = []  # in launch order
        self._outstanding = 0  # units whose gather is launched and not yet waited for
        if sharded and overlap_param_gather:
            if model is None:
                raise ValueError("overlap_param_gather needs the model: its forward waits for the gathers")
            position = {id(p): i for i, p in enumerate(self.params)}
            ordered = sorted(self.units, key=lambda u: min(position[id(p)] for p in u.params))
            self._overlapped = [u for u in ordered if u.group.size > 1 and u.attach_gather_buffer()]
        # the gathers write these through their unit's flat buffer: their own _version does not move
        register_written_through_buffer(self, (p for unit in self._overlapped for p in unit.params))
        if self._overlapped:
            self._install_waits(model)
            _PENDING_GATHERS[model] = self

    def _install_waits(self, model: torch.nn.Module) -> None:
        """Forward pre-hooks on every module owning parameters of an overlapped unit and on its parent; a
        waiting ``_parameters`` on ``model`` itself (see the module docstring)."""
        unit_of = {id(p): u for u in self._overlapped for p in u.params}
        order = {id(u): i for i, u in enumerate(self._overlapped)}
        parent_of = {child: parent for parent in model.modules() for child in parent.children()}
        waits: dict[torch.nn.Module, set] = {}
        for module in model.modules():
            units = {unit_of[id(p)] for p in module._parameters.values() if p is not None and id(p) in unit_of}
            if not units:
                continue
            if module is not model:
                waits.setdefault(module, set()).update(units)
            parent = parent_of.get(module)
            if parent is not None:
                waits.setdefault(parent, set()).update(units)
        for module, units in waits.items():
            module.register_forward_pre_hook(self._waiter(sorted(units, key=lambda u: order[id(u)])))
        own = model._parameters
        if any(p is not None and id(p) in unit_of for p in own.values()):
            object.__setattr__(model, "_parameters", _WaitingParameters(own, self, unit_of))

    def _waiter(self, units: list[_Unit]):
        def wait(_module, _args):
            if self._outstanding:
                self.wait_units(units)
        return wait

    def wait_units(self, units) -> None:
        """Wait for the pending gathers of ``units`` (those already waited for are skipped)."""
        for unit in units:
            if unit.work is not None:
                unit.wait_gather()
                self._outstanding -= 1

    def pending_units(self) -> list[_Unit]:
        """Units whose parameter all-gather was launched and not yet waited for."""
        return [u for u in self._overlapped if u.work is not None]

    def finish_param_gather(self) -> None:
        """Wait for every pending parameter all-gather (a no-op without overlap_param_gather)."""
        if self._outstanding:
            self.wait_units(self._overlapped)

    def _step_tensor(self, device: torch.device) -> torch.Tensor:
        """This step's count as a tensor on ``device`` (the fused kernel reads it for the bias corrections)."""
        step = self._steps.get(device)
        if step is None:
            step = self._steps[device] = torch.zeros((), dtype=torch.float32, device=device)
        return step.fill_(self.step_count)

    def state_bytes(self) -> int:
        """Bytes of master weights and moments held by this rank on its device (the CPU part excluded)."""
        return sum(u.state_bytes for u in self.units)

    def host_state_bytes(self) -> int:
        """Bytes of master weights and moments this rank keeps in CPU memory (optimizer CPU offload)."""
        return sum(u.host.nbytes for u in self._host_units)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Free ``.grad`` (always set to None, as torch's default) and start the fp32 main gradients afresh:
        marked stale rather than zero-filled (:func:`executor.parallel.grad_reduce.mark_main_grads_stale`: the
        step's first gradient is written into each, and the reducer zeroes any that got none before reading)."""
        for p in self.params:
            p.grad = None
        mark_main_grads_stale(self.params)

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW update of every unit, then its parameters: written back (gathered synchronously), or
        with overlap_param_gather the overlapped units' all-gathers started and left pending."""
        settle_main_grads(self.params)  # a no-op after the reducer ran; else untouched main grads read as zeros
        self.finish_param_gather()  # a unit is never updated while its previous gather is pending
        self.step_count += 1
        beta1, beta2 = self.betas
        correction1 = 1 - beta1 ** self.step_count
        root_correction2 = math.sqrt(1 - beta2 ** self.step_count)
        hyper = (self.lr, self.betas, self.eps, self.weight_decay, correction1, root_correction2)

        def update(unit: _Unit) -> None:
            if not unit.exact:
                blocked_step(unit.stores, unit.grad_shard()[unit.host_numel:], hyper)
                return
            adamw_step(unit.master, unit.exp_avg, unit.exp_avg_sq, unit.grad_shard()[unit.host_numel:], *hyper)

        def update_fused(units: list[_Unit]) -> None:
            """The same AdamW formula as ``update`` in one multi-tensor kernel per device: each state tensor
            is read and written once, 28 bytes per parameter against 72 (80 with weight decay) for the chain
            of in-place ops, which made the optimizer a seventh of a 1-GPU Mixtral-proxy step. Units with a
            state below fp32 are stepped block by block (:func:`blocked_step`)."""
            by_device: dict[torch.device, list[_Unit]] = {}
            for unit in units:
                if not unit.exact:
                    blocked_step(unit.stores, unit.grad_shard()[unit.host_numel:], hyper,
                                 self._step_tensor(unit.master.device))
                    continue
                by_device.setdefault(unit.master.device, []).append(unit)
            for device, group in by_device.items():
                steps = [self._step_tensor(device)] * len(group)
                torch._fused_adamw_([u.master for u in group], [u.grad_shard()[u.host_numel:] for u in group],
                                    [u.exp_avg for u in group], [u.exp_avg_sq for u in group], [], steps,
                                    lr=self.lr, beta1=beta1, beta2=beta2, weight_decay=self.weight_decay,
                                    eps=self.eps, amsgrad=False, maximize=False)

        if not self.fused:
            update_fused = lambda units: [update(u) for u in units]  # noqa: E731 (the reference chain)
        if self._host_units:
            self._step_offloaded(lambda unit: update_fused([unit]), hyper)
            return
        if not self._overlapped:
            update_fused(self.units)
            for unit in self.units:
                unit.write_back()
            return
        # Units are independent: update each and start its gather at once, in launch order, so the first
        # gathers run behind the remaining updates.
        overlapped = {id(u) for u in self._overlapped}
        for unit in self._overlapped:
            update_fused([unit])
            unit.launch_gather()
            self._outstanding += 1
        rest = [unit for unit in self.units if id(unit) not in overlapped]
        update_fused(rest)
        for unit in rest:
            unit.write_back()

    def _step_offloaded(self, update, hyper: tuple) -> None:
        """:meth:`step` with CPU parts: their gradients go to the host first, the device parts are stepped
        while they travel (and while the CPU steps), then each unit's updated shard is assembled and written
        back or its gather started, in launch order."""
        for unit in self._host_units:
            unit.host.grad.copy_(unit.grad_shard()[: unit.host_numel], non_blocking=True)
        device = self.units[0].master.device
        copied = torch.cuda.current_stream(device).record_event() if device.type == "cuda" else None
        for unit in self.units:
            update(unit)
        if copied is not None:
            copied.synchronize()  # the pinned gradients are complete
        threads = torch.get_num_threads()
        torch.set_num_threads(self.host_threads)
        try:
            for unit in self._host_units:
                unit.host.step(hyper, self._step_tensor(torch.device("cpu")) if self.fused else None)
        finally:
            torch.set_num_threads(threads)
        overlapped = {id(u) for u in self._overlapped}
        for unit in self._overlapped:
            unit.launch_gather()
            self._outstanding += 1
        for unit in self.units:
            if id(unit) not in overlapped:
                unit.write_back()


class _WaitingParameters(dict):
    """The top-level module's ``_parameters`` under overlap_param_gather: reading a parameter through the
    module's attribute (``nn.Module.__getattr__`` does ``_parameters[name]``) first waits for its unit.
    Iteration (``parameters()``, ``state_dict``) does not wait: those callers finish the gathers first."""

    def __init__(self, params: dict, optimizer: MixedPrecisionAdam, unit_of: dict[int, _Unit]):
        super().__init__(params)
        self._optimizer, self._unit_of = optimizer, unit_of

    def __getitem__(self, name: str):
        value = dict.__getitem__(self, name)
        unit = self._unit_of.get(id(value))
        if unit is not None and unit.work is not None:
            self._optimizer.wait_units((unit,))
        return value
