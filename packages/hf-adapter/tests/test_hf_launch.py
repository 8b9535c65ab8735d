"""The launcher (``_launch``): reading an Accelerate config file with a shardbridge block, and ``main``.

Pure tests (no process group), against accelerate's own config loader.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from shardbridge.adapters import install_hint

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
        ("precision: bf16", "precision: fp8", "precision='fp8'"),
        ("precision: bf16", "precison: bf16", "unknown key"),
        ("export_dtype: bfloat16", "export_dtype: int8", "checkpoint.export_dtype"),
    ],
)
def test_bad_config_names_the_key(tmp_path, old, new, match):
    with pytest.raises(ValueError, match=match):
        read_config_file(_write(tmp_path, BASE.replace(old, new)))


def test_cp_size_is_read(tmp_path):
    text = BASE.replace(
        "parallelism_config_dp_shard_size: 2", "parallelism_config_dp_shard_size: 1\n  parallelism_config_cp_size: 2"
    )
    dims = read_config_file(_write(tmp_path, text)).dims
    assert (dims.dp_shard, dims.cp, dims.tp) == (1, 2, 2)


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
        ('mixed_precision: "no"', "mixed_precision: no", r"mixed_precision=False: YAML reads an unquoted no .* 'no' \(quoted\)"),
        ("num_processes: 4", "num_processes: 0", r"num_processes=0 must be an int >= 1"),
        ("num_processes: 4", "num_processes: four", r"num_processes='four' must be an int >= 1"),
        ("use_cpu: true", "use_cpu: maybe", r"use_cpu='maybe' must be true or false"),
        ("num_processes: 4", "num_processes: 4\nnum_machines: 0", r"num_machines=0 must be an int >= 1"),
        ("num_processes: 4", "num_processes: 4\nnum_machines: two", r"num_machines='two' must be an int >= 1"),
        ("num_processes: 4", "num_processes: 4\nmachine_rank: 1", r"machine_rank=1 must be an int in 0\.\.num_machines-1 = 0\.\.0"),
        ("num_processes: 4", "num_processes: 4\nnum_machines: 2\nmachine_rank: -1", r"machine_rank=-1 must be an int in"),
        ("num_processes: 4", "num_processes: 4\nnum_machines: 3", r"num_processes=4 is not divisible by num_machines=3"),
        ("num_processes: 4", "num_processes: 4\nmain_process_port: -1", r"main_process_port=-1 must be a TCP port in 1\.\.65535, or 0 for a free one"),
        ("num_processes: 4", "num_processes: 4\nmain_process_port: 70000", r"main_process_port=70000 must be a TCP port"),
        ("num_processes: 4", "num_processes: 4\nmain_process_port: http", r"main_process_port='http' must be a TCP port"),
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


# -- nothing set on the command line or in the file is silently ignored (issue 11, item 5) -------


@pytest.fixture
def no_launch(monkeypatch):
    """Accelerate's launch_command replaced by a recorder: main validates, nothing starts."""
    import os

    import accelerate.commands.launch as launch

    calls = []
    monkeypatch.setattr(launch, "launch_command", lambda args: calls.append(args))
    monkeypatch.delenv(ENV_VAR, raising=False)
    saved = {k: os.environ.get(k) for k in (ENV_VAR, "ACCELERATE_USE_CPU")}  # main sets them for the workers
    yield calls
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _plain(tmp_path, precision="fp32"):
    """BASE without FP8 (bf16 compute is the question here) and with the given block precision."""
    return _write(tmp_path, BASE.replace("precision: bf16", f"precision: {precision}").replace(_FP8_LINE + "\n", ""))


def test_command_line_mixed_precision_reaches_the_workers(tmp_path, no_launch):
    cfg = _write(tmp_path, BASE.replace("    precision: bf16\n", ""))
    assert main(["--config_file", str(cfg), "--mixed_precision", "bf16", "train.py"]) == 0
    assert len(no_launch) == 1
    import os

    assert HFConfig.from_json(os.environ[ENV_VAR]).policy().param_dtype == torch.bfloat16


