"""Expert parallelism: each token to the ranks holding its experts and back, and router statistics.

Public: :func:`run_experts`, :func:`choose_dispatch`, :func:`shard_experts`,
:func:`expert_shard_dim`, :func:`router_statistics`, :func:`load_balancing_loss`,
:data:`EPDispatch`. The autograd functions below are private.

A mixture-of-experts layer routes each token to ``top_k`` of ``num_experts`` experts and sums
their outputs weighted by the router. Under expert parallelism the experts are split over the
``ep`` axis (``Shard(0)`` of the ``[num_experts, ...]`` weights: ep rank j holds experts
``[j * E/ep, (j + 1) * E/ep)``), so a token must travel to the rank holding each of its experts,
and the outputs travel back. :func:`run_experts` does that for any experts module: it is handed
the tokens grouped by local expert and returns their outputs.

[Note: expert dispatch]
~~~~~~~~~~~~~~~~~~~~~~~
In the dense region the ``tp`` ranks hold the SAME tokens (activations are replicated over tp).
Experts are not tensor-parallel (they are split over ep instead, see [Note: expert axes] in
``_mesh.py``), so each tp rank first keeps ``1/tp`` of the tokens (backward: an all-gather of
their gradients), and after the experts the outputs are all-gathered over tp again (backward:
each rank keeps its slice). Inside, every rank of a replica holds different tokens, and
the ranks of an ep group hold every expert between them. Two ways to move the tokens:

``all_to_all`` (token dispatch; Megatron-Core's, torchtitan's and DeepSpeed's)::

    rank r: tokens x_r [T, D], top-k ids [T, k]
      sort the T*k (token, slot) copies by expert -> grouped by destination ep rank
      all-to-all the counts [E] (who sends how many to whom), then the copies
      [T*k, D] -> rank of the expert           (each copy sent once; ~(ep-1)/ep of them leave)
      local experts on the received copies, grouped expert-major
      all-to-all back (the reverse splits)     -> weight by the router, sum over slots

    bytes per rank and direction ~ T * k * D * (ep - 1) / ep, plus the counts

``all_gather`` (transformers' ``ep_implementation="all_reduce"``, for ranks holding different
tokens): every rank of the ep group gets ALL the group's tokens and routing (all-gather), runs
its local experts on the copies routed to them, and the partial sums go back to the token's
rank with a reduce-scatter (sum). transformers' ep ranks see the same tokens, so it all-reduces
the partial outputs; here each rank needs only its own tokens back, and a reduce-scatter is
the all-reduce's second half::

    bytes per rank and direction = T * D * (ep - 1)   (padded to the largest T of the group)

``choose_dispatch("auto", ...)`` takes ``all_gather`` when ``top_k >= ep`` (it then moves no more
bytes: ``T*D*(ep-1) <= T*k*D*(ep-1)/ep``) and ``all_to_all`` otherwise. ``all_gather`` also
needs no count exchange (one round instead of two, no host sync on the counts), which is what
matters at tiny token counts; ``tools/bench/bench_moe.py`` prints both side by side. Routing
is dropless (no capacity factor), so every layout computes what one process computes, up to
the order of floating-point sums.

[Note: router statistics over dp_cp]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The load-balancing loss (Switch Transformer's, as transformers' ``load_balancing_loss_func``)
is ``E * sum_e f_e * P_e``: ``f_e`` the fraction of tokens routed to expert e (counted once per
top-k slot), ``P_e`` the mean router probability of e, both over every token of every MoE layer.
The router runs in the dense region, so its tokens are distinct over ``dp_cp`` and replicated
over tp: counts and probability sums are summed over ``dp_cp`` (never tp), and every rank gets
the loss of the GLOBAL batch, as one process computes it. The probability sums go through an
all-reduce whose backward all-reduces the gradient (``_SumOverGroup``): each rank's loss holds
the same global term, FSDP averages the router's gradient over ``dp_cp``, and the sum-then-
average gives exactly the gradient of the global term (as for ``cp_cross_entropy``).
transformers computes the loss per process on its own tokens instead (a different number,
docs/concepts/moe.md).

[Note: expert checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~~~~
An expert tensor is ONE 3-D DTensor whose dim 0 is the global expert index in every layout:
ep splits dim 0 (``Shard(0)``), FSDP2 splits dim 0 again or dim 1, and DCP stores each rank's
box in global coordinates. A checkpoint therefore holds ``experts.gate_up_proj`` ``[E, 2I, D]``
whatever ep was, and loads into any ep, plain FSDP (ep=1), TP-only and one process
(``tests/checkpoint/test_experts.py``). FSDP2 stores the pieces as::

    FSDP on dim 0   (_StridedShard(0, sf=ep), Shard(0)) on (efsdp, ep)
                    rank (i, j): torch.chunk(ep piece j, efsdp)[i] -- experts j*E/ep + ...
    FSDP on dim 1   (Shard(1), Shard(0)): rank (i, j) holds experts j*E/ep .. (j+1)*E/ep - 1,
                    rows torch.chunk(2I rows, efsdp)[i]

``_StridedShard`` is where DCP goes wrong for FSDP2 x TP ([Note: strided sharding order]): it
reads FSDP2's layout right only when the pieces it strides over are equal. The ep pieces always
are (E is divisible by ep), so DCP describes both layouts right at every size, an uneven dim-0
split included (the property test ``test_expert_tensors_keep_item_coordinates_and_dcp_describes_them``
checks every coordinate against torch's own box; no layout repair is needed). What dim 0 does
badly is balance: 4 local experts over efsdp=8 leave half the ranks holding nothing. So FSDP2's
``shard_placement_fn`` takes dim 0 when ``E/ep`` splits evenly over efsdp, else the first later
dim that does (torchtitan switches to dim 1 when ``efsdp * ep > E``), else dim 0
(:func:`expert_shard_dim`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from shardbridge._checks import checked_args
from shardbridge._cp import _SumOverGroup
from shardbridge._mesh import ParallelMesh
from shardbridge._precision import PrecisionPolicy
from shardbridge._wrap import set_gradient_divide_factor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "EPDispatch",
    "choose_dispatch",
    "expert_shard_dim",
    "load_balancing_loss",
    "router_statistics",
    "run_experts",
    "shard_experts",
]

EPDispatch = Literal["auto", "all_to_all", "all_gather"]
"""How :func:`run_experts` moves tokens over ``ep``; see [Note: expert dispatch]."""

_DISPATCHES = ("auto", "all_to_all", "all_gather")

ExpertsFn = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]
"""``(tokens [R, D] grouped by local expert, counts per local expert) -> outputs [R, D_out]``."""


def choose_dispatch(dispatch: str, *, top_k: int, ep: int) -> Literal["all_to_all", "all_gather"]:
    """The dispatch :func:`run_experts` uses: ``dispatch`` itself, or for "auto" the cheaper one.

    "auto" = ``all_gather`` when ``top_k >= ep`` (it moves at most the bytes of the all-to-all,
    in one round), else ``all_to_all``. See [Note: expert dispatch].

    Raises:
        ValueError: an unknown ``dispatch``.

    Example:
        >>> choose_dispatch("auto", top_k=8, ep=4), choose_dispatch("auto", top_k=2, ep=4)
        ('all_gather', 'all_to_all')
    """
    if dispatch not in _DISPATCHES:
        raise ValueError(f"dispatch={dispatch!r} is not one of {list(_DISPATCHES)}; 'auto' picks by top_k and ep")
    if dispatch != "auto":
        return dispatch  # type: ignore[return-value]
    return "all_gather" if top_k >= ep > 1 else "all_to_all"


def run_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    experts: ExpertsFn,
    *,
    num_experts: int,
    mesh: ParallelMesh | None = None,
    dispatch: EPDispatch = "auto",
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{expert_ids[t, k]}(x[t])`` with the experts split over ``ep``.

    Call it on every rank with the dense region's tokens (the same on the ranks of a tp group).
    The tokens are split over tp, sent to the ep ranks holding their experts, run through
    ``experts`` there, sent back, weighted, summed over the k slots and all-gathered over tp
    again. Every step is differentiable (gradients reach ``x``, ``weights`` and the experts'
    parameters). See [Note: expert dispatch].

    Args:
        x: ``[T, D]`` tokens.
        expert_ids: ``[T, k]`` global expert index of each slot (int).
        weights: ``[T, k]`` router weights of each slot.
        experts: this rank's experts: called with the tokens routed to them, grouped by local
            expert (local expert i = global expert ``ep_rank * E/ep + i``), and the count per
            local expert; returns one output row per input row. It is called on every rank,
            also with zero rows.
        num_experts: E, the global number of experts; divisible by ep.
        mesh: the run's :class:`~shardbridge.ParallelMesh`; None = one process.
        dispatch: "all_to_all", "all_gather" or "auto" (:func:`choose_dispatch`).

    Returns:
        ``[T, D_out]`` in ``weights``' dtype promoted with the experts' output.

    Raises:
        ValueError: ``num_experts`` not divisible by ep, ids out of range, mismatched shapes.

    Example:
        >>> out = run_experts(x, ids, w, model.experts.run, num_experts=8, mesh=pm)  # doctest: +SKIP
    """
    if x.dim() != 2 or expert_ids.shape != weights.shape or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"run_experts: x must be [T, D] and expert_ids / weights [T, k]; got {tuple(x.shape)}, "
            f"{tuple(expert_ids.shape)}, {tuple(weights.shape)}"
        )
    ep = 1 if mesh is None else mesh["ep"].size()
    tp = 1 if mesh is None else mesh["tp"].size()
    if num_experts % ep:
        raise ValueError(
            f"num_experts({num_experts}) is not divisible by ep({ep}); every ep rank must hold the same number "
            "of experts: choose ep dividing num_experts"
        )
    mode = choose_dispatch(dispatch, top_k=expert_ids.shape[1], ep=ep)
    _check_ids(expert_ids, num_experts)  # before the split: every rank raises, none waits
    total = x.shape[0]
    if tp > 1:  # Replicate -> Shard(tokens) over tp: each tp rank routes its own 1/tp
        group, rank = mesh["tp"].get_group(), mesh["tp"].get_local_rank()
        sizes = _split_sizes(total, tp)
        start, length = sum(sizes[:rank]), sizes[rank]
        x = _SplitRows.apply(x, sizes, group, rank)
        weights = _SplitRows.apply(weights, sizes, group, rank)
        expert_ids = expert_ids.narrow(0, start, length)
    if ep == 1:
        out = _run_local(x, expert_ids, weights, experts, 0, num_experts)
    elif mode == "all_to_all":
        out = _all_to_all_dispatch(x, expert_ids, weights, experts, num_experts, mesh["ep"])
    else:
        out = _all_gather_dispatch(x, expert_ids, weights, experts, num_experts, mesh["ep"])
    if tp > 1:  # Shard(tokens) -> Replicate over tp
        out = _GatherRows.apply(out, sizes, group, rank)
    return out


