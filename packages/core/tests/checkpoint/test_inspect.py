"""``inspect``: the summary and table the CLI prints, from metadata only."""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import Mlp, build
from shardbridge import checkpoint as ck
from shardbridge.checkpoint._inspect import format_bytes


def test_inspect_summarises_a_checkpoint(tmp_path):
    model, opt = build(None, fused=True)
    path = ck.save(ck.step_dir(tmp_path, 12), model=model, optimizer=opt, step=12, extra={"note": "x"})
    info = ck.inspect(path)
    assert info.step == 12 and info.world_size == 1 and info.has_optimizer
    names = [t.name for t in info.tensors]
    assert names[0].startswith("model.") and "model.gate_proj.weight" in names
    assert names.index("model.head.weight") < names.index("optim.state.down.weight.exp_avg")
    up = next(t for t in info.tensors if t.name == "model.up.weight")
    assert (up.shape, up.dtype, up.nbytes, up.num_chunks) == ((9, 6), "float32", 216, 1)
    assert info.total_bytes == sum(t.nbytes for t in info.tensors)
    assert info.model_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert info.num_other_entries > 0  # param_groups hyperparameters
    text = str(info)
    assert "step 12, saved by 1 rank(s)" in text
    assert "fused gate_up.weight (tp 1) stored as gate_proj.weight, up_proj.weight" in text
    assert "model.up.weight" in text and "(9, 6)" in text and "216 B" in text
    assert "extra keys: note" in text


def test_inspect_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ck.inspect(tmp_path / "nope")
    ck.save(tmp_path / "m", model=Mlp())
    assert "optimizer: not saved" in str(ck.inspect(tmp_path / "m"))


def test_format_bytes():
    assert format_bytes(12) == "12 B" and format_bytes(2**20 * 3) == "3.0 MiB"
    assert format_bytes(torch.ones(1).element_size()) == "4 B"
