"""The launcher (``_launch``): reading an Accelerate config file with a shardbridge block, and ``main``.

Pure tests (no process group), against accelerate's own config loader.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

import hf_helpers as H  # noqa: E402
from shardbridge import ParallelDims  # noqa: E402
from shardbridge_hf import ENV_VAR, HFConfig, main, read_config_file  # noqa: E402

BASE = H.ACCELERATE_YAML
_write = H.write_config


def test_accelerate_own_loader_accepts_the_namespaced_block(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    cluster = load_config_from_file(str(_write(tmp_path, BASE)))
    assert cluster.fsdp_config["shardbridge"]["fp8"]["backend"] == "torchao"


def test_accelerate_rejects_a_top_level_block(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    with pytest.raises(ValueError, match="unknown keys"):
        load_config_from_file(str(_write(tmp_path, BASE + "shardbridge: {precision: bf16}\n")))


def test_read_config_file(tmp_path):
    plan = read_config_file(_write(tmp_path, BASE))
    assert plan.dims == ParallelDims(dp_shard=2, tp=2)
    assert plan.config.policy().param_dtype == torch.bfloat16
    assert plan.config.fp8.backend == "torchao"
    assert plan.config.use_cpu is True
    assert HFConfig.from_json(plan.config.to_json()) == plan.config


@pytest.mark.parametrize(
    "old,new,match",
    [
        ("distributed_type: FSDP", "distributed_type: MULTI_GPU", "set distributed_type: FSDP"),
        ("fsdp_version: 2", "fsdp_version: 1", "set fsdp_version: 2"),
        ('mixed_precision: "no"', "mixed_precision: fp8", "fsdp_config.shardbridge.fp8.backend"),
        ("parallelism_config_tp_size: 2", "parallelism_config_tp_size: 3", "num_processes=4"),
        ("backend: torchao, recipe: tensorwise", "backend: tensorrt", r"fp8.backend='tensorrt'"),
        ("backend: torchao, recipe: tensorwise", "backend: torchao, recipe: rowwise", "recipe: tensorwise"),
        ("precision: bf16", "precision: fp8", "precision='fp8'"),
        ("precision: bf16", "precison: bf16", "unknown key"),
        ("export_dtype: bfloat16", "export_dtype: int8", "checkpoint.export_dtype"),
    ],
)
def test_bad_config_names_the_key(tmp_path, old, new, match):
    with pytest.raises(ValueError, match=match):
        read_config_file(_write(tmp_path, BASE.replace(old, new)))


def test_cp_is_not_implemented(tmp_path):
    text = BASE.replace(
        "parallelism_config_dp_shard_size: 2", "parallelism_config_dp_shard_size: 1\n  parallelism_config_cp_size: 2"
    )
    with pytest.raises(NotImplementedError, match="context parallel"):
        read_config_file(_write(tmp_path, text))


def test_launcher_refuses_before_starting_processes(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    bad = _write(tmp_path, BASE.replace("parallelism_config_tp_size: 2", "parallelism_config_tp_size: 3"))
    assert main(["--config_file", str(bad), "train.py"]) == 2
    assert "parallelism_config" in capsys.readouterr().err


def test_mixed_precision_bf16_maps_to_the_policy(tmp_path):
    text = BASE.replace('mixed_precision: "no"', "mixed_precision: bf16").replace("    precision: bf16\n", "")
    assert read_config_file(_write(tmp_path, text)).config.policy().param_dtype == torch.bfloat16


_FP8_LINE = "    fp8: {backend: torchao, recipe: tensorwise}"


@pytest.mark.parametrize(
    ("old", "new", "match"),
    [
        # the file itself
        (None, "", r"is empty or not a mapping of keys \(got NoneType\)"),
        (None, "a: [1, 2\n  b: }", r"is not valid YAML \(.*line \d+"),
        (None, "- 1\n- 2\n", r"is empty or not a mapping of keys \(got list\)"),
        ("distributed_type: FSDP\n", "", r"Accelerate cannot read it: .*distributed_type"),
        # top-level values
        ('mixed_precision: "no"', "mixed_precision: fp7", r"mixed_precision='fp7' is not allowed; use 'no' or 'bf16'"),
        ("num_processes: 4", "num_processes: 0", r"num_processes=0 must be an int >= 1"),
        ("num_processes: 4", "num_processes: four", r"num_processes='four' must be an int >= 1"),
        ("use_cpu: true", "use_cpu: maybe", r"use_cpu='maybe' must be true or false"),
        # blocks of the wrong type
        (None, H.ACCELERATE_YAML.split("fsdp_config:")[0] + "fsdp_config: 3\n", r"fsdp_config must be a mapping, got 3"),
        (None, H.ACCELERATE_YAML.split("parallelism_config:")[0] + "parallelism_config: hi\n",
         r"parallelism_config must be a mapping, got 'hi'"),
        (None, H.ACCELERATE_YAML + "fp8_config: 7\n", r"fp8_config must be a mapping, got 7"),
        ("  shardbridge:\n    precision: bf16\n" + _FP8_LINE + "\n    checkpoint: {export_dtype: bfloat16}\n",
         "  shardbridge: [1]\n", r"fsdp_config.shardbridge must be a mapping, got \[1\]"),
        # the shardbridge block's values
        ("checkpoint: {export_dtype: bfloat16}", "checkpoint: {max_shard_size: lots}",
         r"fsdp_config.shardbridge.checkpoint.max_shard_size='lots' is not a size > 0"),
        ("checkpoint: {export_dtype: bfloat16}", "checkpoint: {max_shard_size: 0}",
         r"checkpoint.max_shard_size=0 is not a size > 0"),
        (_FP8_LINE, "    tp_plan: {'model.layers.*.mlp.up_proj': colwize}",
         r"fsdp_config.shardbridge.tp_plan\['model.layers.\*.mlp.up_proj'\]='colwize' is not a TP style"),
        (_FP8_LINE, "    tp_plan: {3: colwise}", r"fsdp_config.shardbridge.tp_plan has the key 3"),
    ],
)  # fmt: skip
def test_every_yaml_value_is_validated_naming_its_key(tmp_path, old, new, match):
    text = new if old is None else H.ACCELERATE_YAML.replace(old, new)
    assert old is None or text != H.ACCELERATE_YAML
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_config_file(path)


def test_launcher_prints_one_line_for_a_bad_file(tmp_path, capsys):
    (tmp_path / "cfg.yaml").write_text("")
    assert main(["--config_file", str(tmp_path / "cfg.yaml"), "train.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardbridge-launch: config file") and "is empty" in err[0]
