"""CPU-side steps of the GPU tier procedure (tools/gpu): nothing here needs a GPU, TE or network.

split/join/verify round trip, the pins (manifest) format and carry sizes, the stage plan
(`run_stages.py plan --dry-run` lists every stage in order with its timeout), the report writer,
the loss comparison of the hf stage, and `prepare.sh --check`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "tools" / "gpu"


@pytest.fixture(scope="module")
def rs():
    spec = importlib.util.spec_from_file_location("sb_run_stages", GPU / "run_stages.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sb_run_stages"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_split_join_verify_round_trip(rs, tmp_path):
    data = bytes(range(256)) * 4099 + b"tail"  # not a multiple of the part size
    src = tmp_path / "big.whl"
    src.write_bytes(data)
    parts = rs.split_file(src, tmp_path / "parts", 100_000)
    assert [p["name"] for p in parts] == [f"big.whl.part{i:02d}" for i in range(1, len(parts) + 1)]
    assert sum(p["size"] for p in parts) == len(data) and max(p["size"] for p in parts) <= 100_000
    whole = hashlib.sha256(data).hexdigest()
    out = rs.join_parts(parts, tmp_path / "parts", tmp_path / "joined.whl", whole)
    assert out.read_bytes() == data and rs.sha256_file(out) == whole
    # a corrupted part is refused by name; a wrong whole-file hash leaves no file behind
    (tmp_path / "parts" / parts[1]["name"]).write_bytes(b"x" * parts[1]["size"])
    with pytest.raises(ValueError, match=parts[1]["name"]):
        rs.join_parts(parts, tmp_path / "parts", tmp_path / "bad.whl", whole)
    good = rs.split_file(src, tmp_path / "p2", 100_000)
    with pytest.raises(ValueError, match="joined sha256"):
        rs.join_parts(good, tmp_path / "p2", tmp_path / "bad2.whl", "0" * 64)
    assert not (tmp_path / "bad2.whl").exists() and not (tmp_path / "bad2.whl.joining").exists()


def test_pins_are_valid_and_fit_the_carry_limit(rs):
    pins = rs.load_pins()
    assert rs.validate_pins(pins) == []
    carried = rs.carried_files(pins)
    assert sorted(carried) == [1, 2, 3, 4, 5]
    for files in carried.values():
        assert sum(f["size"] for f in files) < rs.CARRY_LIMIT - 2 * rs.MIB
    te_core = next(a for a in pins["artifacts"] if a["file"].startswith("transformer_engine_cu13"))
    assert te_core["size"] == 276522776 and len(te_core["parts"]) == 5
    assert all(p["size"] < rs.PART_LIMIT for p in te_core["parts"])


def test_pins_validation_names_each_problem(rs):
    pins = json.loads(json.dumps(rs.load_pins()))
    core = next(a for a in pins["artifacts"] if a.get("parts"))
    core["parts"][0]["size"] += 1  # parts no longer add up, and exceed part_size
    pins["artifacts"][1]["spec"] = "transformer_engine"  # unpinned
    pins["artifacts"][2]["sha256"] = "abc"
    errors = "\n".join(rs.validate_pins(pins))
    assert "parts add up" in errors and "part_size" in errors
    assert "pin a version" in errors and "64 hex digits" in errors


def test_plan_dry_run_lists_every_stage_in_order_with_timeouts(rs):
    r = subprocess.run(
        [sys.executable, str(GPU / "run_stages.py"), "plan", "--dry-run"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dry run: OK" in r.stdout
    listed = [
        line.split()[1] for line in r.stdout.split("stages in order:")[1].splitlines() if line.strip()[:1].isdigit()
    ]
    assert listed == [s.name for s in rs.STAGES]
    for s in rs.STAGES:
        assert f"{s.name:<16} {s.timeout_s:>4} s" in r.stdout
    # every stage is planned in exactly one call; TE stages come after the build stage
    planned = [n for names in rs.CALLS.values() for n in names]
    assert sorted(planned) == sorted(s.name for s in rs.STAGES)
    order = [s.name for s in rs.STAGES]
    assert all(order.index(s.name) > order.index("te-build") for s in rs.STAGES if s.needs_te)


def test_prepare_check_mode_needs_no_network():
    r = subprocess.run(["bash", str(GPU / "prepare.sh"), "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "call 1: carry tools/gpu/cache/call1" in r.stdout


def test_report_is_written_after_every_stage_and_copied_to_out(rs, tmp_path, monkeypatch):
    home, out = tmp_path / "home", tmp_path / "out"
    rep = rs.Report(home, out)
    failures = rs.run_stages(list(rs.STAGES), home, rep, deadline_s=10_000, resume=False, dry_run=True)
    assert failures == 0
    data = json.loads((out / "report.json").read_text())
    statuses = {n: r["status"] for n, r in data["stages"].items()}
    non_te = [s.name for s in rs.STAGES if not s.needs_te]
    assert all(statuses[n] == "dry-run" for n in non_te)
    # TE stages are not started while TE is not installed, and say why
    assert all(statuses[s.name] == "not-started" for s in rs.STAGES if s.needs_te)
    assert "TE not installed yet" in data["stages"]["te-import"]["summary"]
    rep.record("env", status="passed", seconds=1.5, results={"gpu": "H100", "summary": "ok"}, summary="ok")
    md = (out / "report.md").read_text()
    assert "| env | passed | 1.5 | ok |" in md and "- gpu: H100" in md
    # a later call resumes: passed stages are skipped, the deadline leaves the rest not started
    rep2 = rs.Report(home, out)
    assert rep2.done("env") and not rep2.done("mfsdp")
    rs.run_stages(rs.order_stages(["env", "mfsdp"]), home, rep2, deadline_s=5, resume=True)
    assert rep2.data["stages"]["mfsdp"]["status"] == "not-started"
    assert rep2.data["stages"]["env"]["status"] == "passed"


def test_hf_compare_against_the_cpu_reference(rs, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    ref = {str(k): 5.0 - 0.3 * k for k in range(1, 9)}
    (hf / "hf-cpu-ref.json").write_text(json.dumps({"losses": ref}))
    (hf / "hf-bf16.json").write_text(json.dumps({"losses": {k: v * 1.01 for k, v in ref.items()}}))
    (hf / "hf-torchao.json").write_text(json.dumps({"losses": {k: v * 1.5 for k, v in ref.items()}}))
    assert rs.hf_compare(tmp_path) == 1
    out = json.loads((tmp_path / "json" / "hf-compare.json").read_text())
    assert out["failed"] == ["hf-torchao"] and out["runs"]["hf-te-fp8"] == "not run"
    assert out["runs"]["hf-bf16"]["max_rel_diff"] == pytest.approx(0.01, abs=1e-4)


def test_te_checks_dry_run_lists_its_checks():
    r = subprocess.run(
        [sys.executable, str(GPU / "te_checks.py"), "--dry-run"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [
        "linear-vs-torch", "current-params", "delayed-extra-state", "block-scaled", "mxfp8", "grouped-experts"
    ]  # fmt: skip
