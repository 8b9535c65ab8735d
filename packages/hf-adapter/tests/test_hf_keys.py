"""Every key of an Accelerate config file is honoured or refused by name (``_keys.py``, ``_config.py``; issue 38).

[Note: what accelerate launch does with a config file's keys] in ``_keys.py``: a key Accelerate's
parser does not define is dropped without a word (``parallelism_config_tp_sise: 2`` trained
dp_shard=4 without TP, exit 0). The generated test misspells every key a user writes by one
edit -- the shardbridge block (``HFConfig``, ``fp8``, ``checkpoint``, the ``precision`` mapping:
read from the config classes), ``parallelism_config``, ``fsdp_config``, ``fp8_config``,
``dynamo_config`` (read from Accelerate's own launch parser) and the top level (its
``ClusterConfig``) -- and asserts each file is refused naming the misspelled key and offering the
key meant. CI runs one misspelling per key; ``SHARDBRIDGE_TRUST=all`` (``nox -s trust``) every
deletion, adjacent swap, and a substitution and an insertion at every position.
"""

from __future__ import annotations

import dataclasses
import os
import re
import string
from collections.abc import Callable

import pytest

pytest.importorskip("accelerate")

import hf_helpers as H  # noqa: E402
from shardbridge_hf import BLOCK_KEY, HFConfig, main, read_config_file  # noqa: E402
from shardbridge_hf._config import CheckpointConfig, FP8Config  # noqa: E402
from shardbridge_hf._keys import FP8_MOVED, launch_args  # noqa: E402

FULL = os.environ.get("SHARDBRIDGE_TRUST") == "all"

BASE = H.ACCELERATE_YAML
_BLOCK_LINES = "    precision: bf16\n    fp8: {backend: torchao, recipe: tensorwise}\n    checkpoint: {export_dtype: bfloat16}\n"
assert _BLOCK_LINES in BASE


def _top_level_keys() -> list[str]:
    from accelerate.commands.config.config_args import ClusterConfig

    return [f.name for f in dataclasses.fields(ClusterConfig)]


def _sections() -> dict[str, tuple[list[str], Callable[[str], str]]]:
    """section -> (the keys a user writes there, a function placing one key into the base file)."""

    def block(key: str) -> str:
        return BASE.replace(_BLOCK_LINES, _BLOCK_LINES + f"    {key}: 1\n")

    def sub(name: str) -> Callable[[str], str]:
        old = {"fp8": "    fp8: {backend: torchao, recipe: tensorwise}\n", "checkpoint": "    checkpoint: {export_dtype: bfloat16}\n"}
        return lambda key: BASE.replace(old[name], old[name].replace("}\n", f", {key}: 1}}\n"))

    def precision(key: str) -> str:
        return BASE.replace("    precision: bf16\n", f"    precision: {{param_dtype: bf16, {key}: null}}\n")

    def parallelism(key: str) -> str:
        return BASE.replace("  parallelism_config_tp_size: 2\n", f"  parallelism_config_tp_size: 2\n  {key}: 1\n")

    def fsdp(key: str) -> str:
        return BASE.replace("  fsdp_version: 2\n", f"  fsdp_version: 2\n  {key}: true\n")

    def top(key: str) -> str:
        return BASE + f"{key}: 1\n"

    def fp8_config(key: str) -> str:
        return BASE + f"fp8_config:\n  {key}: 1\n"

    def dynamo(key: str) -> str:
        return BASE + f"dynamo_config:\n  {key}: 'NO'\n"

    args = launch_args()
    hf = [f.name for f in dataclasses.fields(HFConfig) if f.name not in ("dims", "use_cpu")]
    return {
        BLOCK_KEY: (hf, block),
        f"{BLOCK_KEY}.fp8": ([f.name for f in dataclasses.fields(FP8Config)], sub("fp8")),
        f"{BLOCK_KEY}.checkpoint": ([f.name for f in dataclasses.fields(CheckpointConfig)], sub("checkpoint")),
        f"{BLOCK_KEY}.precision": (list(HFConfig.PRECISION_FIELDS), precision),
        "parallelism_config": (sorted(k for k in args if k.startswith("parallelism_config_")), parallelism),
        "fsdp_config": (sorted(k for k in args if k.startswith("fsdp_")) + ["shardbridge"], fsdp),
        "fp8_config": (sorted({k.removeprefix("fp8_") for k in args if k.startswith("fp8_")} | set(FP8_MOVED)), fp8_config),
        "dynamo_config": (sorted(k for k in args if k.startswith("dynamo_")), dynamo),
        "top level": (_top_level_keys(), top),
    }


