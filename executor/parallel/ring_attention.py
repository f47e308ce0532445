"""Ring attention over a CP group (``cp_comm_type`` p2p, and the ring of a2a+p2p): K/V chunk pairs travel around
the ring while each rank attends to the pair it holds; partial results merge by their log-sum-exp.

Layout (Megatron's load-balanced causal split): the ring of ``n`` ranks cuts the sequence into 2·n chunks of
``c`` tokens; ring rank r holds chunks r and 2·n−1−r, queries and keys alike, in that order ([b, heads, 2c, d]).
At step i a rank holds the K/V pair of ring rank j = (r − i) mod n and computes one block:

- i = 0, its own pair: causal attention of its 2c queries against its 2c keys (in this order the causal mask
  in local positions is the causal mask in global positions: chunk 2n−1−r sees chunk r whole);
- j < r: both its query chunks see chunk j whole and not chunk 2n−1−j (later than both): 2c queries x c keys;
- j > r: only its late chunk 2n−1−r sees both of j's chunks, whole: c queries x 2c keys.

Every step after the first is the same c·2c block, which is the balance. Before computing step i the rank
starts sending the pair it holds to ring rank r+1 and receiving the next from r−1 (``batch_isend_irecv``: on
NCCL the exchange runs on the communicator's stream beside the block's kernels, on gloo on its threads), so a
hop is hidden by the block's attention where the attention takes longer. Each block returns its output and
log-sum-exp (lse); the running output merges the block's with weights exp(lse_block − lse_new), lse_new the
log-add-exp of the two, in fp32.

Backward sends the pairs round again. Each rank adds its blocks' dq into its own, and its dk/dv contribution
to the gradient buffer that travels with the pair: at step i it receives from r−1 the gradients ranks
j..r−1 gave pair j, adds its own and passes them to r+1; after the last step the buffer of its own pair comes
home from r−1 (n hops of the gradients, in K's dtype, fp32 accumulation of the rank's own blocks). A block's
backward takes the merged output and lse, which makes its gradients the exact share of the whole softmax.

The block kernel: PyTorch's flash kernels where K and V are as wide as Q (CUDA flash, 16-bit; CPU flash, any
float), which return the lse and take a given output and lse in backward; else (multi-latent attention's narrower
V, or FOLDTUNE_CP_FLASH=0) the same maths in torch matmuls, fp32. A first-use check per (dtype, head dims,
device) compares the flash blocks with the matmul ones, forward and backward; a failing check keeps the
matmul path.

Packed sequences (``segments``: the micro-batch's segment ids [b, s] over the whole sequence, in global order):
each block is cut into its chunk pairs (a query chunk against a key chunk no later), and a pair no document
spans (no query and key of one document in any sequence of the micro-batch) is skipped, forward and backward:
no kernel, nothing merged (:data:`executor.parallel.context_parallel.CHUNK_PAIRS` counts them). The others are
masked to the query/key pairs of one document (the ring knows every chunk's global positions from the split),
on the matmul blocks; a query row that meets no key of its document in a pair gets lse −inf and output 0
there, which the merge weighs by exp(−inf) = 0. Step 0's diagonal pairs always hold each query's own key and
merge first, so the merged lse is finite.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from executor.kernels.first_use import assert_agree, checked_once
from executor.parallel.context_parallel import count_chunk_pair, cp_positions
from executor.parallel.groups import Group

_aten = torch.ops.aten


# ---- one block: attention of q [b, h, sq, d] against k [b, kv, sk, d], v [b, kv, sk, dv], with its lse ----------
def _gqa(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int]:
    b, h, sq, _ = q.shape
    return b, k.shape[1], h // k.shape[1]


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool | torch.Tensor) -> torch.Tensor:
    """fp32 scores [b, kv, g, sq, sk] (query head kv·g + gi against KV head kv), causal top-left masked; or
    ``causal`` a boolean [b, sq, sk] mask (True = attend: a packed block's pairs of one document)."""
    b, kv, g = _gqa(q, k)
    sq, sk = q.shape[2], k.shape[2]
    qf = q.float().reshape(b, kv, g, sq, q.shape[-1])
    s = torch.matmul(qf, k.float().unsqueeze(2).transpose(-2, -1)) * q.shape[-1] ** -0.5
    if isinstance(causal, torch.Tensor):
        s = s.masked_fill(~causal[:, None, None], float("-inf"))
    elif causal:
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s


def _math_forward(q, k, v, causal):
    b, kv, g = _gqa(q, k)
    s = _scores(q, k, causal)
    lse = torch.logsumexp(s, dim=-1)
    # a row with no key to attend (a packed block outside its document): lse −inf, output 0, not nan
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    out = torch.matmul(torch.exp(s - safe.unsqueeze(-1)), v.float().unsqueeze(2))
    return out.reshape(b, kv * g, q.shape[2], v.shape[-1]), lse.reshape(b, kv * g, q.shape[2]), None


def _math_backward(dout, q, k, v, out, lse, causal, aux):
    b, kv, g = _gqa(q, k)
    sq = q.shape[2]
    p = torch.exp(_scores(q, k, causal) - lse.float().reshape(b, kv, g, sq).unsqueeze(-1))
    do = dout.float().reshape(b, kv, g, sq, v.shape[-1])
    dv = torch.matmul(p.transpose(-2, -1), do).sum(2)
    dp = torch.matmul(do, v.float().unsqueeze(2).transpose(-2, -1))
    ds = p * (dp - (do * out.float().reshape(b, kv, g, sq, -1)).sum(-1, keepdim=True)) * q.shape[-1] ** -0.5
    dq = torch.matmul(ds, k.float().unsqueeze(2)).reshape(b, kv * g, sq, q.shape[-1])
    dk = torch.matmul(ds.transpose(-2, -1), q.float().reshape(b, kv, g, sq, q.shape[-1])).sum(2)
    return dq, dk, dv


def _flash_forward(q, k, v, causal):
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse, None


def _flash_backward(dout, q, k, v, out, lse, causal, aux):
    out, lse = out.contiguous(), lse.contiguous()
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)


