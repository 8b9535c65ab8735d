"""Context parallelism: the sequence split over the ``cp`` axis and an attention that spans it.

Public: :func:`cp_positions`, :func:`cp_split`, :func:`cp_unsplit`, :func:`check_cp_seq_len`,
:func:`cp_attention`, :func:`cp_cross_entropy`.

[Note: load-balanced sequence split]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Causal attention gives the query at position p work proportional to p. Splitting a sequence
into cp contiguous pieces would hand the last cp rank ~2x the mean work and the first almost
none. The head-tail split (torchtitan's, Megatron's and TE's load balancing) cuts the sequence
into ``2 * cp`` equal chunks and gives cp rank r the chunks ``r`` and ``2*cp - 1 - r``::

    seq:      | c0 | c1 | c2 | c3 | c4 | c5 | c6 | c7 |        cp = 4, 8 chunks
    cp rank:     0    1    2    3    3    2    1    0

    rank r holds [c_r ; c_(2cp-1-r)]   (in that order, head chunk first)

so every rank holds one early and one late chunk and does the same attention work. The
sequence length must be divisible by ``2 * cp``: :func:`check_cp_seq_len` refuses other
lengths with a clear error (pad the batch to a multiple of ``2 * cp`` with label -100; the
loss ignores those tokens and, causal attention running forward only, real tokens never see
the padding).

Everything that is per-token is split the same way: token ids, labels, position ids. RoPE
uses the GLOBAL positions (:func:`cp_positions`), so rank r rotates its tokens as the
single-process model would.

[Note: all-gather-KV attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
:func:`cp_attention` all-gathers K, V and their positions over the cp axis (each rank then
holds the whole sequence's K/V, in rank order, not sequence order) and runs SDPA for its
local queries against all keys, with the causal mask computed from global positions
(``q_pos >= k_pos``). Row order of the keys does not matter to softmax; the mask does.
Backward: the gradient of the gathered K/V is reduce-scattered (summed) back to the rank
that owns each chunk, the adjoint of the all-gather. Cost per layer and rank: all-gather of
``(cp - 1) / cp`` of the sequence's K and V, and the same volume reduce-scattered in
backward; activation memory O(seq / cp) except the gathered K/V of the running layer.

On CPU the head-tail case runs mask-free (``_ChunkCausalAttention``); ``comm="ring"`` passes
K/V around the cp ring instead of gathering them ([Note: ring attention]).

torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``) does not
run on CPU in torch 2.13: the default SDPA backend fails ("aten._scaled_dot_product_flash_
attention_for_cpu.default does not have a sharding strategy registered") and the math
backend fails on mixed Tensor/DTensor arithmetic (pytorch#147793), checked on gloo.

[Note: loss over dp_cp]
~~~~~~~~~~~~~~~~~~~~~~~
Every rank of the ``dp_cp`` axis holds different tokens. The loss is the token-weighted
mean over all of them: ``sum of token losses / number of non-ignored tokens``, both summed
over ``dp_cp``. :func:`cp_cross_entropy` returns that global value on every rank; its
backward hands each rank the gradient of the global loss times the ``dp_cp`` size, which
FSDP2's default gradient averaging over ``dp_shard_cp`` (x ``dp_replicate`` for HSDP) divides
back out: the divide factor counts cp, because the FSDP mesh is the FLATTENED
``dp_shard_cp``, never a 2-D ``(dp_shard, cp)`` mesh (which ``fully_shard`` would read as
HSDP, replicating over cp and averaging wrongly; NeMo-Automodel #2768).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from shardbridge._checks import checked_args
from shardbridge._compat import all_gather_single, reduce_scatter_single
from shardbridge._mesh import ParallelMesh

__all__ = [
    "check_cp_seq_len",
    "cp_attention",
    "cp_cross_entropy",
    "cp_positions",
    "cp_split",
    "cp_unsplit",
]


def check_cp_seq_len(seq_len: int, cp: int, *, what: str = "sequence length") -> None:
    """Refuse a sequence length the head-tail split cannot cut evenly.

    Raises:
        ValueError: ``seq_len`` is not divisible by ``2 * cp``; the message says how to pad.

    Example:
        >>> check_cp_seq_len(16, 2)
        >>> check_cp_seq_len(10, 4)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ValueError: ...
    """
    if cp < 1:
        raise ValueError(f"cp({cp}) must be >= 1")
    if cp > 1 and seq_len % (2 * cp):
        padded = -(-seq_len // (2 * cp)) * (2 * cp)
        raise ValueError(
            f"{what} {seq_len} is not divisible by 2 * cp = {2 * cp} (the load-balanced split cuts it into "
            f"2 * cp chunks); pad the batch to {padded} tokens with labels -100 (ignored by the loss) "
            "or choose a cp dividing seq_len / 2"
        )


def _chunks(cp: int, rank: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def cp_positions(seq_len: int, cp: int, rank: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of the tokens cp rank ``rank`` holds (see [Note: load-balanced sequence split]).

    Args:
        seq_len: the GLOBAL sequence length (divisible by ``2 * cp``).
        cp: the cp degree.
        rank: this rank's coordinate on the cp axis.
        device: where to build the tensor.

    Returns:
        int64 ``[seq_len // cp]``: ``[chunk r ; chunk 2cp-1-r]`` positions.

    Example:
        >>> cp_positions(8, 2, 0).tolist()
        [0, 1, 6, 7]
    """
    check_cp_seq_len(seq_len, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank({rank}) must be in [0, cp({cp}))")
    if cp == 1:
        return torch.arange(seq_len, device=device)
    size = seq_len // (2 * cp)
    head, tail = _chunks(cp, rank)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in (head, tail)])


