"""Tier 1: the layout picture (layout/_picture.py) against the layout algebra.

The rectangles (`layout_blocks`) must hold exactly the indices the algebra says each rank holds,
for every placement kind (Shard, _StridedShard, Replicate, uneven and empty shards); the PNG must
be written, decode, and show each rank's colour exactly on those indices.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from shardbridge.cli._main import main
from shardbridge.layout import (
    draw_layout,
    fsdp_chunk,
    layout_blocks,
    local_chunk,
    parse_placements,
    rank_color,
    save_layout_png,
)
from shardbridge.layout._picture import BACKGROUND

# (global shape, mesh shape, placements, which algebra function is the truth, drawn dims)
CASES = {
    "shard0_even": ((8, 6), (4,), "S(0)", "dtensor", None),
    "shard1_uneven": ((5, 10), (4,), "S(1)", "dtensor", None),
    "shard0_empty_shards": ((3, 4), (4,), "S(0)", "dtensor", None),
    "fsdp_x_tp_colwise_uneven": ((9, 16), (4, 2), "SS(0,2),S(0)", "fsdp", None),
    "fsdp_x_tp_rowwise": ((6, 10), (2, 2), "S(0),S(1)", "fsdp", None),
    "hsdp_x_tp": ((10, 4), (2, 2, 2), "R,SS(0,2),S(0)", "fsdp", None),
    "replicate_x_shard1": ((6, 10), (2, 2), "R,S(1)", "dtensor", None),
    "strided_left_to_right": ((12, 2), (2, 3), "SS(0,3),S(0)", "dtensor", None),
    "one_dim": ((10,), (3,), "S(0)", "dtensor", None),
    "three_dims_drawn_0_2": ((4, 3, 6), (2, 2), "S(0),S(2)", "dtensor", (0, 2)),
}


def _truth(shape, mesh, placements, actual, coordinate):
    fn = fsdp_chunk if actual == "fsdp" else local_chunk
    return fn(shape, mesh, placements, coordinate)


def _mask(shape, dims, chunk) -> torch.Tensor:
    """Which (row, col) indices a chunk (per-dim intervals) holds, from the algebra alone."""
    row_dim, col_dim = dims
    rows = torch.zeros(shape[row_dim], dtype=torch.bool)
    for a, b in chunk[row_dim]:
        rows[a:b] = True
    cols = torch.ones(1, dtype=torch.bool)
    if col_dim is not None:
        cols = torch.zeros(shape[col_dim], dtype=torch.bool)
        for a, b in chunk[col_dim]:
            cols[a:b] = True
    if any(not iv for iv in chunk):  # holds nothing on some dim: nothing at all
        rows[:] = False
    return rows[:, None] & cols[None, :]


@pytest.mark.parametrize("case", sorted(CASES))
def test_blocks_hold_exactly_what_the_algebra_says(case):
    shape, mesh, text, actual, dims = CASES[case]
    placements = parse_placements(text)
    drawn = dims or ((0, 1) if len(shape) > 1 else (0, None))
    blocks = layout_blocks(shape, mesh, placements, actual=actual, dims=dims)
    n_cols = shape[drawn[1]] if drawn[1] is not None else 1
    for rank, coordinate in enumerate(itertools.product(*(range(s) for s in mesh))):
        painted = torch.zeros(shape[drawn[0]], n_cols, dtype=torch.int64)
        for block in (b for b in blocks if b.coordinate == coordinate):
            assert block.rank == rank
            painted[block.rows[0] : block.rows[1], block.cols[0] : block.cols[1]] += 1
        assert painted.max() <= 1, f"{case}: rank {rank}'s blocks overlap"
        expected = _mask(shape, drawn, _truth(shape, mesh, placements, actual, coordinate))
        assert torch.equal(painted.bool(), expected), f"{case}: rank {rank} {coordinate}"


def test_replicated_blocks_are_held_by_every_replica_and_shards_by_one_rank():
    """Every index is held once per replica: by 2 ranks under (R, S(1)), by exactly 1 under FSDP x TP."""
    for text, mesh, copies in (("R,S(1)", (2, 2), 2), ("SS(0,2),S(0)", (4, 2), 1), ("R,SS(0,2),S(0)", (2, 2, 2), 2)):
        shape = (9, 16)
        count = torch.zeros(shape, dtype=torch.int64)
        for b in layout_blocks(shape, mesh, parse_placements(text)):
            count[b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]] += 1
        assert torch.equal(count, torch.full(shape, copies)), text


def _pixel(image, ax, x, y, dx=0.0, dy=0.0):
    """The RGB of the saved image at data point (x, y) of ``ax``, moved (dx, dy) pixels (y down)."""
    px, py = ax.transData.transform((x, y))
    height = image.shape[0]
    return tuple(float(v) for v in image[int(round(height - py + dy)), int(round(px + dx)), :3])


def _close(a, b, tol=0.02):
    return all(abs(x - y) <= tol for x, y in zip(a, b))


@pytest.mark.parametrize("case", ["fsdp_x_tp_colwise_uneven", "replicate_x_shard1", "shard1_uneven"])
def test_png_paints_each_rank_on_exactly_its_indices(case, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    import matplotlib.image
    import matplotlib.pyplot as plt

    shape, mesh, text, actual, _ = CASES[case]
    placements = parse_placements(text)
    fig, axes = draw_layout(shape, mesh, placements, actual=actual)
    path = tmp_path / "layout.png"
    fig.savefig(path, dpi=100, format="png")  # what save_layout_png does; the axes give pixel positions
    image = matplotlib.image.imread(path)  # decodes, or raises
    assert image.shape[0] > 100 and image.shape[1] > 100
    try:
        for rank, coordinate in enumerate(itertools.product(*(range(s) for s in mesh))):
            held = _mask(shape, (0, 1), _truth(shape, mesh, placements, actual, coordinate))
            for i, j in itertools.product(range(shape[0]), range(shape[1])):
                got = _pixel(image, axes[coordinate], j + 0.5, i + 0.5)
                want = rank_color(rank) if held[i, j] else BACKGROUND
                assert _close(got, want), f"{case}: rank {rank} cell ({i}, {j}) is {got}, want {want}"
    finally:
        plt.close(fig)


def test_save_layout_png_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    import matplotlib.image

    out = save_layout_png(tmp_path / "x.png", (9, 16), (4, 2), parse_placements("SS(0,2),S(0)"))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(out).ndim == 3


def test_cli_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    png = tmp_path / "layout.png"
    argv = ["layout", "--shape", "9,16", "--mesh", "dp_shard=4,tp=2", "--placements", "SS(0,2),S(0)", "--png", str(png)]
    assert main(argv) == 1  # the DCP bug case: exit code 1, as without --png
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_png_errors_are_one_line(tmp_path, capsys, monkeypatch):
    base = ["layout", "--shape", "4,4", "--mesh", "2", "--placements", "S(0)"]
    assert main([*base, "--png", str(tmp_path / "no" / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--png" in err and "does not exist" in err, err
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if the plot extra were absent
    assert main([*base, "--png", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "matplotlib" in err and "[plot]" in err, err
    assert not (tmp_path / "x.png").exists()


def test_too_many_ranks_and_bad_dims_are_refused():
    with pytest.raises(ValueError, match="handles up to 64"):
        draw_layout((128, 4), (128,), parse_placements("S(0)"))
    with pytest.raises(ValueError, match=r"dims=\(0, 0\)"):
        layout_blocks((4, 4), (2,), parse_placements("S(0)"), dims=(0, 0))