MATH = (_math_forward, _math_backward)
FLASH = (_flash_forward, _flash_backward)


def _flash_shapes(q: torch.Tensor, v: torch.Tensor) -> bool:
    d = q.shape[-1]
    if v.shape[-1] != d or os.environ.get("FOLDTUNE_CP_FLASH", "1") == "0":
        return False
    if q.is_cuda:
        return q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= 256
    return q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def check_flash_blocks(dtype: torch.dtype, head_dim: int, device: str) -> None:
    """Raise unless the flash blocks equal the matmul blocks: a causal and a full GQA block, forward (output and
    lse) and backward against a merged output and lse of both; 2 % of the largest value below fp32."""
    gen = torch.Generator(device=device).manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    q, k, v = rand(1, 4, 64, head_dim), rand(1, 2, 64, head_dim), rand(1, 2, 64, head_dim)
    dout = rand(1, 4, 64, head_dim)
    results = []
    for fwd, bwd in (MATH, FLASH):
        o1, l1, a1 = fwd(q, k, v, True)
        o2, l2, a2 = fwd(q, k[:, :, :32], v[:, :, :32], False)
        lse = torch.logaddexp(l1.float(), l2.float())
        out = (o1.float() * torch.exp(l1 - lse).unsqueeze(-1) + o2.float() * torch.exp(l2 - lse).unsqueeze(-1))
        out = out.to(dtype)
        grads = bwd(dout, q, k, v, out, lse, True, a1)
        grads2 = bwd(dout, q, k[:, :, :32], v[:, :, :32], out, lse, False, a2)
        results.append([o1, l1, o2, l2, *grads, *grads2])
    names = ("out", "lse", "out_full", "lse_full", "dq", "dk", "dv", "dq_full", "dk_full", "dv_full")
    assert_agree(names, *results, tol, "ring flash block {name} differs from the matmul block")


_CHECKED: dict[tuple, bool] = {}


def block_kernels(q: torch.Tensor, v: torch.Tensor):
    """(forward, backward) of the ring's block: the flash kernels where supported and checked, else matmuls."""
    if _flash_shapes(q, v) and checked_once(_CHECKED, (q.dtype, q.shape[-1], str(q.device)), check_flash_blocks,
                                            "ring flash attention"):
        return FLASH
    return MATH