def _cp_coords(cp_mesh: DeviceMesh | None) -> tuple[int, int]:
    if cp_mesh is None:
        return 1, 0
    if cp_mesh.ndim != 1:
        raise ValueError(f"cp_mesh must be the 1-D cp mesh (pm['cp']), got a {cp_mesh.ndim}-D mesh")
    return cp_mesh.size(), cp_mesh.get_local_rank()


@checked_args(tensor=torch.Tensor, cp_mesh=(DeviceMesh, None))
def cp_split(tensor: torch.Tensor, cp_mesh: DeviceMesh | None, *, dim: int = 1) -> torch.Tensor:
    """This cp rank's part of a full-length tensor (tokens, labels, position ids, masks).

    Args:
        tensor: identical on every rank of the cp axis; ``tensor.shape[dim]`` is the sequence.
        cp_mesh: the 1-D ``cp`` mesh (``pm["cp"]``); None or size 1 = no split.
        dim: the sequence dim.

    Returns:
        ``[chunk r ; chunk 2cp-1-r]`` along ``dim`` (a new tensor; a view when cp == 1).

    Raises:
        ValueError: the length along ``dim`` is not divisible by ``2 * cp``.

    Example:
        >>> tokens = cp_split(tokens, pm["cp"])  # [batch, seq] -> [batch, seq // cp]  # doctest: +SKIP
    """
    cp, rank = _cp_coords(cp_mesh)
    if cp == 1:
        return tensor
    check_cp_seq_len(tensor.shape[dim], cp)
    chunks = tensor.chunk(2 * cp, dim=dim)
    head, tail = _chunks(cp, rank)
    return torch.cat([chunks[head], chunks[tail]], dim=dim)