# --------------------------------------------------------------------------- local compute


def _group_by_expert(expert_ids: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Token indices, slot indices (into the flattened [T*k]) and per-expert counts of a range.

    The slots routed to experts ``[first, first + count)``, grouped by expert (stable: token
    order within an expert).
    """
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    mine = (flat >= first) & (flat < first + count)
    slots = torch.nonzero(mine).flatten()
    order = torch.argsort(flat[slots], stable=True)
    slots = slots[order]
    counts = torch.bincount(flat[slots] - first, minlength=count).tolist()
    return slots // k, slots, counts


def _run_local(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, experts: ExpertsFn, first: int, count: int
) -> torch.Tensor:
    """The experts ``[first, first + count)`` on the slots routed to them, weighted and summed per token."""
    tokens, slots, counts = _group_by_expert(expert_ids, first, count)
    y = experts(x[tokens], counts)
    y = y * weights.reshape(-1)[slots].unsqueeze(-1).to(y.dtype)
    return torch.zeros(x.shape[0], y.shape[-1], dtype=y.dtype, device=y.device).index_add(0, tokens, y)


def _check_ids(expert_ids: torch.Tensor, num_experts: int) -> None:
    if expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= num_experts):
        raise ValueError(
            f"expert_ids hold {int(expert_ids.min())}..{int(expert_ids.max())}, outside [0, num_experts={num_experts})"
        )


# --------------------------------------------------------------------------- all-to-all


def _all_to_all_dispatch(x, expert_ids, weights, experts, num_experts, ep_mesh):
    ep, group = ep_mesh.size(), ep_mesh.get_group()
    local = num_experts // ep
    tokens, slots, counts = _group_by_expert(expert_ids, 0, num_experts)  # every slot, expert-major
    # Every tensor on the tokens' device: NCCL takes device tensors only, and an index must live
    # where the tensor it indexes does (see test_moe.py's default-device check).
    send_counts = torch.tensor(counts, dtype=torch.int64, device=x.device)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # [E] -> [ep, local]: (source, local expert)
    send_splits = send_counts.view(ep, local).sum(1).tolist()
    recv_matrix = recv_counts.view(ep, local)
    recv_splits = recv_matrix.sum(1).tolist()
    received = _AllToAll.apply(x[tokens], recv_splits, send_splits, group)  # source-major
    # source-major (s0: e0 e1 .., s1: e0 e1 ..) -> expert-major (e0: s0 s1 .., e1: ..)
    block = torch.repeat_interleave(torch.arange(ep * local, device=x.device), recv_matrix.flatten())
    expert_major = torch.argsort((block % local) * ep + block // local, stable=True)
    y = experts(received[expert_major], recv_matrix.sum(0).tolist())
    y = torch.empty_like(y).index_copy(0, expert_major, y)  # back to source-major
    returned = _AllToAll.apply(y, send_splits, recv_splits, group)  # in the order sent
    returned = returned * weights.reshape(-1)[slots].unsqueeze(-1).to(returned.dtype)
    zeros = torch.zeros(x.shape[0], returned.shape[-1], dtype=returned.dtype, device=returned.device)
    return zeros.index_add(0, tokens, returned)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with row splits; backward: the same with the splits swapped."""

    @staticmethod
    def forward(ctx, x, recv_splits, send_splits, group):  # noqa: D102
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        recv_splits, send_splits = ctx.splits
        out = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


# --------------------------------------------------------------------------- all-gather


def _all_gather_dispatch(x, expert_ids, weights, experts, num_experts, ep_mesh):
    ep, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    group = ep_mesh.get_group()
    local = num_experts // ep
    size = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    sizes = [torch.empty_like(size) for _ in range(ep)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s) for s in sizes]
    x_all = _AllGatherRows.apply(x, sizes, group, ep_rank)
    w_all = _AllGatherRows.apply(weights, sizes, group, ep_rank)
    ids_all = _all_gather_rows(expert_ids, sizes, group)
    partial = _run_local(x_all, ids_all, w_all, experts, ep_rank * local, local)
    return _ReduceScatterRows.apply(partial, sizes, group, ep_rank)


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _all_gather_rows(t: torch.Tensor, sizes: Sequence[int], group) -> torch.Tensor:
    """Rows of every rank, concatenated in rank order (gloo needs equal sizes: padded)."""
    width = max(sizes)
    parts = [t.new_empty((width, *t.shape[1:])) for _ in sizes]
    dist.all_gather(parts, _padded(t, width), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def _reduce_scatter_rows(t: torch.Tensor, sizes: Sequence[int], rank: int, group) -> torch.Tensor:
    out = t.new_empty((sizes[rank], *t.shape[1:]))
    dist.reduce_scatter(out, list(t.split(list(sizes))), group=group)
    return out


class _AllGatherRows(torch.autograd.Function):
    """Rows of every rank (all-gather); backward: the sum of every rank's gradient of mine."""

    @staticmethod
    def forward(ctx, t, sizes, group, rank):  # noqa: D102
        ctx.sizes, ctx.group, ctx.rank = sizes, group, rank
        return _all_gather_rows(t, sizes, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _reduce_scatter_rows(grad.contiguous(), ctx.sizes, ctx.rank, ctx.group), None, None, None


class _ReduceScatterRows(torch.autograd.Function):
    """My rows of the sum over ranks (reduce-scatter); backward: all-gather."""

    @staticmethod
    def forward(ctx, t, sizes, group, rank):  # noqa: D102
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_rows(t.contiguous(), sizes, rank, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _all_gather_rows(grad, ctx.sizes, ctx.group), None, None, None


# --------------------------------------------------------------------------- tp token split


def _split_sizes(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class _SplitRows(torch.autograd.Function):
    """Replicate -> Shard(0): keep my rows; backward: all-gather the gradient (Shard(0) -> Replicate)."""

    @staticmethod
    def forward(ctx, t, sizes, group, rank):  # noqa: D102
        ctx.sizes, ctx.group = sizes, group
        return t.narrow(0, sum(sizes[:rank]), sizes[rank]).clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _all_gather_rows(grad, ctx.sizes, ctx.group), None, None, None


class _GatherRows(torch.autograd.Function):
    """Shard(0) -> Replicate: all-gather; backward: keep my rows (the gradient is replicated)."""

    @staticmethod
    def forward(ctx, t, sizes, group, rank):  # noqa: D102
        ctx.sizes, ctx.rank = sizes, rank
        return _all_gather_rows(t, sizes, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        sizes, rank = ctx.sizes, ctx.rank
        return grad.narrow(0, sum(sizes[:rank]), sizes[rank]).contiguous(), None, None, None


# --------------------------------------------------------------------------- expert parameters


def expert_shard_dim(shape: tuple[int, ...], *, ep: int, efsdp: int) -> int:
    """The dim FSDP2 shards an expert tensor ``[E, ...]`` on (its ``shard_placement_fn``).

    0 when ``E/ep`` splits evenly over ``efsdp``, else the first later dim that does (every rank
    then holds an equal share), else 0. See [Note: expert checkpoints].

    Example:
        >>> expert_shard_dim((8, 64, 32), ep=2, efsdp=2), expert_shard_dim((8, 64, 32), ep=2, efsdp=8)
        (0, 1)
    """
    if (shape[0] // ep) % efsdp == 0:
        return 0
    for dim in range(1, len(shape)):
        if shape[dim] % efsdp == 0:
            return dim
    return 0


@checked_args(experts=nn.Module, mesh=ParallelMesh, policy=(PrecisionPolicy, None))
def shard_experts(
    experts: nn.Module,
    mesh: ParallelMesh,
    policy: PrecisionPolicy | None = None,
    *,
    params: Sequence[str] | None = None,
) -> nn.Module:
    """Split an experts module over ``ep`` and make it an FSDP2 unit over ``efsdp``; in place.

    Every parameter named (``params``; None = all of the module's own) must be ``[E, ...]`` with
    dim 0 the expert index, identical on every rank: it becomes a ``Shard(0)`` DTensor on
    ``mesh["ep"]`` (ep rank j keeps experts ``[j*E/ep, (j+1)*E/ep)``), then ``fully_shard`` over
    ``mesh.expert_fsdp_mesh`` (dim :func:`expert_shard_dim`) with the gradient divided by
    ``dp_cp`` (every token reaches an expert's gradient once over the world). Call it after TP
    and before the dense FSDP units (``apply_fsdp``), which then leave these parameters alone.
    A world with nothing to shard, reduce or cast leaves the module unwrapped. See
    [Note: expert axes] and [Note: expert checkpoints].

    Returns:
        ``experts``.

    Raises:
        ValueError: a named parameter that is missing, already a DTensor, or whose dim 0 ep
            does not divide.

    Example:
        >>> for layer in model.layers:  # doctest: +SKIP
        ...     shard_experts(layer.feed_forward.experts, pm)
    """
    ep_mesh = mesh["ep"]
    own = dict(experts.named_parameters(recurse=False))
    names = list(own) if params is None else list(params)
    for name in names:
        param = own.get(name)
        if param is None or isinstance(param, DTensor) or param.dim() == 0 or param.shape[0] % ep_mesh.size():
            raise ValueError(
                f"{type(experts).__name__}.{name}: expert parameters must be plain [num_experts, ...] tensors with "
                f"num_experts divisible by ep({ep_mesh.size()}); got "
                f"{None if param is None else (type(param).__name__, tuple(param.shape))}"
            )
    for name, param in [(n, own[n]) for n in names]:
        # plain [E, ...] on every rank -> Shard(0) on ep: rank j keeps experts [j*E/ep, (j+1)*E/ep)
        setattr(experts, name, nn.Parameter(_shard_rows(param.detach(), ep_mesh), requires_grad=param.requires_grad))
    dims = mesh.dims
    needs_cast = policy is not None and (policy.param_dtype is not None or policy.output_dtype is not None)
    if dims.degree("efsdp") * dims.dp_replicate == 1 and dims.degree("dp_cp") == 1 and not needs_cast:
        return experts  # nothing to shard, reduce or cast (as apply_fsdp on a degree-1 axis)
    if policy is not None:
        policy.check_model_dtype(experts)
        mp_policy = policy.to_fsdp2()
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

        mp_policy = TorchMixedPrecisionPolicy()
    efsdp = dims.degree("efsdp")
    fully_shard(
        experts,
        mesh=mesh.expert_fsdp_mesh,
        mp_policy=mp_policy,
        shard_placement_fn=lambda p: Shard(expert_shard_dim(tuple(p.shape), ep=dims.ep, efsdp=efsdp)),
    )
    # Every token reaches each expert's gradient once over the world: average over the
    # data-parallel ranks (dp_cp), not over efsdp. See [Note: custom gradient divide factor].
    set_gradient_divide_factor(experts, float(dims.degree("dp_cp")))
    return experts


def _shard_rows(full: torch.Tensor, ep_mesh: DeviceMesh) -> DTensor:
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    rows = full.shape[0] // ep
    local = full.narrow(0, rank * rows, rows).clone()
    stride = torch.empty(full.shape, device="meta").stride()
    return DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=stride)


# --------------------------------------------------------------------------- router statistics


def router_statistics(
    probs: torch.Tensor, expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One MoE layer's local router statistics: (tokens per expert, probability sums, tokens).

    ``probs`` is ``[T, E]`` (the router's softmax over all experts), ``expert_ids`` ``[T, k]``.
    Counts are per top-k slot (int64, no gradient); the probability sums keep their gradient.
    Sum them over layers and pass them to :func:`load_balancing_loss`.

    Example:
        >>> p = torch.tensor([[0.7, 0.2, 0.1]]); ids = torch.tensor([[0, 1]])
        >>> counts, sums, n = router_statistics(p, ids, 3)
        >>> counts.tolist(), n
        ([1, 1, 0], 1)
    """
    counts = torch.bincount(expert_ids.reshape(-1), minlength=num_experts)
    return counts, probs.sum(0), probs.shape[0]


def load_balancing_loss(
    counts: torch.Tensor,
    prob_sums: torch.Tensor,
    num_tokens: int,
    *,
    mesh: ParallelMesh | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global load-balancing loss ``E * sum_e f_e * P_e`` and the global tokens per expert.

    ``counts`` / ``prob_sums`` (``[E]``, or ``[layers, E]``: leading dims are summed) and
    ``num_tokens`` (token-layers) are this rank's statistics (:func:`router_statistics`); they are
    summed over ``dp_cp`` (the ranks holding different
    router tokens), so every rank returns the value of the global batch. ``f_e = counts_e /
    tokens``, ``P_e = prob_sums_e / tokens`` with ``tokens`` = token-layers of the global batch:
    transformers' ``load_balancing_loss_func`` (layers concatenated, no attention mask) on the
    global batch. See [Note: router statistics over dp_cp].

    Returns:
        ``(loss, counts)``: a scalar with gradient, and the global int64 counts shaped as given.

    Example:
        >>> counts, sums, n = router_statistics(torch.full((4, 2), 0.5), torch.tensor([[0], [1], [0], [1]]), 2)
        >>> load_balancing_loss(counts, sums, n)[0].item()
        1.0
    """
    counts = counts.clone()
    meta = torch.tensor([num_tokens], dtype=torch.int64, device=counts.device)
    if mesh is not None and mesh["dp_cp"].size() > 1:
        group = mesh["dp_cp"].get_group()
        both = torch.cat([counts.to(torch.int64).flatten(), meta])
        dist.all_reduce(both, group=group)
        counts, meta = both[:-1].view(counts.shape), both[-1:]
        prob_sums = _SumOverGroup.apply(prob_sums, group)
    tokens = int(meta.item())
    # Over every layer's tokens first (the layers concatenated), then the product per expert.
    fraction = counts.reshape(-1, counts.shape[-1]).sum(0).to(prob_sums.dtype) / tokens
    mean_prob = prob_sums.reshape(-1, prob_sums.shape[-1]).sum(0) / tokens
    return counts.shape[-1] * torch.sum(fraction * mean_prob), counts