def test_command_line_mixed_precision_that_contradicts_the_block_is_refused(tmp_path, no_launch, capsys):
    assert main(["--config_file", str(_plain(tmp_path)), "--mixed_precision", "bf16", "train.py"]) == 2
    assert not no_launch
    assert "--mixed_precision bf16" in capsys.readouterr().err


def test_command_line_num_processes_is_validated_before_any_process_starts(tmp_path, no_launch, capsys):
    assert main(["--config_file", str(_write(tmp_path, BASE)), "--num_processes", "2", "train.py"]) == 2
    assert not no_launch
    err = capsys.readouterr().err
    assert "with --num_processes 2" in err and "do not fit num_processes=2" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num_machines", "3"], "with --num_machines 3: num_processes=4 is not divisible by num_machines=3"),
        (["--num_machines", "2", "--machine_rank", "2"], r"machine_rank=2 must be an int in 0\.\.num_machines-1 = 0\.\.1"),
        (["--machine_rank", "1"], r"machine_rank=1 must be an int in 0\.\.num_machines-1 = 0\.\.0"),
        (["--main_process_port", "70000"], "main_process_port=70000 must be a TCP port"),
    ],
)
def test_command_line_machine_flags_are_validated_before_any_process_starts(tmp_path, no_launch, capsys, flags, message):
    """Each machine of a multi-machine launch gives these on its command line; they are checked as the file's keys."""
    assert main(["--config_file", str(_write(tmp_path, BASE)), *flags, "train.py"]) == 2
    assert not no_launch
    assert re.search(message, capsys.readouterr().err)


def test_command_line_machine_flags_that_fit_are_launched(tmp_path, no_launch):
    flags = ["--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1", "--main_process_port", "29512"]
    assert main(["--config_file", str(_write(tmp_path, BASE)), *flags, "train.py"]) == 0
    (args,) = no_launch
    assert (args.num_machines, args.machine_rank, args.main_process_ip, args.main_process_port) == (2, 1, "10.0.0.1", 29512)


def test_command_line_parallelism_sizes_are_validated(tmp_path, no_launch, capsys):
    argv = ["--config_file", str(_write(tmp_path, BASE)), "--parallelism_config_tp_size", "4", "train.py"]
    assert main(argv) == 2 and not no_launch
    assert "--parallelism_config_tp_size 4" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "field", "value"),
    [
        ("fsdp_activation_checkpointing: true", "activation_checkpointing", True),
        ("fsdp_reshard_after_forward: false", "reshard_after_forward", False),
        ("fsdp_sync_module_states: false", "sync_module_states", False),
        ("fsdp_state_dict_type: SHARDED_STATE_DICT", "reshard_after_forward", "default"),
        ("fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP", "reshard_after_forward", "default"),
        ("fsdp_offload_params: false", "cpu_offload", False),
        ("fsdp_offload_params: true", "cpu_offload", True),
    ],
)
def test_accelerate_fsdp_keys_are_honoured_or_agree(tmp_path, line, field, value):
    cfg = _write(tmp_path, BASE.replace("  fsdp_version: 2\n", f"  fsdp_version: 2\n  {line}\n"))
    assert getattr(read_config_file(cfg).config, field) == value


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("fsdp_sharding_strategy: SHARD_GRAD_OP", r"fsdp_sharding_strategy='SHARD_GRAD_OP' .*FSDP1's"),
        ("fsdp_state_dict_type: FULL_STATE_DICT", r"fsdp_state_dict_type='FULL_STATE_DICT' .*export_pretrained"),
        ("fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer", r"fsdp_transformer_layer_cls_to_wrap=.*wraps"),
        ("fsdp_backward_prefetch: BACKWARD_PRE", r"fsdp_backward_prefetch=.*prefetches"),
        ("fsdp_activation_checkpointing_offload: true", r"fsdp_activation_checkpointing_offload=True"),
        ("fsdp_activation_checkpointing: maybe", r"fsdp_activation_checkpointing='maybe' must be true or false"),
        (
            "fsdp_cpu_ram_efficient_loading: true\n  shardbridge: {sync_module_states: false}",
            "real weights on rank 0 only",
        ),
    ],
)
def test_accelerate_fsdp_keys_without_effect_are_refused_by_name(tmp_path, line, match):
    text = BASE.replace("  fsdp_version: 2\n", f"  fsdp_version: 2\n  {line}\n")
    if "shardbridge: {" in line:  # the block given inline instead
        text = text.replace(
            "  shardbridge:\n    precision: bf16\n" + _FP8_LINE + "\n    checkpoint: {export_dtype: bfloat16}\n", ""
        )
    with pytest.raises(ValueError, match=match):
        read_config_file(_write(tmp_path, text))


