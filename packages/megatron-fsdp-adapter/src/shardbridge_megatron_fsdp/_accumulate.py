"""Gradient accumulation on Megatron-FSDP: ``microbatches`` and the guard ``shard_model`` installs.

[Note: accumulation under auto-sync]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``shard_model`` builds the model with ``sync_model_each_microbatch=True`` ("auto-sync"): every
backward reduces the gradients completely and attaches them to the optimizer's parameters,
so ``loss.backward(); optimizer.step()`` needs nothing else and gradient clipping between the
two sees reduced gradients. A second backward before ``optimizer.zero_grad()`` accumulates
into the gradient buffer that already holds reduced values and reduces it IN PLACE again
(upstream warns in ``set_model_auto_sync``). Measured in megatron-fsdp 0.6.1 with two
microbatches: HSDP outer "no_shard" ~1.5x, HSDP outer "optim" ~1.2-1.5x, strategy "optim"
~0.7x the true gradient (``test_gradient_accumulation_needs_no_sync``). Plain FSDP
"no_shard", "optim_grads" and "optim_grads_params" happen to come out right.

So in the wrong configurations ``shard_model`` installs a guard: a backward that starts while
the previous backward's reduced gradients are still attached (no ``zero_grad`` since) and
auto-sync is on raises a RuntimeError naming ``microbatches``. ``microbatches(model, n)``
runs upstream's exact recipe (auto-sync off; ``no_sync()`` for all but the last backward;
``is_last_microbatch = True`` for the last; ``finish_grad_sync()`` after it) and restores
auto-sync, so gradients are reduced and attached when the loop ends, as after one backward.

The guard's state is the gradient attachment itself (``param_and_grad_buffer.dist_main_grad``:
set by ``finish_grad_sync`` for every parameter on every rank, empty shards included;
dereferenced by ``zero_grad_buffer``, which the wrapped ``optimizer.zero_grad()`` calls). So it
is the same on every rank (all ranks raise, none hangs); a skipped step (``backward;
zero_grad; backward``) and two forwards into one backward pass are allowed; a forgotten
``zero_grad`` between steps raises too. The check runs first in the backward (on a view of
the model's output, before upstream's pre-backward hooks), so an error leaves the model usable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from shardbridge._compat import tree_map
from torch import nn

from shardbridge_megatron_fsdp._compat import attached_main_grads, has_local_data

__all__ = ["microbatches"]

_GUARD_ATTR = "_shardbridge_accumulation_guard"


def _is_megatron_fsdp(model: object) -> bool:
    return hasattr(model, "set_model_auto_sync") and hasattr(model, "param_and_grad_buffer")


def microbatches(model: nn.Module, n: int) -> Iterator[contextlib.AbstractContextManager[None]]:
    """Contexts for ``n`` forward/backward passes accumulated into one optimizer step.

    Exact in every strategy and HSDP mode (the single-process gradient of the whole batch,
    when each microbatch's loss is divided by ``n`` and microbatches have equal size). Run each
    microbatch's forward AND backward inside its context; after the last one the gradients
    are reduced and attached (clip them, then ``optimizer.step()``). See
    [Note: accumulation under auto-sync] for why the plain loop is refused.

    Args:
        model: a model returned by :func:`~shardbridge_megatron_fsdp.shard_model` (a
            ``MegatronFSDP`` module).
        n: how many microbatches (>= 1).

    Yields:
        One context manager per microbatch, ``n`` in all.

    Raises:
        ValueError: ``model`` is not a Megatron-FSDP module, or ``n`` < 1.

    Example:
        >>> for batch, ctx in zip(batches, microbatches(model, len(batches))):  # doctest: +SKIP
        ...     with ctx:
        ...         (loss_fn(model(batch.x), batch.y) / len(batches)).backward()
        >>> optimizer.step()  # doctest: +SKIP
        >>> optimizer.zero_grad()  # doctest: +SKIP
    """
    if not _is_megatron_fsdp(model):
        raise ValueError(
            f"model is a {type(model).__name__}, not a Megatron-FSDP module; pass the model returned by "
            "shard_model(...)"
        )
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an int >= 1 (the number of microbatches per optimizer step)")
    return _microbatches(model, n)


def _microbatches(model: Any, n: int) -> Iterator[contextlib.AbstractContextManager[None]]:
    auto = model.model_auto_sync
    # Assigned, not set_model_auto_sync(): that logs upstream's in-place-reduction warning on
    # every call with True, which this recipe is the answer to.
    model.model_auto_sync = False
    try:
        for _ in range(n - 1):
            yield model.no_sync()
        yield _last_microbatch(model)
    finally:
        model.model_auto_sync = auto
        model.is_last_microbatch = True


@contextlib.contextmanager
def _last_microbatch(model: Any) -> Iterator[None]:
    # is_last_microbatch defaults to False upstream: without it the (outer) reduction of the
    # last backward would not run with auto-sync off.
    model.is_last_microbatch = True
    yield
    # Upstream leaves this to the wrapped optimizer.step() when auto-sync is off; doing it here
    # lets auto-sync come back on (the step then skips it) and attaches the gradients now.
    model.finish_grad_sync()


def accumulation_is_wrong(strategy: str, outer_strategy: str | None) -> bool:
    """Whether several backwards per step under auto-sync give wrong gradients (measured)."""
    # no_shard all-reduces reduced(g1) + g2 pre-scaled by 1/dp: mean(g1) + mean(g2), right;
    # "optim" reduce-scatters a buffer whose other ranks' regions still hold unreduced g1.
    return outer_strategy is not None or strategy == "optim"


def install_guard(model: nn.Module, strategy: str, outer_strategy: str | None) -> None:
    """Raise on a backward that would accumulate onto reduced gradients under auto-sync."""
    describe = f"strategy={strategy!r}" + (f", outer_strategy={outer_strategy!r} (HSDP)" if outer_strategy else "")
    attached = attached_main_grads(model)

    def check(_grads: object) -> None:
        if not model.model_auto_sync:
            return  # upstream's manual path (microbatches, or no_sync by hand)
        if any(has_local_data(g) for g in attached.values()):
            raise RuntimeError(
                f"a second backward before optimizer.zero_grad() with Megatron-FSDP {describe} would silently "
                "corrupt the gradients (megatron-fsdp reduces the gradient buffer in place after every "
                "backward, over the already-reduced previous ones). For gradient accumulation run each "
                "microbatch in a context of shardbridge_megatron_fsdp.microbatches(model, n): "
                "`for batch, ctx in zip(batches, microbatches(model, len(batches))): with ctx: "
                "loss_fn(model(batch)).div(len(batches)).backward()`; otherwise call optimizer.zero_grad() "
                "(or model.zero_grad_buffer()) before the next backward"
            )

    def hook(_module: nn.Module, _args: object, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        # A fresh view: its gradient is computed before the output's, where upstream's
        # pre-backward hooks sit, so the check runs before any of them.
        output = tree_map(lambda t: t.view_as(t) if isinstance(t, torch.Tensor) and t.requires_grad else t, output)
        leaves = [t for t in _tensors(output) if t.requires_grad]
        if leaves:
            torch.autograd.graph.register_multi_grad_hook(leaves, check, mode="any")
        return output

    old = getattr(model, _GUARD_ATTR, None)
    if old is not None:
        old.remove()
    setattr(model, _GUARD_ATTR, model.register_forward_hook(hook))


def _tensors(tree: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    tree_map(lambda t: out.append(t) if isinstance(t, torch.Tensor) else None, tree)
    return out