def _misspellings(key: str) -> list[str]:
    """Keys one edit away from ``key``: CI one (an adjacent swap in the middle, else a deletion); all edit kinds with FULL."""
    middle = len(key) // 2
    if not FULL:
        swapped = key[: middle - 1] + key[middle] + key[middle - 1] + key[middle + 1 :]
        return [swapped if swapped != key else key[:middle] + key[middle + 1 :]]
    out = {key[:i] + key[i + 1 :] for i in range(len(key))}  # deletions
    out |= {key[:i] + key[i + 1] + key[i] + key[i + 2 :] for i in range(len(key) - 1)}  # adjacent swaps
    letters = string.ascii_lowercase
    out |= {key[:i] + letters[(letters.find(c) + 1) % 26] + key[i + 1 :] for i, c in enumerate(key) if c in letters}
    out |= {key[:i] + "e" + key[i:] for i in range(len(key) + 1)}  # insertions
    return sorted(out - {key})


def _cases() -> list[tuple[str, str, str, str]]:
    """(section, key meant, misspelling, file text) for every generated misspelling that names no other key."""
    cases = []
    sections = _sections()
    block_fields = set(sections[BLOCK_KEY][0])
    for section, (keys, place) in sections.items():
        # a misspelling that is another key of its section is no misspelling; parallelism_config_ep_size
        # and the block's own keys under fsdp_config have rules of their own (tested in test_hf_launch.py)
        taken = set(keys) | {"parallelism_config_ep_size"} | (block_fields if section == "fsdp_config" else set())
        if section == "fsdp_config":
            taken |= {k.removeprefix("fsdp_") for k in keys}
        for key in keys:
            for typo in _misspellings(key):
                if typo and typo not in taken and typo.isidentifier():
                    cases.append((section, key, typo, place(typo)))
    return cases


def test_every_key_misspelled_by_one_edit_is_refused_naming_the_key_meant(tmp_path):
    tried, refused, silent, others = 0, 0, [], []
    path = tmp_path / "cfg.yaml"
    for section, key, typo, text in _cases():
        path.write_text(text)
        tried += 1
        try:
            read_config_file(path)
        except (ValueError, NotImplementedError) as err:
            message = " ".join(str(err).split())
            meant = re.search(r"did you mean (.*?)\?", message)
            if typo in message and meant and repr(key) in meant.group(1):
                refused += 1
            else:
                others.append(f"{section}: {typo} (meant {key}): {message[:300]}")
        else:
            silent.append(f"{section}: {typo} (meant {key})")
    assert not silent, f"{len(silent)} misspelled key(s) accepted without a word: {silent[:10]}"
    assert not others, f"{len(others)} refused without naming the key meant:\n" + "\n".join(others[:10])
    assert tried >= (2000 if FULL else 60), tried
    # hung: none can be -- read_config_file starts no process (the launcher validates before launching)
    print(f"\n[key typos] {tried} misspelled keys: {refused} refused by name with the key meant, 0 silent")


# -- the cases of issue 38, through the launcher -------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    """Accelerate's launch_command replaced by a recorder: main validates, nothing starts."""
    import accelerate.commands.launch as launch
    from shardbridge_hf import ENV_VAR

    calls = []
    monkeypatch.setattr(launch, "launch_command", lambda args: calls.append(args))
    monkeypatch.delenv(ENV_VAR, raising=False)
    return calls


def test_a_misspelled_parallelism_key_never_launches(tmp_path, no_launch, capsys):
    """parallelism_config_tp_sise: 2 without a dp_shard key: exit 0 after training dp_shard=4 without TP."""
    text = BASE.replace("  parallelism_config_dp_shard_size: 2\n", "").replace("tp_size: 2", "tp_sise: 2")
    assert main(["--config_file", str(H.write_config(tmp_path, text)), "train.py"]) == 2 and not no_launch
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "parallelism_config.parallelism_config_tp_sise: not a key Accelerate reads" in err[0]
    assert err[0].endswith("did you mean 'parallelism_config_tp_size'?"), err[0]


