"""shardbridge.adapters: what an adapter builds on; training code does not need it.

The adapter-facing namespace (as torch keeps ``torch.distributed.checkpoint`` public and its
``_`` modules for its own packages): ``shardbridge_te``, ``shardbridge_megatron_fsdp`` and
``shardbridge_hf`` import the core through the user-facing namespaces (``shardbridge``,
``shardbridge.checkpoint``, ``shardbridge.fp8``, ...) and this one, nothing else but
``shardbridge._compat`` (the shared home of torch's private names). The names here are as
stable as any public name; each lives in a private module of the core and is public only here.

- Checkpoints a framework's own way. A :class:`~shardbridge.checkpoint.StateDictProvider` may
  hand the core :class:`LocalChunks` (the boxes of one stored tensor this rank holds, [Note:
  state-dict providers]), name fused components with :func:`component_fqn`, and keep tensors
  only it can place with :func:`mark_rank_local` ([Note: rank-local tensors]).
- Reading DCP directories shardbridge did not write, with no code run from them ([Note:
  untrusted checkpoints]): :func:`read_metadata`, :class:`TrustedReader`, :func:`check_no_links`,
  and :func:`raise_untrusted` around ``dcp.load`` (a refusal comes out as itself).
- Writing other formats as ``export_safetensors`` does ([Note: writer destinations]):
  :func:`check_destination` before anything is written, :func:`write_file` for each file;
  :func:`parse_size` reads ``"2GB"``-style sizes.
- Patching a host framework ([Note: patch plans]): :class:`PatchPlan`, :class:`Patch`,
  :func:`patch_attr`, :func:`patch_item`, :func:`fmt_version`.
- Optional dependencies ([Note: install hints], [Note: version policy]): :func:`install_hint`
  for the ImportError of a missing extra, :func:`warn_if_untested` for a host framework outside
  its checked range (it warns with ``shardbridge.UntestedVersionWarning``).
- Input checks worded as the core's ([Note: argument checks]): :func:`checked_args` on an
  entry point, :func:`did_you_mean` for an unknown config key.
- CLI verbs ([Note: adapter verbs]): a :class:`Verb` registered in the ``shardbridge.cli``
  entry-point group.
"""

from shardbridge._checks import checked_args, did_you_mean
from shardbridge._extras import install_hint, warn_if_untested
from shardbridge._patching import Patch, PatchPlan, fmt_version, patch_attr, patch_item
from shardbridge.checkpoint._export import parse_size
from shardbridge.checkpoint.state._chunks import LocalChunks
from shardbridge.checkpoint.state._provider import mark_rank_local
from shardbridge.checkpoint.state._state import component_fqn
from shardbridge.checkpoint.storage._destination import check_destination, write_file
from shardbridge.checkpoint.storage._reader import TrustedReader
from shardbridge.checkpoint.storage._trust import check_no_links, raise_untrusted, read_metadata
from shardbridge.cli._plugins import Verb

__all__ = [
    # -- checkpoints a framework's own way -------------------------------------------------
    "LocalChunks",
    "component_fqn",
    "mark_rank_local",
    # -- reading checkpoints shardbridge did not write -------------------------------------
    "TrustedReader",
    "check_no_links",
    "raise_untrusted",
    "read_metadata",
    # -- writing other formats -------------------------------------------------------------
    "check_destination",
    "parse_size",
    "write_file",
    # -- patching a host framework ---------------------------------------------------------
    "Patch",
    "PatchPlan",
    "fmt_version",
    "patch_attr",
    "patch_item",
    # -- input checks, optional dependencies, CLI verbs ------------------------------------
    "checked_args",
    "did_you_mean",
    "Verb",
    "install_hint",
    "warn_if_untested",
]