def test_accelerate_fsdp_key_that_contradicts_the_block_is_refused(tmp_path):
    text = BASE.replace("  fsdp_version: 2\n", "  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n")
    text = text.replace("    precision: bf16\n", "    precision: bf16\n    reshard_after_forward: false\n")
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward=True and fsdp_config.shardbridge.reshard"):
        read_config_file(_write(tmp_path, text))


def test_command_line_fsdp_flags_are_honoured_and_refused_too(tmp_path, no_launch, capsys):
    import os

    cfg = str(_write(tmp_path, BASE))
    assert main(["--config_file", cfg, "--fsdp_activation_checkpointing", "true", "train.py"]) == 0
    assert HFConfig.from_json(os.environ[ENV_VAR]).activation_checkpointing is True
    assert main(["--config_file", cfg, "--fsdp_offload_params", "true", "train.py"]) == 0
    assert HFConfig.from_json(os.environ[ENV_VAR]).cpu_offload is True
    assert main(["--config_file", cfg, "--fsdp_sharding_strategy", "SHARD_GRAD_OP", "train.py"]) == 2
    assert "fsdp_sharding_strategy='SHARD_GRAD_OP'" in capsys.readouterr().err and len(no_launch) == 2


def test_unsupported_parallelism_axes_are_refused(tmp_path):
    text = BASE.replace(
        "parallelism_config_tp_size: 2", "parallelism_config_tp_size: 2\n  parallelism_config_sp_size: 2"
    )
    with pytest.raises(NotImplementedError, match="parallelism_config_sp_size=2"):
        read_config_file(_write(tmp_path, text))


