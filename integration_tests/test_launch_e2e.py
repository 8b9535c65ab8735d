"""Tier 4: `shardbridge-launch` + an Accelerate config + examples/hf/train.py on 4 gloo processes.

One launch trains and saves (several checks read its outputs); the next resumes or reshards.
Each launch costs ~15-40 s on 2 cores (4 workers importing transformers). Oracles: the
same-layout resume is bit-exact (losses, logits); `from_pretrained` of the export gives the
sharded model's logits; a torch-only reader (torchao blocked) reads the FP8 run's checkpoint.

CI runs two launches: the torchao FP8 run and its bit-exact resume (what no other CI test
launches). The fp32 run, its resume and its reshard to HSDP x TP, and Qwen2 run where
``SHARDBRIDGE_LAUNCH_ALL=1`` is set (``nox -s hf_matrix`` sets it): in CI, docs/hf.md's Quick
start (run as printed by the docs test) trains, resumes bit-exact and exports through a launch,
``test_multimachine.py`` launches ``examples/hf/train.py`` on HSDP x TP across two machines, and the
architecture sweep trains Qwen2 in-process.
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

pytestmark = pytest.mark.slow
ALL = os.environ.get("SHARDBRIDGE_LAUNCH_ALL") == "1"
nox_only = pytest.mark.skipif(not ALL, reason="CI slice: SHARDBRIDGE_LAUNCH_ALL=1 (nox -s hf_matrix) runs it")

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "hf" / "train.py"


def _yaml(path: Path, *, dp_replicate=1, dp_shard=2, tp=2, fp8="none", precision="fp32") -> Path:
    path.write_text(
        textwrap.dedent(
            f"""\
            compute_environment: LOCAL_MACHINE
            distributed_type: FSDP
            use_cpu: true
            num_processes: 4
            num_machines: 1
            machine_rank: 0
            main_process_port: 0
            mixed_precision: "no"
            fsdp_config:
              fsdp_version: 2
              shardbridge:
                precision: {precision}
                fp8: {{backend: {fp8}}}
            parallelism_config:
              parallelism_config_dp_replicate_size: {dp_replicate}
              parallelism_config_dp_shard_size: {dp_shard}
              parallelism_config_tp_size: {tp}
            """
        )
    )
    return path


def _launch(config: Path, out: Path, *args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("SHARDBRIDGE_HF_CONFIG", None)
    run = subprocess.run(
        [sys.executable, "-m", "shardbridge.cli._main", "launch", "--config_file", str(config), str(TRAIN), *args,
         "--report", str(out / "report.json")],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=400,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    report = json.loads((out / "report.json").read_text())
    report["losses"] = {int(k): v for k, v in report["losses"].items()}
    report.update(torch.load(out / "report.json.pt"))
    report["output"] = run.stdout + run.stderr
    return report


def _from_pretrained_logits(folder: Path, probe: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=probe).logits


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    cfg = _yaml(out / "cfg.yaml")
    report = _launch(
        cfg, out, "--steps", "6", "--save-every", "3", "--ckpt-root", str(out / "ckpt"), "--export", str(out / "hf")
    )
    return out, cfg, report


@nox_only
def test_llama_trains_saves_and_exports(llama_run):
    out, _, report = llama_run
    losses = report["losses"]
    assert losses[6] < losses[1] - 0.3, losses
    assert report["dims"] == "dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=1"
    assert (out / "ckpt" / "step-00000003").is_dir() and (out / "ckpt" / "step-00000006").is_dir()
    logits = _from_pretrained_logits(out / "hf", report["probe"])
    torch.testing.assert_close(logits, report["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("run", ["fp8_run", pytest.param("llama_run", marks=nox_only)])
def test_launch_prints_only_the_training_script_lines(run, request):
    """No upstream noise from 4 workers ([Note: upstream noise in a launch]): every line is train.py's."""
    _, _, report = request.getfixturevalue(run)
    lines = [line for line in report["output"].splitlines() if line.strip()]
    assert lines and all(line.startswith("step ") for line in lines), "\n".join(lines[:20])


@nox_only
def test_llama_resume_is_bit_exact(llama_run, tmp_path):
    out, cfg, first = llama_run
    again = _launch(cfg, tmp_path, "--steps", "6", "--resume", str(out / "ckpt" / "step-00000003"))
    assert again["losses"] == {k: v for k, v in first["losses"].items() if k > 3}
    assert torch.equal(again["logits"], first["logits"])


@nox_only
def test_llama_reshards_to_hsdp_x_tp(llama_run, tmp_path):
    out, _, first = llama_run
    cfg = _yaml(tmp_path / "hsdp.yaml", dp_replicate=2, dp_shard=1, tp=2)
    again = _launch(cfg, tmp_path, "--steps", "6", "--resume", str(out / "ckpt" / "step-00000006"))
    assert again["dims"] == "dp_replicate=2, dp_shard=1, cp=1, tp=2, ep=1"
    assert again["losses"] == {}
    torch.testing.assert_close(again["logits"], first["logits"], rtol=1e-5, atol=1e-5)


@nox_only
def test_qwen2_trains_saves_and_exports(tmp_path):
    cfg = _yaml(tmp_path / "cfg.yaml")
    report = _launch(cfg, tmp_path, "--arch", "qwen2", "--steps", "6", "--save-every", "6",
                     "--ckpt-root", str(tmp_path / "ckpt"), "--export", str(tmp_path / "hf"))  # fmt: skip
    assert report["losses"][6] < report["losses"][1] - 0.3, report["losses"]
    logits = _from_pretrained_logits(tmp_path / "hf", report["probe"])
    torch.testing.assert_close(logits, report["logits"], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    pytest.importorskip("torchao")
    out = tmp_path_factory.mktemp("fp8")
    cfg = _yaml(out / "cfg.yaml", fp8="torchao")
    report = _launch(cfg, out, "--steps", "6", "--save-every", "3", "--ckpt-root", str(out / "ckpt"))
    return out, cfg, report


def test_torchao_fp8_trains_and_its_checkpoint_reads_without_torchao(fp8_run):
    tmp_path, _, report = fp8_run
    assert report["losses"][6] < report["losses"][1] - 0.3, report["losses"]
    # A reader without torchao: export + from_pretrained in a fresh interpreter with torchao blocked.
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torchao"] = None  # any import of torchao now fails
        import torch
        from shardbridge_hf import export_pretrained
        from transformers import AutoModelForCausalLM
        export_pretrained({str(tmp_path / "ckpt" / "step-00000006")!r}, {str(tmp_path / "hf")!r})
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "hf")!r})
        probe = torch.load({str(tmp_path / "report.json.pt")!r})["probe"]
        with torch.no_grad():
            torch.save(model(input_ids=probe).logits, {str(tmp_path / "hf_logits.pt")!r})
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    logits = torch.load(tmp_path / "hf_logits.pt")
    # The sharded model computed its matmuls in float8; the export runs them in fp32.
    assert (logits.argmax(-1) == report["logits"].argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(logits, report["logits"], rtol=0.1, atol=0.25)


def test_torchao_fp8_resume_is_bit_exact(fp8_run, tmp_path):
    # Resumed from step 3 in the same layout: the float8 weights, their scales and the optimizer
    # state come back bit for bit (same losses, same logits).
    out, cfg, first = fp8_run
    again = _launch(cfg, tmp_path, "--steps", "6", "--resume", str(out / "ckpt" / "step-00000003"))
    assert again["losses"] == {k: v for k, v in first["losses"].items() if k > 3}
    assert torch.equal(again["logits"], first["logits"])
