"""The yaml block (``_config``), its validation, and upstream bug 7 (launcher tests: test_hf_launch.py).

Pure tests (no process group), against accelerate's own config loader and launch env code.
"""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("accelerate")

import hf_helpers as H  # noqa: E402
from shardbridge_hf import FP8Config, HFConfig, read_config_file  # noqa: E402

BASE = H.ACCELERATE_YAML
_write = H.write_config


def test_precision_mapping_and_fsdp2_rule():
    cfg = HFConfig.from_block({"precision": {"param_dtype": "bf16", "grad_comm_dtype": "bfloat16"}})
    assert cfg.policy().effective_grad_comm_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="main_grads_dtype"):
        HFConfig.from_block({"precision": {"main_grads_dtype": "bf16"}})
    with pytest.raises(ValueError, match="fp8_params=true with backend torchao"):
        FP8Config(backend="torchao", fp8_params=True)


# -- upstream bug 7: TE amax yaml keys ---------------------------------------------------------


def test_bug7_upstream_amax_keys_never_reach_te_recipe(tmp_path, monkeypatch):
    import accelerate.utils.dataclasses as accelerate_dataclasses
    from accelerate.utils.dataclasses import TERecipeKwargs
    from accelerate.utils.launch import setup_fp8_env

    # TE cannot be imported without CUDA; only its availability probe is replaced, the env
    # reading under test is accelerate's own code.
    monkeypatch.setattr(accelerate_dataclasses, "is_transformer_engine_available", lambda: True)

    # What `accelerate launch` does with fp8_config keys: fp8_config.x -> args.fp8_x -> env.
    args = argparse.Namespace(fp8_backend="te", fp8_amax_history_length=16, fp8_amax_compute_algorithm="max")
    env = setup_fp8_env(args, {})
    assert env["ACCELERATE_FP8_AMAX_HISTORY_LENGTH"] == "16"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    recipe = TERecipeKwargs()
    assert recipe.amax_history_len == 1024 and recipe.amax_compute_algo == "most_recent"  # the yaml is ignored


