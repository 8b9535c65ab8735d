"""Tier 4: an unmodified ``transformers.Trainer`` / TRL ``SFTTrainer`` script under ``shardbridge launch``.

``trainer_script.py`` (nothing of shardbridge in it) runs once in one process on the global batch
(the oracle) and once launched on 4 gloo processes with a config file; the launch also evaluates
before training and, in the same processes, resumes a fresh Trainer from its own ``checkpoint-2``.
Checks per case (docs/hf.md, "Trainer and TRL"):

    losses          every logged step's loss (the global mean), grad_norm (before clipping) and
                    learning rate, and eval_loss, against one process (hf_sweep's RTOL / ATOL;
                    the learning rate exactly)
    gradients       every parameter's gradient at the first optimizer step (accumulated over 2
                    micro-batches and clipped to max_grad_norm), against one process with the
                    architecture sweep's rule (hf_sweep.compare_step1)
    resume          the run resumed from checkpoint-2 ends bit-identical (every weight of
                    save_model's folder torch.equal, the losses of steps 3-4 equal)
    checkpoint      checkpoint-4/shardbridge: `shardbridge ckpt verify` passes, `ckpt export` gives
                    save_model's weights (torch.equal), and it loads at dp_shard=4 (gloo pool) into
                    the same weights (torch.equal to the full tensors)
    save_model      from_pretrained loads the folder; its weights equal the export

CI runs ``trainer_dp2_tp2`` (examples/hf/cpu_fsdp2_tp2.yaml, the file the docs use); ``nox -s
trainer`` (``SHARDBRIDGE_TRAINER=all``) runs every case: SFTTrainer, a MoE at dp2 x tp2 with
ep_size 2, HSDP x tp2 and dp2 x cp2. Each case is two subprocesses, side by side (~15 s and ~45 s on 2 idle cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        tuple(int(x) for x in __import__("transformers").__version__.split(".")[:2]) < (5, 13),
        reason="a Trainer under shardbridge needs transformers >= 5.13 (before, it scales the loss by num_processes)",
    ),
]

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SCRIPT = HERE / "trainer_script.py"
_TESTS = REPO / "packages" / "hf-adapter" / "tests"
if str(_TESTS) not in sys.path:  # hf_sweep's comparison rules; the gloo pool hands sys.path to its workers
    sys.path.insert(0, str(_TESTS))

ALL = os.environ.get("SHARDBRIDGE_TRAINER") == "all"
BATCH = 2  # per_device_train_batch_size of the launched run; the oracle reads dp * BATCH rows a step
STEPS = 4

_EXAMPLE = (REPO / "examples" / "hf" / "cpu_fsdp2_tp2.yaml").read_text()
CASES = {
    # name: (trainer, arch, config file text (None = the example as is), dp degree, dims to reload at)
    "trainer_dp2_tp2": ("trainer", "llama", None, 2),
    "sft_dp2_tp2": ("sft", "llama", None, 2),
    "moe_dp2_tp2_ep2": ("trainer", "qwen3_moe", _EXAMPLE.replace("    fp8: {backend: none}\n", "    fp8: {backend: none}\n    ep_size: 2\n"), 2),
    "trainer_hsdp_tp2": ("trainer", "llama", (REPO / "examples" / "hf" / "cpu_hsdp_tp2.yaml").read_text(), 2),
    "trainer_dp2_cp2": ("trainer", "llama", _EXAMPLE.replace("parallelism_config_tp_size: 2", "parallelism_config_cp_size: 2"), 2),
}  # fmt: skip
CI = ("trainer_dp2_tp2",)


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("SHARDBRIDGE_HF_CONFIG", None)
    return env


def _run(cmd: list[str], cwd: Path) -> None:
    run = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=cwd, timeout=600)
    assert run.returncode == 0, f"{cmd}\n" + run.stdout[-3000:] + run.stderr[-6000:]


def _script_args(trainer: str, arch: str) -> list[str]:
    return ["--trainer", trainer, "--arch", arch, "--steps", str(STEPS)]


def _steps(out: Path) -> dict[int, dict]:
    """log.json by step: the training record and the eval record merged."""
    by_step: dict[int, dict] = {}
    for record in json.loads((out / "log.json").read_text()):
        if "train_runtime" not in record:
            by_step.setdefault(record["step"], {}).update(record)
    return by_step


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.fixture(scope="module", params=[c for c in CASES if ALL or c in CI])
def case(request, tmp_path_factory):
    """Both runs of one case: (name, reference out dir, launched out dir)."""
    name = request.param
    trainer, arch, config_text, dp = CASES[name]
    root = tmp_path_factory.mktemp(name)
    config = REPO / "examples" / "hf" / "cpu_fsdp2_tp2.yaml"
    if config_text is not None:
        config = root / "config.yaml"
        config.write_text(config_text)
    ref, got = root / "one_process", root / "launched"
    args = _script_args(trainer, arch)
    # The one-process oracle runs beside the launch: it is one process, and the launch leaves a core
    # idle while its launcher imports and its workers meet (the two share nothing but the cores).
    oracle_cmd = [sys.executable, str(SCRIPT), str(ref), *args, "--batch", str(dp * BATCH)]
    with open(root / "oracle.log", "w+") as log:
        oracle = subprocess.Popen(oracle_cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=root)
        try:
            launcher = [sys.executable, "-m", "shardbridge.cli._main", "launch", "--config_file", str(config)]
            _run([*launcher, str(SCRIPT), str(got), *args, "--batch", str(BATCH), "--eval-first", "--then-resume", "2"], root)
            code = oracle.wait(timeout=600)
        finally:
            if oracle.poll() is None:
                oracle.kill()
                oracle.wait()
        log.seek(0)
        assert code == 0, f"{oracle_cmd}\n" + log.read()[-6000:]
    return name, ref, got


def test_losses_grad_norms_and_learning_rates_match_one_process(case):
    import hf_sweep

    _, ref, got = case
    ref_steps, got_steps = _steps(ref), _steps(got)
    assert sorted(got_steps) == sorted(ref_steps) == list(range(1, STEPS + 1))
    for step, r in ref_steps.items():
        g = got_steps[step]
        assert g["learning_rate"] == r["learning_rate"], (step, g, r)
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in r:
                assert g[key] == pytest.approx(r[key], rel=hf_sweep.RTOL, abs=hf_sweep.ATOL), (step, key, g, r)


def test_first_step_gradients_match_one_process(case):
    import hf_sweep

    _, ref, got = case
    ref_grads, got_grads = torch.load(ref / "grads.pt"), torch.load(got / "grads.pt")
    norm = sum(float(g.double().norm()) ** 2 for g in got_grads.values()) ** 0.5
    loss = [_steps(got)[1]["loss"]]
    match = hf_sweep.compare_step1(
        {"losses": loss, "grads": got_grads, "norm": norm}, {"losses": [_steps(ref)[1]["loss"]], "grads": ref_grads}
    )
    assert not match.failures, match.failures
    assert len(got_grads) == len(ref_grads) > 0


def test_resumed_run_ends_bit_identical(case):
    _, _, got = case
    whole, resumed = _weights(got / "model"), _weights(got / "resumed" / "model")
    assert sorted(whole) == sorted(resumed)
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key
    steps, again = _steps(got), _steps(got / "resumed")  # 1-2 from checkpoint-2's trainer_state.json
    assert sorted(again) == sorted(steps) == list(range(1, STEPS + 1))
    for step in steps:
        assert again[step]["loss"] == steps[step]["loss"], step


def _loaded(folder: Path) -> dict[str, torch.Tensor]:
    """from_pretrained's parameters: the common reader of save_pretrained's folder (a MoE's experts stored
    one by one) and `ckpt export`'s (the model's fused names)."""
    from transformers import AutoModelForCausalLM

    return {k: v.detach() for k, v in AutoModelForCausalLM.from_pretrained(folder).named_parameters()}


def test_checkpoint_verifies_exports_and_loads_with_from_pretrained(case):
    from shardbridge.cli._main import main as shardbridge_main

    _, _, got = case
    ckpt = got / "checkpoint-4" / "shardbridge"
    assert shardbridge_main(["ckpt", "verify", str(ckpt)]) == 0
    assert shardbridge_main(["ckpt", "export", str(ckpt), str(got / "export")]) == 0
    saved, exported = _loaded(got / "model"), _loaded(got / "export")
    assert sorted(saved) == sorted(exported) and saved
    for key in saved:
        assert torch.equal(saved[key], exported[key]), key


def _reload_full(ckpt: str, model_folder: str) -> dict[str, torch.Tensor]:
    import hf_helpers as H
    from shardbridge import ParallelDims
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_folder))
    acc = H.sb_accelerator(ParallelDims(dp_shard=4))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    acc.load_state(ckpt)
    full = H.full_params(model)
    acc.unpatch()
    return full


def test_checkpoint_reloads_at_dp_shard_4(case):
    from shardbridge.testing import run_distributed

    _, _, got = case
    ckpt, folder = str(got / "checkpoint-4" / "shardbridge"), str(got / "model")
    full = run_distributed(_reload_full, ckpt, folder, timeout=300)[0]  # a cold pool imports transformers
    saved = _loaded(got / "model")
    assert sorted(full) == sorted(saved)
    for key in saved:
        assert torch.equal(full[key], saved[key]), key


def test_trainer_config_file_cases_are_valid(tmp_path):
    """Every case's config file goes through the launcher's own reader (cheap; catches a broken edit)."""
    from shardbridge_hf import read_config_file

    for name, (_, _, text, _) in CASES.items():
        if text is not None:
            path = tmp_path / f"{name}.yaml"
            path.write_text(textwrap.dedent(text))
            assert read_config_file(path).num_processes == 4
