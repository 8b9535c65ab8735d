"""The ``shardbridge`` command line: ``demo``, ``layout``, ``ckpt inspect``, ``ckpt export``.

This is the edge where command-line text becomes configs; nothing below it reads the
environment or argv.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``shardbridge`` command."""
    parser = argparse.ArgumentParser(
        prog="shardbridge",
        description="FSDP2 x tensor parallelism with DCP checkpoints that reshard across layouts.",
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
    layout.set_defaults(func=_run_layout)

    # Listed for --help only: main() hands "launch ..." to shardbridge_hf before parsing.
    sub.add_parser(
        "launch",
        help="validate an Accelerate config's fsdp_config.shardbridge block, then accelerate launch "
        '(needs pip install "shardbridge[hf]"; see docs/hf.md)',
    )
    ckpt = sub.add_parser("ckpt", help="inspect or export a shardbridge checkpoint")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    inspect_p = ckpt_sub.add_parser("inspect", help="list the tensors, layout and size of a checkpoint")
    inspect_p.add_argument("path", help="a checkpoint directory (or a root: its latest checkpoint)")
    inspect_p.set_defaults(func=_run_ckpt_inspect)
    export_p = ckpt_sub.add_parser("export", help="stream a checkpoint into Hugging Face-style sharded safetensors")
    export_p.add_argument("path", help="a checkpoint directory (or a root: its latest checkpoint)")
    export_p.add_argument("out_dir", help="output folder (created)")
    export_p.add_argument("--max-shard-size", default="2GB", help="e.g. 500MB, 2GB (default 2GB)")
    export_p.add_argument("--dtype", default=None, help="cast floating tensors, e.g. bfloat16")
    export_p.add_argument("--no-progress", action="store_true", help="no progress bar")
    export_p.set_defaults(func=_run_ckpt_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardbridge`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        return _launch(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as err:
        print(f"shardbridge {args.command}: error: {err}", file=sys.stderr)
        return 2


def _launch(argv: list[str]) -> int:
    """``shardbridge launch``: the hf adapter's launcher (validates, then ``accelerate launch``)."""
    try:
        from shardbridge_hf._launch import main as launch_main  # lazy: the core imports no adapter
    except ImportError as err:
        print(f'shardbridge launch: needs the hf adapter: pip install "shardbridge[hf]" ({err})', file=sys.stderr)
        return 2
    return int(launch_main(argv) or 0)


def _run_layout(args: argparse.Namespace) -> int:
    from shardbridge import _layout, _layout_text

    shape = _parse_shape(args.shape)
    mesh_shape, mesh_names = _layout_text.parse_mesh(args.mesh)
    placements = _layout_text.parse_placements(args.placements)
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"--placements has {len(placements)} entries but --mesh has {len(mesh_shape)} axes; "
            "give one placement per mesh axis"
        )
    print(_layout_text.render_layout(shape, mesh_shape, placements, mesh_dim_names=mesh_names, dim=args.dim))
    mismatches = _layout.find_dcp_mismatches(shape, mesh_shape, placements)
    if mismatches:
        # render_layout has already explained each one (the '!' rows).
        print(f"\n{len(mismatches)} coordinate(s) where DCP would describe the layout wrongly (exit code 1).")
        return 1
    print("\nDCP describes every shard of this layout correctly.")
    return 0


def _parse_shape(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.replace("x", ",").split(",")]
    if not all(part.isdigit() for part in parts):
        raise ValueError(f"--shape {text!r} is not a list of non-negative integers; write e.g. 9,16 or 9x16")
    return tuple(int(part) for part in parts)


def _run_ckpt_inspect(args: argparse.Namespace) -> int:
    from shardbridge import checkpoint

    print(checkpoint.inspect(_resolve_checkpoint(args.path)))
    return 0


def _run_ckpt_export(args: argparse.Namespace) -> int:
    import torch

    from shardbridge import checkpoint

    dtype = None
    if args.dtype is not None:
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"--dtype {args.dtype!r} is not a torch dtype; use e.g. bfloat16 or float32")
    result = checkpoint.export_safetensors(
        _resolve_checkpoint(args.path),
        args.out_dir,
        max_shard_size=args.max_shard_size,
        dtype=dtype,
        progress=not args.no_progress,
    )
    print(result)
    return 0


def _resolve_checkpoint(path: str) -> str:
    """A checkpoint directory as given, or the latest committed one under a root."""
    import os

    from shardbridge import checkpoint

    if os.path.isfile(os.path.join(path, "shardbridge.json")):
        return path
    latest = checkpoint.latest(path) if os.path.isdir(path) else None
    if latest is None:
        raise ValueError(f"{path} is neither a shardbridge checkpoint nor a folder holding committed ones")
    return str(latest)


if __name__ == "__main__":
    sys.exit(main())