def test_bug7_fixed_block_and_accelerate_keys_reach_the_recipe(tmp_path):
    block = HFConfig.from_block(
        {"fp8": {"backend": "te", "recipe": "delayed", "amax_history_length": 16, "amax_compute_algo": "max"}}
    )
    from shardbridge_te import recipe_spec  # pure: the TE recipe class and kwargs the te backend builds

    assert recipe_spec(block.fp8.to_recipe()) == (
        "DelayedScaling",
        {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max", "margin": 0},
    )
    # The same keys written in Accelerate's fp8_config section are translated (with a warning).
    text = BASE.replace("backend: torchao, recipe: tensorwise", "backend: te, recipe: delayed")
    # (data-parallel here only to keep the case small; te with tp > 1 is accepted, see below)
    text = text.replace("parallelism_config_tp_size: 2", "parallelism_config_tp_size: 1").replace(
        "parallelism_config_dp_shard_size: 2", "parallelism_config_dp_shard_size: 4"
    ) + ("fp8_config:\n  amax_history_length: 16\n  amax_compute_algorithm: max\n")
    moved = (
        r"fp8_config.amax_history_length -> fsdp_config.shardbridge.fp8.amax_history_length, "
        r"fp8_config.amax_compute_algorithm -> fsdp_config.shardbridge.fp8.amax_compute_algo: .*TERecipeKwargs"
    )
    with pytest.warns(UserWarning, match=moved):
        plan = read_config_file(_write(tmp_path, text))
    assert plan.config.fp8.to_recipe().params == {"amax_history_len": 16, "amax_compute_algo": "max"}


def test_importing_the_package_imports_no_host_framework():
    import subprocess
    import sys

    code = (
        "import sys, shardbridge_hf; print([m for m in ('accelerate', 'transformers', 'torchao') if m in sys.modules])"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_te_backend_with_tp_is_accepted_and_bad_te_recipes_refused():
    from shardbridge import ParallelDims
    from shardbridge_hf import FP8Config, HFConfig

    # TE's own TP modules (te backend convert): tp > 1 is no longer refused.
    cfg = HFConfig(fp8=FP8Config(backend="te", recipe="mxfp8"), dims=ParallelDims(dp_shard=2, tp=2))
    assert (cfg.fp8.to_recipe().backend, cfg.fp8.to_recipe().name) == ("te", "mxfp8")
    with pytest.raises(
        ValueError, match=r"fp8.amax_history_length: TE recipe 'tensorwise'.*remove 'amax_history_length'"
    ):
        HFConfig(fp8=FP8Config(backend="te", amax_history_length=16), dims=ParallelDims(dp_shard=2, tp=2))
    with pytest.raises(ValueError, match=r"not supported by backend 'te'.*\['torchao'\] run 'rowwise'"):
        FP8Config(backend="te", recipe="rowwise")


# -- every fp8 message names the yaml key the user wrote -------------------------------------


@pytest.mark.parametrize(
    ("fp8_block", "named"),
    [
        ({"recipe": "delayed", "amax_history_length": "abc"}, "fp8.amax_history_length='abc' must be an int >= 1"),
        ({"recipe": "delayed", "amax_history_length": 0}, "fp8.amax_history_length=0 must be an int >= 1"),
        ({"recipe": "delayed", "amax_compute_algo": "mean"}, "fp8.amax_compute_algo='mean': choose one of"),
        ({"recipe": "delayed", "fp8_format": "E5M2"}, "fp8.fp8_format='E5M2': choose one of"),
        ({"recipe": "delayed", "margin": -1}, "fp8.margin=-1 must be an int >= 0"),
        ({"recipe": "mxfp8", "amax_history_length": 8}, "fp8.amax_history_length: TE recipe 'mxfp8'"),
    ],
)
def test_te_knob_messages_name_the_yaml_key(fp8_block, named):
    with pytest.raises(ValueError) as e:
        HFConfig.from_block({"fp8": {"backend": "te", **fp8_block}})
    message = str(e.value)
    assert named in message, message
    assert "fp8.params." not in message and "amax_history_len=" not in message and "'amax_history_len'" not in message
    assert "tp=" not in message, message  # the TP degree is not known yet: none is claimed


def test_backend_parameter_written_under_params_keeps_its_name():
    with pytest.raises(ValueError, match=r"fp8.params.amax_history_len='abc' must be an int"):
        HFConfig.from_block({"fp8": {"backend": "te", "recipe": "delayed", "params": {"amax_history_len": "abc"}}})
    with pytest.raises(ValueError, match=r"sets \['amax_history_length'\] both as key\(s\) and in fp8.params"):
        FP8Config(backend="te", recipe="delayed", amax_history_length=16, params={"amax_history_len": 8})


def test_recipe_field_messages_name_the_yaml_key():
    with pytest.raises(ValueError, match=r"^fsdp_config.shardbridge.fp8.recipe='rowwize' is not a known recipe"):
        FP8Config(backend="torchao", recipe="rowwize")
    with pytest.raises(ValueError, match=r"^fsdp_config.shardbridge.fp8.all_gather_fp8='yes' must be"):
        FP8Config(backend="torchao", all_gather_fp8="yes")
    with pytest.raises(ValueError, match=r"^fsdp_config.shardbridge.fp8.params=.*must hold plain values"):
        FP8Config(backend="torchao", params={"kernel": object()})


@pytest.mark.parametrize("block", [{"recipe": "mxfp8"}, {"backend": "none", "recipe": "mxfp8"}])
def test_a_recipe_without_a_backend_is_refused_not_ignored(block):
    """Before: trained in high precision with exit 0 (a new user's review)."""
    with pytest.raises(ValueError, match=r"fp8.recipe='mxfp8' is set but fp8.backend is none .* set fp8.backend"):
        HFConfig.from_block({"fp8": block})
    assert HFConfig.from_block({"fp8": {"backend": "torchao"}}).fp8.to_recipe().name == "tensorwise"
    assert HFConfig.from_block({"fp8": {}}).fp8.to_recipe() is None


def test_unknown_fp8_keys_say_where_they_belong():
    with pytest.raises(
        ValueError, match=r"fp8.amax_history_len: unknown key.*write amax_history_length: instead of amax_history_len:"
    ):
        HFConfig.from_block({"fp8": {"backend": "te", "recipe": "delayed", "amax_history_len": 16}})
    with pytest.raises(
        ValueError,
        match=r"if \['kernel'\] are parameters of the backend's recipe, put them under fp8.params: \{kernel: ...\}",
    ):
        HFConfig.from_block({"fp8": {"backend": "torchao", "recipe": "mxfp8", "kernel": "emulated"}})
