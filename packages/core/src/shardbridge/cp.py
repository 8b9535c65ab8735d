"""shardbridge.cp: context parallelism, the sequence split over the ``cp`` axis and what spans it.

Split each batch with :func:`cp_split` (the load-balanced head-tail split; :func:`cp_unsplit` is
its inverse, :func:`check_cp_seq_len` refuses lengths it cannot cut), rotate with the global
:func:`cp_positions`, attend with :func:`cp_attention` (K/V all-gathered or passed around the
ring over ``cp``) and reduce the loss with :func:`cp_cross_entropy` (the token mean over
``dp_cp``). See [Note: load-balanced sequence split] and [Note: all-gather-KV attention] in
``_cp.py``; docs/concepts/context-parallel.md.
"""

from shardbridge._cp import (
    check_cp_seq_len,
    cp_attention,
    cp_cross_entropy,
    cp_positions,
    cp_split,
    cp_unsplit,
)

__all__ = ["check_cp_seq_len", "cp_attention", "cp_cross_entropy", "cp_positions", "cp_split", "cp_unsplit"]