# ---- the ring ---------------------------------------------------------------------------------------------------
def _start(send: torch.Tensor, group: Group, tag: int):
    """Start sending ``send`` to the next ring rank and receiving a tensor like it from the previous one; returns
    (the receive buffer, the works)."""
    n, r = group.size, group.rank
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, group.ranks[(r + 1) % n], group.pg, tag),
           dist.P2POp(dist.irecv, recv, group.ranks[(r - 1) % n], group.pg, tag)]
    return recv, dist.batch_isend_irecv(ops)


def _finish(pending) -> torch.Tensor:
    recv, works = pending
    for work in works:
        work.wait()
    return recv


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V in one contiguous buffer (one message per hop)."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(kv: torch.Tensor, k_shape: torch.Size, v_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    n = k_shape.numel()
    return kv[:n].view(k_shape), kv[n:].view(v_shape)


def _merge(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge a block's (output, lse) into the running ones, in place (fp32)."""
    new = torch.logaddexp(acc_lse, lse.float())
    acc_out.mul_(torch.exp(acc_lse - new).unsqueeze(-1)).add_(out.float() * torch.exp(lse.float() - new).unsqueeze(-1))
    acc_lse.copy_(new)


def _block(step: int, n: int, r: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of the block at ``step`` on ring rank ``r`` (module docstring)."""
    if step == 0:
        return slice(None), slice(None), True
    if (r - step) % n < r:
        return slice(None), slice(0, c), False
    return slice(c, 2 * c), slice(None), False


def _document_block(segments: torch.Tensor, step: int, n: int, r: int, rows: slice, keys: slice,
                    causal: bool) -> torch.Tensor:
    """The block's mask [b, sq, sk] (True = attend) for packed ``segments`` [b, s]: the query rows of ring rank r
    and the key rows of ring rank (r − step) mod n, at their global positions, pairs of one document only."""
    s = segments.shape[1]
    q_pos = cp_positions(s, n, r, segments.device)[rows]
    k_pos = cp_positions(s, n, (r - step) % n, segments.device)[keys]
    mask = segments[:, q_pos].unsqueeze(2) == segments[:, k_pos].unsqueeze(1)
    if causal:
        mask = mask & (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1))
    return mask


def _document_pairs(segments: torch.Tensor, step: int, n: int, r: int, c: int):
    """The chunk pairs of the block at ``step`` on ring rank ``r`` for packed ``segments``: (query rows, key
    rows, their mask [b, c, c], whether a document spans them) for each pair of a query chunk and a key chunk
    no later, step 0's diagonal pairs first. The block's rows and keys are chunk halves of the local 2c."""
    rows, keys, causal = _block(step, n, r, c)
    mask = _document_block(segments, step, n, r, rows, keys, causal)
    row_halves = [slice(0, c), slice(c, 2 * c)] if rows.start is None else [rows]
    key_halves = [slice(0, c), slice(c, 2 * c)] if keys.start is None else [keys]
    pairs = []
    for qi, q_rows in enumerate(row_halves):
        for ki, k_rows in enumerate(key_halves):
            if step == 0 and ki > qi:  # chunk 2n−1−r is later than chunk r: no pair
                continue
            q_off = 0 if rows.start is None else rows.start
            k_off = 0 if keys.start is None else keys.start
            sub = mask[:, q_rows.start - q_off:q_rows.stop - q_off, k_rows.start - k_off:k_rows.stop - k_off]
            pairs.append((q_rows, k_rows, sub, bool(sub.any())))
    if step == 0:  # the diagonal pairs (each query's own key) first: the running lse starts finite everywhere
        pairs.sort(key=lambda p: p[0] != p[1])
    return pairs


def _document_pieces(segments: torch.Tensor, step: int, n: int, r: int, c: int) -> list[tuple]:
    """The pieces of step ``step`` for packed ``segments``: the chunk pairs a document spans, each (query rows, key
    rows, mask, first); the pairs no document spans are counted and skipped."""
    pieces = []
    for q_rows, k_rows, mask, spanned in _document_pairs(segments, step, n, r, c):
        count_chunk_pair(spanned)
        if spanned:  # a diagonal pair of step 0 starts its rows' running output
            pieces.append((q_rows, k_rows, mask, step == 0 and q_rows == k_rows))
    return pieces


def _ring_forward(q, k, v, group: Group, pieces: list[list[tuple]], fwd):
    """The forward ring: at each step the pieces (query rows, key rows, causal flag or mask, first) of the K/V pair
    this rank holds, while the pair travels on; returns the merged output (fp32), its lse and each piece's kernel
    state for the backward, in piece order."""
    kv = _pack(k, v)
    acc_out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float32, device=q.device)
    acc_lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    aux = []
    for step in range(group.size):
        pending = _start(kv, group, 0) if step < group.size - 1 else None
        k_j, v_j = _unpack(kv, k.shape, v.shape)
        for q_rows, k_rows, mask, first in pieces[step]:
            out, lse, extra = fwd(q[:, :, q_rows], k_j[:, :, k_rows], v_j[:, :, k_rows], mask)
            aux.append(extra)
            if first:  # the rows' first (finite) part: taken as it is, nothing to merge with yet
                acc_out[:, :, q_rows], acc_lse[:, :, q_rows] = out, lse
            else:
                _merge(acc_out[:, :, q_rows], acc_lse[:, :, q_rows], out, lse)
        if pending is not None:
            kv = _finish(pending)
    return acc_out, acc_lse, aux


def _ring_backward(dout, q, k, v, out, lse, group: Group, pieces: list[list[tuple]], bwd, aux):
    """The backward ring over the forward's pieces: dq stays, each pair's dk/dv travels with it (module
    docstring); returns (dq, dk, dv) in q's and k's dtypes."""
    n = group.size
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = _pack(k, v)
    grads = None  # (receive buffer, works) of the travelling dk/dv
    states = iter(aux)
    for step in range(n):
        pending = _start(kv, group, 0) if step < n - 1 else None
        k_j, v_j = _unpack(kv, k.shape, v.shape)
        mine = []  # this rank's dk/dv of the pieces' keys, added once the travelling buffer has arrived
        for q_rows, k_rows, mask, _ in pieces[step]:
            dq_b, dk_b, dv_b = bwd(dout[:, :, q_rows], q[:, :, q_rows], k_j[:, :, k_rows], v_j[:, :, k_rows],
                                   out[:, :, q_rows], lse[:, :, q_rows], mask, next(states))
            dq[:, :, q_rows] += dq_b
            mine.append((k_rows, dk_b, dv_b))
        dkv = torch.zeros_like(kv) if grads is None else _finish(grads)
        dk_j, dv_j = _unpack(dkv, k.shape, v.shape)
        for k_rows, dk_b, dv_b in mine:
            dk_j[:, :, k_rows] += dk_b
            dv_j[:, :, k_rows] += dv_b
        grads = _start(dkv, group, 1) if n > 1 else (dkv, [])
        if pending is not None:
            kv = _finish(pending)
    dk, dv = _unpack(_finish(grads), k.shape, v.shape)
    return dq.to(q.dtype), dk, dv


class _RingAttention(torch.autograd.Function):
    """The ring of one micro-batch: one block a step (module docstring) on the flash or matmul kernels; packed
    (``segments``), the block's chunk pairs a document spans, masked, on the matmul kernels."""

    @staticmethod
    def forward(ctx, q, k, v, group: Group, segments: torch.Tensor | None):
        n, r, c = group.size, group.rank, q.shape[2] // 2
        if segments is None:
            kernels = block_kernels(q, v)
            pieces = [[(*_block(step, n, r, c), step == 0)] for step in range(n)]
        else:
            kernels = MATH
            pieces = [_document_pieces(segments, step, n, r, c) for step in range(n)]
        out, lse, aux = _ring_forward(q, k, v, group, pieces, kernels[0])
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.pieces, ctx.kernels, ctx.aux = group, pieces, kernels, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if dout.stride(-1) != 1:  # flash reads rows of d contiguous values
            dout = dout.contiguous()
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.group, ctx.pieces, ctx.kernels[1], ctx.aux)
        return dq, dk, dv, None, None


def ring_attention(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, group: Group,
                   segments_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of this ring rank's queries [b, heads, 2c, d] (chunks r and 2n−1−r of the ring's
    2n) against every ring rank's keys and values [b, kv_heads, 2c, d or d_v], passed around ``group``; the
    output [b, heads, 2c, d_v] in q's dtype, 1/√d scale. A group of one is plain causal attention.
    ``segments_BS``: a packed micro-batch's segment ids [b, s] (whole sequence, global order): attention within
    documents only, the chunk pairs no document spans skipped."""
    return _RingAttention.apply(q_BHSD, k_BKSD, v_BKSD, group, segments_BS)