@pytest.mark.parametrize(
    ("old", "new", "match"),
    [
        # with dp_shard in the file the error talked about tp(1), never the key
        ("parallelism_config_tp_size: 2", "parallelism_config_tp_sise: 2", r"parallelism_config_tp_sise: .*did you mean 'parallelism_config_tp_size'"),
        ("parallelism_config_tp_size: 2", "tp_size: 2", r"parallelism_config.tp_size: .*did you mean 'parallelism_config_tp_size'\?$"),
        ("parallelism_config_tp_size: 2", "parallelism_config_tp_size: 2\n  parallelism_config_cp_comm_strategy: alltoall",
         r"parallelism_config_cp_comm_strategy='alltoall' cannot take effect under shardbridge .*all-gathers K/V.*set 'allgather'$"),
        ("parallelism_config_tp_size: 2", "parallelism_config_tp_size: 2\n  parallelism_config_sp_attn_implementation: flash_attention_2",
         r"parallelism_config_sp_attn_implementation='flash_attention_2' cannot take effect .*sequence parallelism"),
        ("  shardbridge:", "  shardbrige:", r"fsdp_config.shardbrige: not a key Accelerate reads.*did you mean 'shardbridge'\?$"),
        ("fsdp_version: 2", "fsdp_version: 2\n  precision: bf16", r"fsdp_config.precision: .*move it to fsdp_config.shardbridge.precision$"),
        ("num_processes: 4", "num_process: 4", r"num_process: not a key of an Accelerate config file; did you mean 'num_processes'\?"),
        ("num_processes: 4", "num_processes: 4\ndowncast_bf16: true", r"downcast_bf16=True has no effect: only Accelerate's TPU launcher"),
        ("num_processes: 4", "num_processes: 4\nfp8_config: {backend: TE}", r"fp8_config.backend='TE' cannot take effect .*fsdp_config.shardbridge.fp8"),
        ("num_processes: 4", "num_processes: 4\nfp8_config: {amax_histroy_length: 16}", r"fp8_config.amax_histroy_length: .*did you mean 'amax_history_length'\?"),
        ("num_processes: 4", "num_processes: 4\ndynamo_config: {dynamo_backend: INDUCTOR}", r"dynamo_config=.*does not torch.compile the model"),
        ("num_processes: 4", "num_processes: 4\ndeepspeed_config: {zero_stage: 3}", r"deepspeed_config \(zero_stage\) has no effect: only Accelerate's deepspeed"),
        ("num_processes: 4", "num_processes: 4\nmegatron_lm_config: {megatron_lm_tp_degree: 2}", r"megatron_lm_config .* has no effect"),
        # a misfit offers only what can fit (it suggested dp_shard=-1, which cannot fix tp=3 on 4 processes)
        ("parallelism_config_tp_size: 2", "parallelism_config_tp_size: 3",
         r"parallelism_config_dp_shard_size\(2\) \* parallelism_config_tp_size\(3\) = 6 != 4; no dp_shard fits: set "
         r"parallelism_config_tp_size to one of \[1, 2, 4\], or num_processes to a multiple of 3"),
        ("parallelism_config_dp_shard_size: 2", "parallelism_config_dp_shard_size: 1",
         r"= 2 != 4; set parallelism_config_dp_shard_size: 2 \(or remove it: dp_shard takes the rest\)$"),
    ],
)  # fmt: skip
def test_keys_that_would_be_dropped_or_cannot_fit_are_refused_by_name(tmp_path, old, new, match):
    assert old in BASE
    with pytest.raises(ValueError, match=match) as info:
        read_config_file(H.write_config(tmp_path, BASE.replace(old, new, 1)))
    assert "dp_shard=-1" not in str(info.value)


def test_keys_at_the_values_shardbridge_runs_are_accepted(tmp_path):
    """Not over-eager: what the file may say and shardbridge does anyway."""
    extra = (
        "  parallelism_config_tp_size: 2\n  parallelism_config_cp_comm_strategy: allgather\n"
        "  parallelism_config_cp_backend: torch\n  parallelism_config_sp_size: 1\n"
    )
    text = BASE.replace("  parallelism_config_tp_size: 2\n", extra) + "dynamo_config: {dynamo_backend: 'NO'}\ndebug: false\n"
    assert read_config_file(H.write_config(tmp_path, text)).dims.tp == 2


def test_what_accelerate_itself_writes_is_accepted(tmp_path):
    """A file written by Accelerate's own ClusterConfig, and the keys `accelerate config` puts in every file
    (downcast_bf16: 'no', tpu_env: [], main_training_function, rdzv_backend, ...), are not refused."""
    from accelerate.commands.config.config_args import ClusterConfig

    path = tmp_path / "written.yaml"
    ClusterConfig(
        compute_environment="LOCAL_MACHINE", distributed_type="FSDP", mixed_precision="no", use_cpu=True, debug=False,
        num_processes=4, fsdp_config={"fsdp_version": 2, "shardbridge": {"precision": "fp32"}},
        parallelism_config={"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2},
    ).to_yaml_file(str(path))  # fmt: skip
    assert read_config_file(path).dims.tp == 2
    typical = "downcast_bf16: 'no'\nenable_cpu_affinity: false\nmain_training_function: main\nrdzv_backend: static\n"
    typical += "same_network: true\ntpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\nmachine_rank: 0\n"
    assert read_config_file(H.write_config(tmp_path, BASE + typical)).dims.tp == 2
