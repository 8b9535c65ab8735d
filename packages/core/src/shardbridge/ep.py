"""shardbridge.ep: expert parallelism, each token to the ranks holding its experts and back.

:func:`shard_experts` splits an experts module over ``ep`` (and FSDP2 over ``efsdp``, on the dim
:func:`expert_shard_dim` picks); :func:`run_experts` moves the tokens there and back in its
forward (:data:`EPDispatch`: all-to-all or all-gather, :func:`choose_dispatch` picks for
"auto"); :func:`router_statistics` and :func:`load_balancing_loss` read the router. See [Note:
expert dispatch] in ``_ep.py`` and [Note: expert axes] in ``_mesh.py``; docs/concepts/moe.md.
"""

from shardbridge._ep import (
    EPDispatch,
    choose_dispatch,
    expert_shard_dim,
    load_balancing_loss,
    router_statistics,
    run_experts,
    shard_experts,
)

__all__ = [
    "EPDispatch",
    "choose_dispatch",
    "expert_shard_dim",
    "load_balancing_loss",
    "router_statistics",
    "run_experts",
    "shard_experts",
]
