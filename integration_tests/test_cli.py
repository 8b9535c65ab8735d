"""Tier 4: the `shardbridge layout` and `shardbridge ckpt` commands, run as a user runs them.

One command of each kind runs as a process of its own (exit code, stdout, stderr as a user sees
them); the error variants call the same entry point, ``shardbridge.cli._main.main``, in this
process (a process costs ~5-15 s of importing on 2 cores; CI budget, docs/testing.md).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def _cli(*args, cwd=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "shardbridge.cli._main", *args], capture_output=True, text=True, env=env, cwd=cwd
    )


@pytest.fixture
def cli(capsys, monkeypatch):
    """``main(args)`` in this process: (returncode, stdout, stderr) as ``_cli`` returns them."""
    from shardbridge.cli._main import main

    def run(*args, cwd=None):
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 2
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def test_layout_reports_the_dcp_bug_case():
    run = _cli("layout", "--shape", "9,16", "--mesh", "dp_shard=4,tp=2", "--placements", "SS(0,2),S(0)")
    assert run.returncode == 1, run.stderr
    assert "2 coordinate(s) where DCP would describe the layout wrongly" in run.stdout
    # rank 6 = (3, 0) holds nothing, rank 7 = (3, 1) holds row 8 (checked against real FSDP2 on gloo in test_layout)
    assert "coordinate (3, 0) (rank 6): FSDP2 holds nothing of dim 0" in run.stdout
    assert "coordinate (3, 1) (rank 7): FSDP2 holds dim 0 indices [8, 9)" in run.stdout


def test_layout_divisible_case_is_clean(cli):
    run = cli("layout", "--shape", "16,16", "--mesh", "dp_shard=4,tp=2", "--placements", "SS(0,2),S(0)")
    assert run.returncode == 0, run.stderr
    assert "DCP describes every shard of this layout correctly" in run.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shape", "9,x"], "--shape '9,x' is not a list of non-negative integers"),
        (["--shape", "9,16", "--placements", "S(0)"], "--placements has 1 entries but --mesh has 2 axes"),
        (["--shape", "9,16", "--placements", "Q(0),S(0)"], "Q(0)"),
    ],
)
def test_layout_bad_input_is_a_clear_error(cli, args, message):
    base = {"--shape": "9,16", "--mesh": "dp_shard=4,tp=2", "--placements": "SS(0,2),S(0)"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    run = cli("layout", *[x for kv in base.items() for x in kv])
    assert run.returncode == 2
    assert message in run.stderr
    assert "Traceback" not in run.stderr


def _save_plain_checkpoint(root):
    from shardbridge import checkpoint
    from shardbridge.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny(vocab_size=300), seed=3)
    checkpoint.save(checkpoint.step_dir(root, 7), model=model, step=7)
    return model


def test_ckpt_inspect_and_export(tmp_path):
    root = tmp_path / "ckpts"
    model = _save_plain_checkpoint(root)

    run = _cli("ckpt", "inspect", str(root))  # a root resolves to its latest checkpoint
    assert run.returncode == 0, run.stderr
    assert "step-00000007" in run.stdout and "step 7" in run.stdout
    assert "layers.0.feed_forward.gate_proj.weight" in run.stdout

    out = tmp_path / "hf"
    run = _cli("ckpt", "export", str(root / "step-00000007"), str(out), "--max-shard-size", "100KB", "--no-progress")
    assert run.returncode == 0, run.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1  # 100KB shards of a ~0.5 MB model
    exported = {}
    for name in files:
        assert (out / name).stat().st_size <= 100_000 + 300_000  # one tensor may exceed a shard alone
        with safe_open(str(out / name), "pt") as f:
            exported.update({k: f.get_tensor(k) for k in f.keys()})
    # Oracle: torch's own reader of the same checkpoint.
    dcp_to_torch_save(str(root / "step-00000007"), str(tmp_path / "oracle.pt"))
    oracle = torch.load(tmp_path / "oracle.pt", weights_only=True)["model"]
    assert set(exported) == set(oracle)
    assert all(torch.equal(exported[k], oracle[k]) for k in oracle)
    assert torch.equal(exported["output.weight"], model.output.weight.detach())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in oracle.values())


def test_ckpt_on_a_folder_without_checkpoints(cli, tmp_path):
    run = cli("ckpt", "inspect", str(tmp_path))
    assert run.returncode == 2
    assert "neither a shardbridge checkpoint nor a folder holding committed ones" in run.stderr


def _one_line_error(run, *needles):
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert "Traceback" not in run.stderr and len(lines) == 1, run.stderr
    assert all(needle in lines[0] for needle in needles), lines[0]


def test_ckpt_damaged_checkpoint_and_int_dtype_are_one_line_errors(cli, tmp_path):
    root = tmp_path / "ckpts"
    _save_plain_checkpoint(root)
    path = root / "step-00000007"
    _one_line_error(cli("ckpt", "export", str(path), str(tmp_path / "hf"), "--dtype", "int8"), "not a floating dtype")
    assert not (tmp_path / "hf").exists()
    (path / ".metadata").write_bytes(b"garbage")
    _one_line_error(_cli("ckpt", "inspect", str(path)), "shardbridge ckpt inspect: error:", ".metadata")  # a process


def test_demo_out_dot_keeps_the_users_files(cli, tmp_path):
    (tmp_path / "train.py").write_text("my work")
    _one_line_error(cli("demo", "--out", ".", cwd=tmp_path), "is not empty and is not a previous shardbridge demo")
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_launch_bad_config_is_one_line(cli, tmp_path):
    pytest.importorskip("accelerate")
    (tmp_path / "cfg.yaml").write_text("fsdp_config: [\n")
    _one_line_error(cli("launch", "--config_file", str(tmp_path / "cfg.yaml"), "train.py"), "is not valid YAML")