@checked_args(local=torch.Tensor, cp_mesh=(DeviceMesh, None))
def cp_unsplit(local: torch.Tensor, cp_mesh: DeviceMesh | None, *, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`cp_split`: the full-length tensor, in sequence order, on every cp rank.

    A collective over the cp axis (every cp rank must call it); not differentiable.

    Example:
        >>> logits = cp_unsplit(model(cp_split(tokens, pm["cp"])), pm["cp"])  # doctest: +SKIP
    """
    cp, _ = _cp_coords(cp_mesh)
    if cp == 1:
        return local
    gathered = _all_gather_seq(local.detach(), cp_mesh.get_group(), dim)  # [rank 0 | rank 1 | ...]
    pieces = gathered.chunk(2 * cp, dim=dim)  # rank r's head at 2r, tail at 2r + 1
    order = [0] * (2 * cp)
    for r in range(cp):
        head, tail = _chunks(cp, r)
        order[head], order[tail] = 2 * r, 2 * r + 1
    return torch.cat([pieces[i] for i in order], dim=dim)


def _all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """All-gather along ``dim`` in rank order (no autograd)."""
    world = dist.get_world_size(group)
    flat = x.movedim(dim, 0).contiguous()
    out = flat.new_empty((world * flat.shape[0], *flat.shape[1:]))
    all_gather_single(out, flat, group=group)
    return out.movedim(0, dim)


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Sum over ranks, then keep this rank's slice along ``dim`` (no autograd)."""
    world = dist.get_world_size(group)
    flat = x.movedim(dim, 0).contiguous()
    out = flat.new_empty((flat.shape[0] // world, *flat.shape[1:]))
    reduce_scatter_single(out, flat, group=group)
    return out.movedim(0, dim)


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along a dim; backward reduce-scatters the gradient (its adjoint)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:  # noqa: D102
        ctx.group, ctx.dim = group, dim
        return _all_gather_seq(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return _reduce_scatter_seq(grad, ctx.group, ctx.dim), None, None


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cp_mesh: DeviceMesh | None,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    sliding_window: int | None = None,
    comm: str = "all_gather",
) -> torch.Tensor:
    """Causal attention of this rank's queries against the keys of the whole cp group.

    See [Note: all-gather-KV attention] and [Note: ring attention]. With ``cp_mesh`` None or
    of size 1 it is plain causal SDPA (with the mask from ``positions``).

    Args:
        q: ``[batch, heads, local_seq, head_dim]``, this rank's queries (RoPE applied).
        k: ``[batch, kv_heads, local_seq, head_dim]`` (RoPE applied).
        v: ``[batch, kv_heads, local_seq, head_dim]``.
        positions: global positions of the local tokens, ``[local_seq]`` or
            ``[batch, local_seq]`` (e.g. from :func:`cp_positions`).
        cp_mesh: the 1-D ``cp`` mesh.
        scale: softmax scale; None = ``1 / sqrt(head_dim)``.
        enable_gqa: ``kv_heads`` divides ``heads`` (grouped query attention).
        dropout_p: attention dropout (as SDPA's; 0 = off).
        sliding_window: a query sees only keys less than this many positions back
            (``q_pos - k_pos < sliding_window``, transformers' definition); None = no window.
        comm: "all_gather" (any positions, windows, dropout, any device) or "ring" (K/V
            passed around the cp ring, p2p; head-tail positions, CPU, no window or dropout).

    Returns:
        ``[batch, heads, local_seq, head_dim]``.

    Example:
        >>> out = cp_attention(q, k, v, cp_positions(seq, cp, r), pm["cp"], enable_gqa=True)  # doctest: +SKIP
    """
    cp, rank = _cp_coords(cp_mesh)
    if positions.shape[-1] != q.shape[-2]:
        raise ValueError(f"positions has {positions.shape[-1]} tokens, q has {q.shape[-2]}; pass the local positions")
    sdpa = dict(dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
    if comm not in ("all_gather", "ring"):
        raise ValueError(f"comm={comm!r} must be 'all_gather' or 'ring'")
    k_pos = positions
    if cp > 1 and comm == "ring":
        if q.device.type != "cpu" or sliding_window is not None or dropout_p:
            raise NotImplementedError(
                "comm='ring' runs on CPU without sliding_window or dropout (its kernel is SDPA's CPU flash "
                "attention); use comm='all_gather'"
            )
        if not _is_head_tail(_all_gather_seq(positions, cp_mesh.get_group(), positions.ndim - 1), cp):
            raise ValueError(
                "comm='ring' needs the head-tail split (positions from cp_positions / cp_split); use "
                "comm='all_gather' for other positions"
            )
        return _RingAttention.apply(q, k, v, cp_mesh.get_group(), scale)
    if cp > 1:
        group = cp_mesh.get_group()
        k = _AllGatherSeq.apply(k, group, 2)
        v = _AllGatherSeq.apply(v, group, 2)
        k_pos = _all_gather_seq(positions, group, positions.ndim - 1)
        if _is_head_tail(k_pos, cp):  # the same decision on every rank: k_pos is global
            return _head_tail_attention(q, k, v, cp, rank, sliding_window, sdpa)
    distance = positions.unsqueeze(-1) - k_pos.unsqueeze(-2)  # [(batch,) q, k] on global positions
    mask = distance >= 0  # causal
    if sliding_window is not None:
        mask &= distance < sliding_window
    if mask.ndim == 3:
        mask = mask.unsqueeze(1)  # [batch, 1, q, k]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **sdpa)


def _is_head_tail(gathered_positions: torch.Tensor, cp: int) -> bool:
    """Whether the gathered positions (rank order) are exactly the head-tail split of 0..seq-1."""
    seq = gathered_positions.shape[-1]
    if seq % (2 * cp):
        return False
    expected = torch.cat([cp_positions(seq, cp, r, device=gathered_positions.device) for r in range(cp)])
    return bool((gathered_positions == expected).all())


def _head_tail_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: int,
    rank: int,
    sliding_window: int | None,
    sdpa: dict,
) -> torch.Tensor:
    """[Note: all-gather-KV attention], head-tail fast path: each local chunk sees only its past.

    Query chunk ``c`` (of ``2 * cp``) attends to key chunks ``0..c``: the rank-ordered
    gathered K/V are put back in sequence order and cut at the chunk's end, so no SDPA call
    computes fully masked blocks and the mask is ``chunk x (c + 1) * chunk`` (lower-right
    causal) instead of ``local_seq x seq``. Rank r's two chunks cost ``r + 1`` and
    ``2cp - r`` blocks: ``2cp + 1`` on every rank.
    """
    size = q.shape[2] // 2
    order = [0] * (2 * cp)  # sequence chunk -> its index among the rank-ordered pieces
    for r in range(cp):
        head, tail = _chunks(cp, r)
        order[head], order[tail] = 2 * r, 2 * r + 1
    index = torch.cat([torch.arange(i * size, (i + 1) * size, device=k.device) for i in order])
    k, v = k.index_select(2, index), v.index_select(2, index)  # sequence order
    outs = []
    blockwise = q.device.type == "cpu" and sliding_window is None and not sdpa["dropout_p"]
    for local, chunk in enumerate(_chunks(cp, rank)):
        end = (chunk + 1) * size
        if blockwise:  # no mask at all: see _ChunkCausalAttention
            q_chunk = q[:, :, local * size : (local + 1) * size]
            outs.append(_ChunkCausalAttention.apply(q_chunk, k[:, :, :end], v[:, :, :end], sdpa["scale"]))
            continue
        q_pos = torch.arange(chunk * size, end, device=q.device)
        distance = q_pos.unsqueeze(-1) - torch.arange(end, device=q.device).unsqueeze(0)
        mask = distance >= 0
        if sliding_window is not None:
            mask &= distance < sliding_window
        q_chunk = q[:, :, local * size : (local + 1) * size]
        outs.append(F.scaled_dot_product_attention(q_chunk, k[:, :, :end], v[:, :, :end], attn_mask=mask, **sdpa))
    return torch.cat(outs, dim=2)


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)  # q head i <- kv head i // groups


def _sum_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(2)


class _ChunkCausalAttention(torch.autograd.Function):
    """One query chunk against keys ``[0, end)``, the last ``chunk`` keys being its own positions.

    The past keys are fully visible and the diagonal block is square-causal, so the two are
    two mask-free flash calls merged by their log-sum-exp (as ring attention merges blocks);
    backward runs the flash backward of each block against the MERGED output and lse, which
    gives each block's exact gradients. Activation memory is linear in the sequence: a
    boolean mask handed to SDPA on CPU is converted to a float mask and SAVED for backward
    (``chunk x end x 4`` bytes per layer), which measured more than the activations it was
    meant to divide by cp. CPU only (the kernel is SDPA's CPU flash attention).
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:  # noqa: D102
        from shardbridge._compat import flash_attention_cpu

        size, groups = q.shape[2], q.shape[1] // k.shape[1]
        past = k.shape[2] - size
        kr, vr = _repeat_kv(k, groups), _repeat_kv(v, groups)
        out, lse = flash_attention_cpu(q, kr[:, :, past:], vr[:, :, past:], True, scale)
        if past:
            out_past, lse_past = flash_attention_cpu(q, kr[:, :, :past], vr[:, :, :past], False, scale)
            merged = torch.logaddexp(lse_past, lse)
            out = (
                torch.exp(lse_past - merged).unsqueeze(-1) * out_past.to(merged.dtype)
                + torch.exp(lse - merged).unsqueeze(-1) * out.to(merged.dtype)
            ).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        from shardbridge._compat import flash_attention_cpu_backward

        q, k, v, out, lse = ctx.saved_tensors
        size, groups = q.shape[2], q.shape[1] // k.shape[1]
        past = k.shape[2] - size
        kr, vr = _repeat_kv(k, groups), _repeat_kv(v, groups)
        grad = grad.contiguous()
        dq, dk, dv = flash_attention_cpu_backward(grad, q, kr[:, :, past:], vr[:, :, past:], out, lse, True, ctx.scale)
        if past:
            dq_past, dk_past, dv_past = flash_attention_cpu_backward(
                grad, q, kr[:, :, :past], vr[:, :, :past], out, lse, False, ctx.scale
            )
            dq = dq + dq_past
            dk, dv = torch.cat([dk_past, dk], dim=2), torch.cat([dv_past, dv], dim=2)
        return dq, _sum_groups(dk, groups), _sum_groups(dv, groups), None


# [Note: ring attention]
# ~~~~~~~~~~~~~~~~~~~~~~
# comm="ring": K/V never gathered. At step s (0..cp-1) rank r holds the K/V chunks of rank
# (r - s) mod cp, runs each of its two query chunks against the held chunks that precede it
# (full block) or are its own (causal block), merges (out, lse) as blocks come, and passes
# the K/V to rank r + 1. Backward runs the same ring with dK/dV travelling with the K/V:
# after cp shifts every block and its summed gradient are back at their owner. Only the
# local K/V are saved for backward: activation memory is the local tokens' alone. Bytes per
# layer and rank: forward (cp - 1) x local K/V sent, backward cp x (K/V + dK/dV) (the last
# shift of K/V is skipped). gloo runs the shifts synchronously; on NCCL they could overlap.

#: p2p bytes this process sent in ring attention (read and reset by tools/bench/bench_cp.py).
RING_BYTES_SENT = [0]


def _ring_shift(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Send ``tensors`` to the next cp rank, receive the previous rank's (same shapes)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in received]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    RING_BYTES_SENT[0] += sum(t.numel() * t.element_size() for t in tensors)
    return received


def _merge(acc: tuple | None, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if acc is None:
        return out.to(lse.dtype), lse
    acc_out, acc_lse = acc
    merged = torch.logaddexp(acc_lse, lse)
    return (
        torch.exp(acc_lse - merged).unsqueeze(-1) * acc_out + torch.exp(lse - merged).unsqueeze(-1) * out.to(lse.dtype)
    ), merged


class _RingAttention(torch.autograd.Function):
    """See [Note: ring attention]. q ``[b, h, 2c, d]``, k/v ``[b, hkv, 2c, d]`` in head-tail order."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, scale):  # noqa: D102
        from shardbridge._compat import flash_attention_cpu

        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        size, groups = q.shape[2] // 2, q.shape[1] // k.shape[1]
        q_chunks = _chunks(cp, rank)
        acc: list = [None, None]
        held_k, held_v = k, v
        for step in range(cp):
            src = (rank - step) % cp
            kr, vr = _repeat_kv(held_k, groups), _repeat_kv(held_v, groups)
            for i, a in enumerate(q_chunks):
                for j, b in enumerate(_chunks(cp, src)):
                    if b > a:
                        continue  # a later chunk: masked out entirely
                    block = slice(j * size, (j + 1) * size)
                    out, lse = flash_attention_cpu(
                        q[:, :, i * size : (i + 1) * size], kr[:, :, block], vr[:, :, block], b == a, scale
                    )
                    acc[i] = _merge(acc[i], out, lse)
            if step < cp - 1:
                held_k, held_v = _ring_shift([held_k, held_v], group)
        out = torch.cat([acc[0][0], acc[1][0]], dim=2).to(q.dtype)
        lse = torch.cat([acc[0][1], acc[1][1]], dim=2)
        # v is usually a view into the fused qkv output: save a copy of v alone, not that storage.
        ctx.save_for_backward(q, k.contiguous(), v.contiguous(), out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        from shardbridge._compat import flash_attention_cpu_backward

        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        size, groups = q.shape[2] // 2, q.shape[1] // k.shape[1]
        grad = grad.contiguous()
        dq = torch.zeros_like(q)
        held_k, held_v = k, v
        held_dk, held_dv = torch.zeros_like(k), torch.zeros_like(v)  # travel with their K/V
        q_chunks = _chunks(cp, rank)
        for step in range(cp):
            src = (rank - step) % cp
            kr, vr = _repeat_kv(held_k, groups), _repeat_kv(held_v, groups)
            for i, a in enumerate(q_chunks):
                rows = slice(i * size, (i + 1) * size)
                for j, b in enumerate(_chunks(cp, src)):
                    if b > a:
                        continue
                    block = slice(j * size, (j + 1) * size)
                    dq_i, dk_j, dv_j = flash_attention_cpu_backward(
                        grad[:, :, rows],
                        q[:, :, rows],
                        kr[:, :, block],
                        vr[:, :, block],
                        out[:, :, rows],
                        lse[:, :, rows],
                        b == a,
                        ctx.scale,
                    )
                    dq[:, :, rows] += dq_i
                    held_dk[:, :, block] += _sum_groups(dk_j, groups)
                    held_dv[:, :, block] += _sum_groups(dv_j, groups)
            if step < cp - 1:
                held_k, held_v, held_dk, held_dv = _ring_shift([held_k, held_v, held_dk, held_dv], group)
            else:  # one more shift brings each block's summed gradient home
                held_dk, held_dv = _ring_shift([held_dk, held_dv], group)
        return dq, held_dk, held_dv, None, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient (torch.distributed.nn's rule)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@checked_args(logits=torch.Tensor, labels=torch.Tensor, mesh=ParallelMesh)
def cp_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mesh: ParallelMesh,
    *,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Token-weighted mean cross entropy over every token of the ``dp_cp`` axis.

    See [Note: loss over dp_cp]. Every rank gets the same (global) value; backward is right
    under FSDP2's default gradient averaging over ``mesh.fsdp_mesh``.

    Args:
        logits: ``[..., vocab]``, this rank's tokens (float32 recommended).
        labels: ``[...]``, the matching labels (split like the inputs); ``ignore_index`` tokens
            do not count.
        mesh: the run's :class:`~shardbridge.ParallelMesh`.
        ignore_index: the label of tokens to leave out.

    Returns:
        A scalar: sum of token losses / number of counted tokens, over all of ``dp_cp``.

    Raises:
        ValueError: no token of the global batch is counted.

    Example:
        >>> loss = cp_cross_entropy(model(cp_split(tokens, pm["cp"])), cp_split(labels, pm["cp"]), pm)  # doctest: +SKIP
    """
    total = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=ignore_index, reduction="sum")
    count = (labels != ignore_index).sum().to(total.dtype)
    group_mesh = mesh["dp_cp"]
    if group_mesh.size() > 1:
        group = group_mesh.get_group()
        dist.all_reduce(count, group=group)
        total = _SumOverGroup.apply(total, group)
    if count.item() == 0:
        raise ValueError(f"cp_cross_entropy: every label of the global batch is ignore_index({ignore_index})")
    return total / count
