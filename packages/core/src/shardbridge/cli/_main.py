"""The ``shardbridge`` command line: ``demo``, ``layout``, ``ckpt inspect``, ``ckpt verify``, ``ckpt export``, ``--version``.

This is the edge where command-line text becomes configs; nothing below it reads the
environment or argv.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from collections.abc import Sequence

from torch.distributed.checkpoint.api import CheckpointException

from shardbridge.cli._plugins import load_verb, verb_names

__all__ = ["main", "build_parser", "version_text"]

_DEBUG = "--debug"


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is ONE line naming the fix (not the usage dump); exit 2.

    Subparsers inherit the class (``add_subparsers`` uses ``type(self)``). See [Note: CLI errors].
    """

    def error(self, message: str):  # type: ignore[override]
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


_MAX_SHAPE_DIM = 2**62
_MAX_MESH_COORDINATES = 2**16  # the picture and the mismatch search visit every coordinate


class _VersionAction(argparse.Action):
    """``--version``: one line, unwrapped (argparse's own ``version`` action wraps at the terminal width)."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        print(version_text())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``shardbridge`` command."""
    parser = _OneLineErrorParser(
        prog="shardbridge",
        description="FSDP2 x tensor parallelism with DCP checkpoints that reshard across layouts.",
    )
    parser.add_argument(_DEBUG, action="store_true", help="on an error, also print the traceback")
    parser.add_argument(
        "--version", action=_VersionAction, nargs=0, help="print shardbridge's and torch's versions and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from shardbridge.cli import _demo

    _demo.add_arguments(
        sub.add_parser(
            "demo",
            help="train the reference model on 4 gloo processes, checkpoint, reshard, export",
            description=_demo.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )

    layout = sub.add_parser(
        "layout",
        help="show which rank holds which rows of a DTensor, and where DCP describes it wrongly",
        description="Print who holds what for a global shape, a mesh and placements.",
    )
    layout.add_argument("--shape", required=True, help="global shape, e.g. 9,16")
    layout.add_argument("--mesh", required=True, help="mesh axes and sizes, e.g. dp_shard=4,tp=2")
    layout.add_argument(
        "--placements",
        required=True,
        help="one placement per mesh axis: R, S(d), SS(d,split_factor); e.g. 'SS(0,2),S(0)'",
    )
    layout.add_argument("--dim", type=int, default=0, help="tensor dim to draw (default 0)")
    layout.add_argument(
        "--png",
        metavar="FILE",
        default=None,
        help="also draw the layout as an image: one panel per rank, the blocks of the tensor it holds (dims 0 and "
        "1) and DCP's box (needs matplotlib: the plot extra)",
    )
    layout.set_defaults(func=_run_layout)

    # Verbs adapters contribute (entry-point group "shardbridge.cli"): listed for --help by name
    # only; main() hands "VERB ..." to the adapter before parsing. See [Note: adapter verbs].
    # A dotted name ("ckpt.convert") is an action of a core group: ``shardbridge ckpt convert``.
    for name in verb_names():
        if "." not in name:
            sub.add_parser(name, help=f"contributed by an adapter: shardbridge {name} --help", add_help=False)
    ckpt = sub.add_parser("ckpt", help="inspect or export a shardbridge checkpoint")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    for name in verb_names():
        if name.startswith("ckpt."):
            action = name.split(".", 1)[1]
            ckpt_sub.add_parser(action, help=f"contributed by an adapter: shardbridge ckpt {action} --help", add_help=False)
    inspect_p = ckpt_sub.add_parser("inspect", help="list the tensors, layout and size of a checkpoint")
    inspect_p.add_argument("path", help="a checkpoint directory (or a root: its latest checkpoint)")
    inspect_p.set_defaults(func=_run_ckpt_inspect)
    verify_p = ckpt_sub.add_parser(
        "verify", help="check every file of a checkpoint against its manifest (sizes, xxh3_128 checksums)"
    )
    verify_p.add_argument("path", help="a checkpoint directory (or a root: every checkpoint in it)")
    verify_p.add_argument("--sizes-only", action="store_true", help="skip the checksums (no data is read)")
    verify_p.set_defaults(func=_run_ckpt_verify)
    export_p = ckpt_sub.add_parser("export", help="stream a checkpoint into Hugging Face-style sharded safetensors")
    export_p.add_argument("path", help="a checkpoint directory (or a root: its newest checkpoint that verifies)")
    export_p.add_argument("out_dir", help="output folder: new or empty (created), see --overwrite")
    export_p.add_argument("--max-shard-size", default="2GB", help="e.g. 500MB, 2GB (default 2GB)")
    export_p.add_argument("--dtype", default=None, help="cast floating tensors, e.g. bfloat16")
    export_p.add_argument("--no-progress", action="store_true", help="no progress bar")
    export_p.add_argument(
        "--overwrite",
        action="store_true",
        help="allow a non-empty OUT_DIR: replace the files an export writes (shards, index, recorded JSON files), "
        "keep the others",
    )
    export_p.add_argument(
        "--no-verify", action="store_true", help="skip the checksums (links, sizes and extra files are still checked)"
    )
    export_p.set_defaults(func=_run_ckpt_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardbridge`` console script.

    Every error ends in one line on stderr and exit code 2, never a traceback (``--debug``
    adds it); see [Note: CLI errors] in ``_errors.py``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = argv[:1] == [_DEBUG]
    if debug:
        argv = argv[1:]
    if argv[:1] and argv[0] in verb_names():
        return _run_verb(argv[0], argv[1:], debug=debug)
    if len(argv) >= 2 and ".".join(argv[:2]) in verb_names():  # an adapter's group action: ckpt convert
        return _run_verb(".".join(argv[:2]), argv[2:], debug=debug)
    if _DEBUG in argv:  # also accepted after the command: shardbridge ckpt inspect DIR --debug
        debug, argv = True, [a for a in argv if a != _DEBUG]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"shardbridge {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `shardbridge ckpt inspect DIR | head`: the reader has what it wanted
        _quiet_stdout()
        return 0
    except (Exception, CheckpointException) as err:  # noqa: BLE001 (CheckpointException is a BaseException)
        action = getattr(args, "ckpt_command", None)
        return _report(f"shardbridge {args.command}{f' {action}' if action else ''}", err, args, debug=debug)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail on the closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _report(prog: str, err: BaseException, args: argparse.Namespace | None, *, debug: bool) -> int:
    """Print the error as one line (and the traceback with ``--debug``); the exit code 2."""
    from shardbridge.cli._errors import describe

    if debug:
        traceback.print_exception(err, file=sys.stderr)
    print(f"{prog}: error: {describe(err, args)}", file=sys.stderr)
    return 2


def _run_verb(name: str, argv: list[str], *, debug: bool = False) -> int:
    """An adapter's verb (``shardbridge launch`` is the hf adapter's launcher). See [Note: adapter verbs]."""
    prog = f"shardbridge {name.replace('.', ' ')}"
    try:
        verb = load_verb(name)  # lazy: the core imports no adapter until a verb runs
    except ImportError as err:
        print(f"{prog}: needs an adapter that is not installed ({' '.join(str(err).split())})", file=sys.stderr)
        return 2
    except TypeError as err:  # a broken registration: say so, in one line
        print(f"{prog}: error: {err}; reinstall shardbridge (pip install -e .) or report it", file=sys.stderr)
        return 2
    try:
        return int(verb.main(argv) or 0)
    except ImportError as err:  # the adapter's host framework is missing
        hint = f"; {verb.install_hint}" if verb.install_hint and verb.install_hint not in str(err) else ""
        print(f"{prog}: error: {' '.join(str(err).split())}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (Exception, CheckpointException) as err:  # noqa: BLE001 (one line, see [Note: CLI errors]; a BaseException)
        return _report(prog, err, None, debug=debug)


def _run_layout(args: argparse.Namespace) -> int:
    from shardbridge import layout as _layout

    shape = _parse_shape(args.shape)
    mesh_shape, mesh_names = _layout.parse_mesh(args.mesh)
    if math.prod(mesh_shape) > _MAX_MESH_COORDINATES:
        raise ValueError(
            f"--mesh {args.mesh!r} has {math.prod(mesh_shape)} ranks; `shardbridge layout` draws every coordinate and "
            f"handles up to {_MAX_MESH_COORDINATES}: use a smaller mesh with the same pattern (e.g. fewer dp ranks)"
        )
    placements = _layout.parse_placements(args.placements)
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"--placements has {len(placements)} entries but --mesh has {len(mesh_shape)} axes; "
            "give one placement per mesh axis"
        )
    print(_layout.render_layout(shape, mesh_shape, placements, mesh_dim_names=mesh_names, dim=args.dim))
    if args.png is not None:
        _write_png(args.png, shape, mesh_shape, placements, mesh_names)
    mismatches = _layout.find_dcp_mismatches(shape, mesh_shape, placements)
    if mismatches:
        # render_layout has already explained each one (the '!' rows).
        print(f"\n{len(mismatches)} coordinate(s) where DCP would describe the layout wrongly (exit code 1).")
        return 1
    print("\nDCP describes every shard of this layout correctly.")
    return 0


def _write_png(path: str, shape, mesh_shape, placements, mesh_names) -> None:
    """The layout picture as a PNG (``--png``), or ValueError naming the flag."""
    from shardbridge import layout as _layout

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--png {path!r}: folder {folder!r} does not exist; create it or pass another file")
    try:
        _layout.save_layout_png(path, shape, mesh_shape, placements, mesh_dim_names=mesh_names)
    except ImportError as err:
        raise ValueError(f"--png needs matplotlib, which is not importable: {' '.join(str(err).split())}") from None
    except OSError as err:
        raise ValueError(f"--png {path!r} cannot be written ({err.strerror or err}); pass a writable file") from None
    print(f"\nwrote {path}")


def version_text() -> str:
    """What ``shardbridge --version`` prints: shardbridge's version and where it is imported from, torch's.

    Example:
        >>> version_text()  # doctest: +SKIP
        'shardbridge 0.1.0 (/.../site-packages/shardbridge), torch 2.13.0+cpu, Python 3.11.7'
    """
    import platform

    import torch

    import shardbridge

    where = os.path.dirname(os.path.abspath(shardbridge.__file__))
    return f"shardbridge {shardbridge.__version__} ({where}), torch {torch.__version__}, Python {platform.python_version()}"


def _parse_shape(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.replace("x", ",").split(",")]
    if not all(part.isdigit() for part in parts):
        raise ValueError(f"--shape {text!r} is not a list of non-negative integers; write e.g. 9,16 or 9x16")
    shape = tuple(int(part) for part in parts)
    if any(size > _MAX_SHAPE_DIM for size in shape):
        raise ValueError(f"--shape {text!r} has a dim larger than 2**62, which no tensor can have; pass real sizes")
    return shape


def _run_ckpt_inspect(args: argparse.Namespace) -> int:
    from shardbridge import checkpoint

    print(checkpoint.inspect(_resolve_checkpoint(args.path)))
    return 0


def _run_ckpt_verify(args: argparse.Namespace) -> int:
    """Exit 0 when every file matches; else ValueError (exit 2) naming the first bad file."""
    from shardbridge import checkpoint

    path = args.path
    is_checkpoint, found = _checkpoints_in(path)
    if found and not is_checkpoint:
        paths = found
    elif is_checkpoint or found is None:
        paths = [path]  # verify names what is wrong with it (missing, a file, no manifest ...)
    else:
        raise ValueError(f"{path} is neither a shardbridge checkpoint nor a folder holding committed ones")
    bad = []
    for one in paths:
        report = checkpoint.verify(one, checksums=not args.sizes_only)
        print(report)
        if not report.ok:
            bad.append(report)
    if bad:
        more = f" ({len(bad) - 1} more damaged checkpoint(s) listed above)" if len(bad) > 1 else ""
        raise ValueError(f"checkpoint {str(bad[0].path)!r} is damaged: {bad[0].describe(bad[0].problems[0])}{more}")
    return 0


def _run_ckpt_export(args: argparse.Namespace) -> int:
    """Weights as safetensors, plus the name map and files the saver recorded (see _recorded_export)."""
    import json

    import torch

    from shardbridge import checkpoint
    from shardbridge.checkpoint._export import write_beside
    from shardbridge.checkpoint.storage._destination import check_destination

    dtype = None
    if args.dtype is not None:
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"--dtype {args.dtype!r} is not a torch dtype; use e.g. bfloat16 or float32")
    path, verified = _resolve_export_checkpoint(args.path, checksums=not args.no_verify)
    recorded = _recorded_export(path)
    # the recorded files too: a link refused, an existing file only with --overwrite ([Note: writer destinations])
    check_destination(args.out_dir, list(recorded.get("files", {})), overwrite=args.overwrite)
    result = checkpoint.export_safetensors(
        path,
        args.out_dir,
        max_shard_size=args.max_shard_size,
        name_map=recorded.get("name_map"),
        dtype=dtype,
        progress=not args.no_progress,
        verify=not (verified or args.no_verify),  # a root's pick was just verified: read it once, not twice
        overwrite=args.overwrite,
    )
    for name, content in recorded.get("files", {}).items():  # e.g. an adapter's config.json
        # tmp + rename: never written through a link (and a link there was refused above)
        text = json.dumps(content, indent=2, sort_keys=True) + "\n"
        write_beside(args.out_dir, name, text.encode("utf-8"))
    print(result)
    return 0


def _resolve_export_checkpoint(path: str, *, checksums: bool) -> tuple[str, bool]:
    """The checkpoint to export and whether its checksums were verified here.

    A checkpoint directory is returned as given (export verifies it). For a root: the newest
    checkpoint that verifies, as ``load_latest`` picks (a damaged one is skipped with a line on
    stderr, then the next older one is tried); every one damaged is an error, never a silent
    export of an older step without saying so.
    """
    from shardbridge import checkpoint
    from shardbridge.checkpoint.storage._catalog import newest

    is_checkpoint, found = _checkpoints_in(path)
    if is_checkpoint:
        if not checksums:
            return path, False
        # Before anything reads .metadata (the recorded name map does): a damaged file is named
        # as load names it, not reported as "not DCP metadata".
        report = checkpoint.verify(path, checksums=True)
        if not report.ok:
            more = f" (and {len(report.problems) - 1} more problem(s))" if len(report.problems) > 1 else ""
            raise ValueError(
                f"checkpoint {path!r} is damaged: {report.describe(report.problems[0])}{more}; not exporting it. "
                f"`shardbridge ckpt verify {path}` lists every problem"
            )
        return path, True
    skip: list[str] = []
    while found is not None:
        candidate = newest(path, skip=frozenset(skip))
        if candidate is None:
            break
        report = checkpoint.verify(candidate, checksums=checksums)
        if report.ok:
            return str(candidate), checksums
        print(f"shardbridge ckpt export: skipping {candidate}: {report.describe(report.problems[0])}", file=sys.stderr)
        skip.append(str(candidate))
    if skip:
        raise ValueError(
            f"every checkpoint under {path!r} is damaged (the newest: {str(skip[0])!r}); nothing was exported. "
            f"See what is wrong with `shardbridge ckpt verify {path}`"
        )
    raise ValueError(f"{path} is neither a shardbridge checkpoint nor a folder holding committed ones")


def _recorded_export(path: str) -> dict:
    """What the saver recorded for export in the manifest: ``extra["export"]``, checked.

    [Note: export recorded in a checkpoint]: an adapter that knows its host framework's folder
    format stores ``{"name_map": {fqn: name}, "files": {"config.json": {...}}}`` under the
    manifest's ``extra["export"]``; ``shardbridge ckpt export`` applies the name map and writes
    each file as JSON beside the safetensors, so the core needs no adapter to make a real model
    folder. The checkpoint may be untrusted: file names are plain ``*.json`` names, no paths.
    """
    import os

    from shardbridge import checkpoint

    recorded = (checkpoint.inspect(path).extra or {}).get("export") or {}
    name_map = recorded.get("name_map") if isinstance(recorded, dict) else None
    files = recorded.get("files", {}) if isinstance(recorded, dict) else None
    ok = isinstance(files, dict) and (
        name_map is None or (isinstance(name_map, dict) and all(isinstance(v, str) for v in name_map.values()))
    )
    ok = ok and all(
        isinstance(n, str)
        and n.endswith(".json")
        and os.path.basename(n) == n
        and not n.startswith(".")
        and n != "model.safetensors.index.json"  # the export's own index
        for n in files
    )
    if not ok:
        raise ValueError(
            f"checkpoint {path!r}: manifest extra['export'] is malformed (want {{'name_map': {{fqn: name}}, 'files': "
            "{'name.json': {...}}}); export it with the adapter that wrote it"
        )
    return recorded


def _resolve_checkpoint(path: str) -> str:
    """A checkpoint directory as given, or the latest committed one under a root."""
    from shardbridge import checkpoint

    is_checkpoint, found = _checkpoints_in(path)
    if is_checkpoint:
        return path
    latest = checkpoint.latest(path) if found is not None else None
    if latest is None:
        raise ValueError(f"{path} is neither a shardbridge checkpoint nor a folder holding committed ones")
    return str(latest)


def _checkpoints_in(path: str) -> tuple[bool, list[str] | None]:
    """Whether ``path`` is a checkpoint, and the checkpoints directly below it (None: no directory).

    ``path`` is a path or a URI; nothing is written (no recovery runs).
    """
    from shardbridge.checkpoint.storage._location import locate

    where = locate(path)
    backend = where.backend
    if backend.kind(backend.join(where.path, "shardbridge.json")) == "file":
        return True, [path]
    if backend.kind(where.path) != "dir":
        return False, None
    below = [backend.join(where.path, name) for name in backend.children(where.path) if not name.startswith(".")]
    return False, [str(where.named(c)) for c in below if backend.kind(backend.join(c, "shardbridge.json")) == "file"]


if __name__ == "__main__":
    sys.exit(main())