def test_launch_help_shows_config_file_and_every_option_group(monkeypatch, capsys):
    # As the core CLI runs it: sys.argv is `shardbridge launch --help`, argv the words after the verb.
    monkeypatch.setattr("sys.argv", ["shardbridge", "launch", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for shown in ("--config_file", "--num_processes", "--mixed_precision", "FSDP Arguments", "ParallelismConfig"):
        assert shown in out, shown
    # shardbridge's own part first: its usage, then every key of the block, then Accelerate's options
    from shardbridge_hf import CheckpointConfig, FP8Config, HFConfig

    assert out.startswith("usage: shardbridge launch --config_file"), out[:200]
    accelerate_part = out.index("usage: shardbridge-launch [-h]")
    keys = [f.name for f in dataclasses.fields(HFConfig) if f.name not in ("dims", "use_cpu", "fp8", "checkpoint")]
    keys += [f"fp8.{f.name}" for f in dataclasses.fields(FP8Config)]
    keys += [f"checkpoint.{f.name}" for f in dataclasses.fields(CheckpointConfig)]
    for key in keys:
        assert 0 <= out.find(f"\n  {key} ") < accelerate_part, key
    assert out.index("precision ") < out.index("--num_processes NUM_PROCESSES")


def test_upstream_noise_is_filtered_by_message_and_nothing_else(caplog):
    """[Note: upstream noise in a launch]: torchao's CUDA-kernel lines (no CUDA here) and torch's pytree
    deprecation line for torchao's enums are dropped; other records of the same loggers still print."""
    import enum
    import logging

    from shardbridge_hf._noise import quiet_upstream_noise

    class TorchaoEnum(enum.Enum):
        A = 1

    class OtherEnum(enum.Enum):
        A = 1

    TorchaoEnum.__module__ = "torchao.float8.config"
    quiet_upstream_noise()
    quiet_upstream_noise()  # idempotent: one filter per logger
    assert len(logging.getLogger("torchao").filters) == 1
    deprecated = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
    deprecated += "Calling register_constant() on Enum subclasses is deprecated and will be an error in a future release."
    with caplog.at_level(logging.WARNING):
        ao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
        ao.warning("Failed to load /x/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library")
        ao.warning("Failed to load /x/torchao/_C_cutlass_90a.abi3.so: Could not load this library")
        ao.warning("Failed to load /x/torchao/_C_mine.so: kept")
        ao.warning("something else torchao says")
        pytree.warning(deprecated, TorchaoEnum)
        pytree.warning(deprecated, OtherEnum)
    shown = [r.getMessage() for r in caplog.records]
    if torch.cuda.is_available():  # a GPU machine: a CUDA kernel that does not load concerns the run
        assert sum("_C_mxfp8" in m or "_C_cutlass" in m for m in shown) == 2, shown
    else:
        assert not any("_C_mxfp8" in m or "_C_cutlass" in m for m in shown), shown
    assert any("_C_mine" in m for m in shown) and "something else torchao says" in shown, shown
    assert [m for m in shown if "register_constant" in m] == [deprecated % OtherEnum], shown


def test_launcher_without_the_hf_extra_prints_one_line(monkeypatch, capsys):
    import importlib.metadata

    from shardbridge_hf import _compat

    real = importlib.metadata.version

    def version(name):
        if name == "accelerate":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    _compat.require_accelerate.cache_clear()
    try:
        assert main(["--config_file", "cfg.yaml", "train.py"]) == 2
    finally:
        _compat.require_accelerate.cache_clear()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardbridge-launch: error:"), err
    assert "accelerate is not installed" in err[0], err
    # a command that works without an index hosting shardbridge: the packages, or the extra from a clone
    assert install_hint("hf") in err[0] and 'pip install -e ".[hf]"' in err[0] and '"accelerate<' in err[0], err


def test_without_sync_module_states_rank0_only_loading_is_turned_off(tmp_path, no_launch):
    # accelerate launch's default would make from_pretrained load real weights on rank 0 only.
    cfg = _write(
        tmp_path, BASE.replace("    precision: bf16\n", "    precision: bf16\n    sync_module_states: false\n")
    )
    assert main(["--config_file", str(cfg), "train.py"]) == 0
    assert no_launch[0].fsdp_cpu_ram_efficient_loading == "false"
    assert main(["--config_file", str(_write(tmp_path, BASE)), "train.py"]) == 0
    assert no_launch[1].fsdp_cpu_ram_efficient_loading == "true"  # Accelerate's default: rank 0 loads, we broadcast


def test_fp8_backend_that_cannot_import_here_is_refused_before_any_process_starts(tmp_path, capsys, no_launch):
    """TE on a machine without it: one line naming the key and the install hint, not 4 tracebacks."""
    from shardbridge import fp8

    try:
        fp8.get_backend("te").require_runtime()
        importable = True
    except ImportError:
        importable = False
    text = BASE.replace("backend: torchao, recipe: tensorwise", "backend: te, recipe: delayed")
    text = text.replace("parallelism_config_tp_size: 2", "parallelism_config_tp_size: 1").replace(
        "parallelism_config_dp_shard_size: 2", "parallelism_config_dp_shard_size: 4"
    )
    path = _write(tmp_path, text)
    launched = no_launch
    code = main(["--config_file", str(path), "train.py"])
    if importable:  # a TE machine: the launch goes ahead
        assert code == 0 and launched
    else:
        err = capsys.readouterr().err.strip()
        assert code == 2 and not launched
        assert len(err.splitlines()) == 1, err
        assert "fsdp_config.shardbridge.fp8.backend='te' cannot run here:" in err, err
        assert '"transformer_engine[pytorch]' in err and 'pip install -e ".[te]"' in err, err


# -- generated hostile values: every key of the file x every kind of wrong value (issue 28) -------

_HOSTILE_VALUES = {
    "null": "null",
    "list": "[1, 2]",
    "mapping": "{a: 1}",
    "negative": "-1",
    "huge": "1" + "0" * 30,
    "text": "'%s'" % ("x" * 40),
    "recursive": "&loop [*loop]",
    "float": "2.5",
}
_KEYS = [line.split(":")[0] for line in H.ACCELERATE_YAML.splitlines() if line and not line.startswith(" ")]
_NESTED = [
    ("  fsdp_version: 2", "  fsdp_version"),
    ("    precision: bf16", "    precision"),
    ("  parallelism_config_tp_size: 2", "  parallelism_config_tp_size"),
]


def _hostile_files():
    lines = H.ACCELERATE_YAML.splitlines()
    for key in _KEYS:
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
        end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
        for kind, value in _HOSTILE_VALUES.items():
            yield f"{key}={kind}", "\n".join(lines[:start] + [f"{key}: {value}"] + lines[end:]) + "\n"
    for line, key in _NESTED:
        for kind, value in _HOSTILE_VALUES.items():
            yield f"{key.strip()}={kind}", H.ACCELERATE_YAML.replace(line, f"{key}: {value}")
    for extra in ("num_machines", "main_process_port", "machine_rank"):
        for kind, value in _HOSTILE_VALUES.items():
            yield f"{extra}={kind}", H.ACCELERATE_YAML + f"{extra}: {value}\n"


def test_every_hostile_yaml_value_is_one_line_naming_the_file(tmp_path, capsys):
    """The launcher on each generated file: it starts nothing it was not told, or exits 2 with one
    line naming the file; never a traceback, and never '(unexpected ...)'."""
    tried, refused, accepted = 0, 0, []
    for n, (what, text) in enumerate(_hostile_files()):
        path = tmp_path / f"cfg{n}.yaml"
        path.write_text(text)
        try:
            read_config_file(path)
        except (ValueError, NotImplementedError) as err:
            message = str(err)
            assert str(path) in message and "unexpected" not in message, f"{what}: {message}"
            refused += 1
        else:
            accepted.append(what)
        tried += 1
    # accepted: exactly the values that mean "Accelerate's default" (null), nothing else
    assert accepted == ["mixed_precision=null", "parallelism_config=null", "main_process_port=null"], accepted
    assert tried == refused + len(accepted) and tried >= 100
    print(f"\n[launch yaml] {tried} hostile files: {refused} refused by name, accepted: {accepted}")


def _one_value_fields():
    """(yaml path, field name) of every field of the shardbridge block that takes one value."""
    import types
    import typing

    from shardbridge_hf._config import CheckpointConfig, FP8Config

    scalars = (str, int, float, bool, type(None))
    for prefix, cls in (("", HFConfig), ("fp8.", FP8Config), ("checkpoint.", CheckpointConfig)):
        for name, hint in typing.get_type_hints(cls).items():
            if name in {f.name for f in dataclasses.fields(cls)} and name not in ("dims", "use_cpu"):
                allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
                if all(t in scalars for t in allowed):
                    yield prefix, name


def test_a_list_or_mapping_for_any_one_value_field_is_refused_by_name(tmp_path):
    """Every one-value field of the block (generated from the config classes), given a list, a
    mapping or a recursive list: one error naming the file and the key, never 'unhashable type'."""
    fields = list(_one_value_fields())
    assert len(fields) >= 15, fields  # the generator sees the classes
    tried = 0
    for prefix, name in fields:
        for kind in ("list", "mapping", "recursive"):
            value = _HOSTILE_VALUES[kind]
            # fp8 fields go beside backend: torchao (a recipe field with backend none is refused for that)
            other = "backend: torchao, " if prefix == "fp8." and name != "backend" else ""
            entry = f"{prefix.rstrip('.')}: {{{other}{name}: {value}}}" if prefix else f"{name}: {value}"
            text = H.ACCELERATE_YAML.replace(
                "    fp8: {backend: torchao, recipe: tensorwise}\n    checkpoint: {export_dtype: bfloat16}\n",
                f"    {entry}\n",
            )
            path = tmp_path / f"{prefix}{name}-{kind}.yaml"
            path.write_text(text)
            with pytest.raises(ValueError) as err:
                read_config_file(path)
            message = str(err.value)
            assert str(path) in message and f"{prefix}{name}" in message, f"{prefix}{name}={kind}: {message}"
            assert "unhashable" not in message and "unexpected" not in message, message
            tried += 1
    print(f"\n[launch yaml] {tried} list/mapping values for {len(fields)} one-value fields: all refused by name")


# -- the workers run the script through the plugin (docs/hf.md, "Trainer and TRL") -----------------


def test_workers_run_the_script_through_the_plugin_bootstrap(tmp_path, no_launch):
    from shardbridge_hf._plugin import RUN_MODULE, WORKER_MODULE

    cfg = str(_write(tmp_path, BASE))
    assert main(["--config_file", cfg, "train.py", "--lr", "1e-3"]) == 0
    args = no_launch[0]
    assert (args.training_script, args.module) == (WORKER_MODULE, True)
    assert args.training_script_args == ["train.py", "--lr", "1e-3"]
    # transformers' TrainingArguments read it: without it every CPU worker thinks it is alone
    import os

    assert os.environ["ACCELERATE_USE_CPU"] == "true"
    assert main(["--config_file", cfg, "-m", "pkg.train", "x"]) == 0
    assert no_launch[1].training_script_args == [RUN_MODULE, "pkg.train", "x"] and no_launch[1].module is True


def test_no_python_is_refused_by_name(tmp_path, no_launch, capsys):
    assert main(["--config_file", str(_write(tmp_path, BASE)), "--no_python", "train.sh"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--no_python" in err[0] and "installs the Accelerate plugin" in err[0], err
    assert no_launch == []


@pytest.mark.parametrize("name", ["cpu_fsdp2_tp2.yaml", "cpu_hsdp_tp2.yaml", "cpu_fp8_torchao.yaml"])
def test_plain_accelerate_launch_of_an_example_file_is_refused_naming_shardbridge_launch(name, monkeypatch):
    """[Note: a file for shardbridge launch only]: Accelerate's own launcher and plugin, no process started."""
    from pathlib import Path

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = Path(__file__).resolve().parents[3] / "examples" / "hf" / name
    args, *_ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "train.py"]))
    env = prepare_multi_gpu_env(args)  # what `accelerate launch` hands each worker
    for key in [k for k in list(__import__("os").environ) if k.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("FSDP_"):
            monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"auto wrap policy: shardbridge: launch this file with `shardbridge launch`; accelerate launch drops fsdp_config\.shardbridge"):
        FullyShardedDataParallelPlugin()  # what a worker's Accelerator() builds from that env


def test_shardbridge_launch_accepts_the_guard_and_exports_no_wrap_policy(tmp_path, no_launch):
    from shardbridge_hf._launch import LAUNCH_GUARD

    cfg = _write(tmp_path, BASE.replace("  fsdp_version: 2\n", f'  fsdp_version: 2\n  fsdp_auto_wrap_policy: "{LAUNCH_GUARD}"\n'))
    assert main(["--config_file", str(cfg), "train.py"]) == 0
    args = no_launch[0]
    assert args.fsdp_auto_wrap_policy is None and "fsdp_auto_wrap_policy" in args.nondefault
