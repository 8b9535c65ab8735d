"""GPU tier driver: runs on the lent GPU machine (and, with --dry-run, anywhere).

One procedure (tools/gpu/README.md): prepare.sh (CPU machine) downloads the pinned files of
pins.json into tools/gpu/cache/callN/; each `run` call carries one callN folder; this script

    stash  N          moves tools/gpu/cache/callN/* to $SB_GPU_HOME/files and checks each sha256
    setup             pip-installs the small wheels (no index, no deps), starts the TE build
                      (transformer_engine_torch sdist, `setsid` in the background, log in
                      $SB_GPU_HOME/build.log), joins the TE core wheel once all parts are there
    run               runs stages (--group/--stages), each with its own timeout, under one
                      deadline (--deadline-s); writes $SB_GPU_HOME/report.{json,md} after EVERY
                      stage and copies them (plus logs.tar.gz) to $OUT
    call N            = stash N + setup + run the group planned for call N (CALLS below)
    plan              prints the plan (calls, carried folders, stages, timeouts); --dry-run = plan
                      + checks that every script a stage names exists (CI runs this)

The report survives across calls in $SB_GPU_HOME (default /root/sbgpu) while the machine
stays warm; `run --resume` skips stages already recorded. Stages that need TE wait for the
build (or are recorded as skipped when it failed). Nothing here needs network.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import glob
import hashlib
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PINS = HERE / "pins.json"
CACHE = HERE / "cache"
MIB = 2**20
CARRY_LIMIT = 64 * MIB  # the run tool's working-tree limit per call
PART_LIMIT = 60 * MIB
SRC_DIRS = [
    "packages/core/src",
    "packages/te-adapter/src",
    "packages/megatron-fsdp-adapter/src",
    "packages/hf-adapter/src",
]
H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s (SXM); MFU is reported against it


# ----------------------------------------------------------------------------- files


def sha256_file(path: str | os.PathLike, chunk: int = 8 * MIB) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def split_file(path: str | os.PathLike, out_dir: str | os.PathLike, part_size: int) -> list[dict]:
    """Split ``path`` into ``<name>.partNN`` files of at most ``part_size`` bytes; returns their records."""
    if part_size <= 0:
        raise ValueError(f"part_size={part_size} must be > 0")
    path, out_dir = Path(path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(path, "rb") as f:
        i = 0
        while block := f.read(part_size):
            i += 1
            name = f"{path.name}.part{i:02d}"
            (out_dir / name).write_bytes(block)
            parts.append({"name": name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    return parts


def join_parts(parts: list[dict], parts_dir: str | os.PathLike, out: str | os.PathLike, sha256: str) -> Path:
    """Concatenate verified parts into ``out`` and check the whole file's sha256 (ValueError on mismatch)."""
    parts_dir, out = Path(parts_dir), Path(out)
    for p in parts:
        got = sha256_file(parts_dir / p["name"])
        if got != p["sha256"]:
            raise ValueError(f"part {p['name']}: sha256 {got} != pinned {p['sha256']}")
    tmp = out.with_name(out.name + ".joining")
    with open(tmp, "wb") as dst:
        for p in parts:
            with open(parts_dir / p["name"], "rb") as src:
                shutil.copyfileobj(src, dst, 8 * MIB)
    got = sha256_file(tmp)
    if got != sha256:
        tmp.unlink()
        raise ValueError(f"{out.name}: joined sha256 {got} != pinned {sha256}")
    tmp.replace(out)
    return out


def load_pins(path: str | os.PathLike = PINS) -> dict:
    return json.loads(Path(path).read_text())


def carried_files(pins: dict) -> dict[int, list[dict]]:
    """Call number -> the files (name, size, sha256) carried in that call."""
    calls: dict[int, list[dict]] = {}
    for a in pins["artifacts"]:
        if a.get("parts"):
            for p in a["parts"]:
                calls.setdefault(p["call"], []).append(p)
        else:
            calls.setdefault(a["call"], []).append({"name": a["file"], "size": a["size"], "sha256": a["sha256"]})
    return dict(sorted(calls.items()))


def validate_pins(pins: dict, tree_bytes: int = 2 * MIB) -> list[str]:
    """Every problem with the pins (empty = fine): fields, hashes, parts that add up, carry sizes."""
    errors = []
    if pins.get("format") != 1:
        errors.append(f"format={pins.get('format')!r}, expected 1")
    part_size = pins.get("part_size", 0)
    if not 0 < part_size < PART_LIMIT:
        errors.append(f"part_size={part_size} must be in (0, {PART_LIMIT})")
    names = set()
    for a in pins.get("artifacts", []):
        for key in ("file", "source", "size", "sha256"):
            if key not in a:
                errors.append(f"{a.get('file', '?')}: missing {key!r}")
        if a.get("source") == "url" and not str(a.get("url", "")).startswith("https://"):
            errors.append(f"{a.get('file')}: source url needs an https url")
        if a.get("source") == "pip" and "==" not in a.get("spec", ""):
            errors.append(f"{a.get('file')}: pip spec must pin a version (name==x.y.z)")
        if len(a.get("sha256", "")) != 64:
            errors.append(f"{a.get('file')}: sha256 must be 64 hex digits")
        if a.get("file") in names:
            errors.append(f"{a.get('file')}: listed twice")
        names.add(a.get("file"))
        parts = a.get("parts")
        if parts:
            if sum(p["size"] for p in parts) != a.get("size"):
                errors.append(f"{a['file']}: parts add up to {sum(p['size'] for p in parts)}, not {a.get('size')}")
            for i, p in enumerate(parts, 1):
                if p["name"] != f"{a['file']}.part{i:02d}":
                    errors.append(f"{a['file']}: part {i} is named {p['name']}")
                if p["size"] > part_size:
                    errors.append(f"{p['name']}: {p['size']} bytes > part_size {part_size}")
                if len(p.get("sha256", "")) != 64 or "call" not in p:
                    errors.append(f"{p['name']}: needs sha256 and call")
        elif a.get("size", 0) >= PART_LIMIT:
            errors.append(f"{a.get('file')}: {a.get('size')} bytes needs parts (limit {PART_LIMIT})")
        elif "call" not in a:
            errors.append(f"{a.get('file')}: needs call")
    for call, files in carried_files(pins).items() if not errors else ():
        total = sum(f["size"] for f in files) + tree_bytes
        if total >= CARRY_LIMIT:
            errors.append(f"call {call}: {total} bytes with the tree >= carry limit {CARRY_LIMIT}")
    return errors


def prepare(pins: dict, cache: Path = CACHE, downloads: Path | None = None) -> list[str]:
    """CPU machine: download what pins.json names (cached), check sha256, lay out cache/callN/. Idempotent."""
    downloads = downloads or cache / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    pip = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "-d",
        str(downloads),
    ]
    for plat in (
        "manylinux_2_28_x86_64",
        "manylinux_2_27_x86_64",
        "manylinux_2_24_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
    ):
        pip += ["--platform", plat]
    done = []
    for a in pins["artifacts"]:
        path = downloads / a["file"]
        if not (path.is_file() and path.stat().st_size == a["size"] and sha256_file(path) == a["sha256"]):
            if a["source"] == "pip":
                subprocess.run([*pip, a["spec"]], check=True)
            else:  # sdists pip cannot download without building their metadata (TE's needs CUDA)
                import urllib.request

                urllib.request.urlretrieve(a["url"], path)
            got = sha256_file(path)
            if got != a["sha256"]:
                raise SystemExit(f"{a['file']}: sha256 {got} != pinned {a['sha256']} (pins.json)")
        if a.get("parts"):
            tmp = cache / "split"
            parts = split_file(path, tmp, pins["part_size"])
            if [(p["name"], p["sha256"]) for p in parts] != [(p["name"], p["sha256"]) for p in a["parts"]]:
                raise SystemExit(f"{a['file']}: parts differ from pins.json")
            for p in a["parts"]:
                (cache / f"call{p['call']}").mkdir(parents=True, exist_ok=True)
                shutil.move(str(tmp / p["name"]), cache / f"call{p['call']}" / p["name"])
            shutil.rmtree(tmp)
        else:
            (cache / f"call{a['call']}").mkdir(parents=True, exist_ok=True)
            shutil.copy(path, cache / f"call{a['call']}" / a["file"])
        done.append(a["file"])
    manifest = {str(c): files for c, files in carried_files(pins).items()}
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return done


# ----------------------------------------------------------------------------- stages


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    timeout_s: int
    argv: tuple[str, ...]
    needs_te: bool = False
    what: str = ""
    script: str | None = None  # repo-relative file the stage runs (checked by --dry-run)


PY = "{py}"
TORCHRUN = ("{py}", "-m", "torch.distributed.run", "--standalone")
LAUNCH = ("{py}", "-m", "shardbridge.cli._main", "launch", "--config_file")
TRAIN = "examples/hf/train.py"


def _hf(name: str, cfg: str, bs: int, needs_te: bool = False, what: str = "") -> Stage:
    argv = (*LAUNCH, cfg, TRAIN, "--steps", "8", "--batch-size", str(bs), "--report", f"{{home}}/hf/{name}.json")
    return Stage(name, 240, argv, needs_te, what, script=cfg)


STAGES: tuple[Stage, ...] = (
    Stage(
        "env",
        60,
        (PY, "tools/gpu/run_stages.py", "probe", "--json", "{home}/json/env.json"),
        what="GPU, driver, torch, CUDA, packages",
    ),
    Stage(
        "mfsdp",
        300,
        (*TORCHRUN, "--nproc-per-node", "1", "tools/gpu/mfsdp_checks.py", "--json", "{home}/json/mfsdp.json"),
        what="Megatron-FSDP on CUDA, world 1 NCCL, every strategy vs a torch reference; CPU patch inert",
        script="tools/gpu/mfsdp_checks.py",
    ),
    _hf("hf-cpu-ref", "examples/hf/cpu_fsdp2_tp2.yaml", 2, what="CPU reference: 4 gloo ranks dp2 x tp2 fp32"),
    _hf("hf-bf16", "tools/gpu/configs/gpu_1gpu_bf16.yaml", 4, what="shardbridge launch on CUDA, bf16, world 1"),
    _hf("hf-torchao", "tools/gpu/configs/gpu_1gpu_torchao.yaml", 4, what="torchao float8 tensorwise on CUDA"),
    Stage("te-build", 600, (PY, "tools/gpu/run_stages.py", "wait-te"), what="wait for the TE build, install it"),
    Stage(
        "te-import",
        90,
        (PY, "tools/gpu/run_stages.py", "probe", "--te", "--json", "{home}/json/te-import.json"),
        needs_te=True,
        what="import transformer_engine.pytorch; FP8 / block / MXFP8 support",
    ),
    Stage(
        "te-w1-nccl",
        240,
        (*TORCHRUN, "--nproc-per-node", "1", "tools/gpu/te_checks.py", "--json", "{home}/json/te-w1-nccl.json"),
        needs_te=True,
        what="TE adapter, world 1 NCCL: numerics vs torch, FP8 recipes, amax group, _extra_state, block/MXFP8, "
        "GroupedLinear experts",
        script="tools/gpu/te_checks.py",
    ),
    *(
        Stage(
            f"te-gloo-{r}",
            180,
            (*TORCHRUN, "--nproc-per-node", "4", "examples/te/gpu_tier.py", "--backend", "gloo", "--recipe", r),
            needs_te=True,
            what=f"examples/te/gpu_tier.py, 4 ranks on cuda:0 over gloo, recipe {r}: dp2xtp2 -> tp4 / non-FP8",
            script="examples/te/gpu_tier.py",
        )
        for r in ("current", "delayed", "none")
    ),
    Stage(
        "te-w4-gloo",
        300,
        (
            *TORCHRUN,
            "--nproc-per-node",
            "4",
            "tools/gpu/te_checks.py",
            "--backend",
            "gloo",
            "--json",
            "{home}/json/te-w4-gloo.json",
        ),
        needs_te=True,
        what="te_checks at dp2 x tp2 (4 ranks on cuda:0, gloo): amax group = weight mesh, _extra_state at tp4, "
        "GroupedLinear experts at ep4",
        script="tools/gpu/te_checks.py",
    ),
    Stage(
        "te-fp8-ckpt",
        240,
        (
            *TORCHRUN,
            "--nproc-per-node",
            "4",
            "tools/gpu/te_checks.py",
            "--backend",
            "gloo",
            "--only",
            "fp8-ckpt",
            "--json",
            "{home}/json/te-fp8-ckpt.json",
        ),
        needs_te=True,
        what="TE FP8 param types (current, delayed, block, mxfp8, nvfp4 where supported) in checkpoints: "
        "plain on disk (torch alone), dp2xtp2 -> tp4 re-quantized, -> non-FP8",
        script="tools/gpu/te_checks.py",
    ),
    _hf("hf-te-fp8", "tools/gpu/configs/gpu_1gpu_te_fp8.yaml", 4, True, "TE FP8 (delayed, FP8 params) via hf"),
    Stage(
        "hf-compare",
        60,
        (PY, "tools/gpu/run_stages.py", "hf-compare", "--json", "{home}/json/hf-compare.json"),
        what="hf losses vs the CPU reference",
    ),
    Stage(
        "bench-llama",
        420,
        (
            *TORCHRUN,
            "--nproc-per-node",
            "1",
            "tools/gpu/bench_gpu.py",
            "llama",
            "--json",
            "{home}/json/bench-llama.json",
        ),
        what="Llama ~1B bf16: parallelize_llama vs plain fully_shard; torchao float8 tensorwise/rowwise",
        script="tools/gpu/bench_gpu.py",
    ),
    Stage(
        "bench-te",
        300,
        (*TORCHRUN, "--nproc-per-node", "1", "tools/gpu/bench_gpu.py", "te", "--json", "{home}/json/bench-te.json"),
        needs_te=True,
        what="TE TransformerLayer stack: bf16 vs FP8 recipes (tokens/s, MFU, peak memory)",
        script="tools/gpu/bench_gpu.py",
    ),
    Stage(
        "bench-ckpt",
        300,
        (*TORCHRUN, "--nproc-per-node", "1", "tools/gpu/bench_gpu.py", "ckpt", "--json", "{home}/json/bench-ckpt.json"),
        what="checkpoint save/load from GPU memory vs torch.save / torch.load",
        script="tools/gpu/bench_gpu.py",
    ),
)
STAGE_BY_NAME = {s.name: s for s in STAGES}
# What each `run` call of the plan runs (README.md). Calls 2-5 only carry parts; the TE build
# runs in the background from call 1 on. Benchmarks run after the build (it takes the CPUs).
CALLS: dict[int, tuple[str, ...]] = {
    1: ("env", "mfsdp", "hf-cpu-ref", "hf-bf16", "hf-torchao"),
    2: (),
    3: (),
    4: (),
    5: (),
    6: (
        "te-build",
        "te-import",
        "te-w1-nccl",
        "te-gloo-current",
        "te-gloo-delayed",
        "te-gloo-none",
        "te-w4-gloo",
        "te-fp8-ckpt",
        "hf-te-fp8",
        "hf-compare",
    ),
    7: ("bench-llama", "bench-te", "bench-ckpt"),
}
DEADLINE_S = {1: 540, 2: 60, 3: 60, 4: 60, 5: 90, 6: 560, 7: 560}


def order_stages(names: list[str]) -> list[Stage]:
    unknown = [n for n in names if n not in STAGE_BY_NAME]
    if unknown:
        raise SystemExit(f"unknown stage(s) {unknown}; known: {[s.name for s in STAGES]}")
    return [s for s in STAGES if s.name in names]


def render_plan(pins: dict) -> str:
    lines = ["GPU tier plan (see tools/gpu/README.md)", ""]
    carry = carried_files(pins)
    for call in sorted(CALLS):
        files = carry.get(call, [])
        mib = sum(f["size"] for f in files) / MIB
        lines.append(
            f"call {call}: "
            + (f"carry tools/gpu/cache/call{call} ({len(files)} files, {mib:.1f} MiB)" if files else "carry nothing")
            + f"; deadline {DEADLINE_S[call]} s"
        )
        for s in order_stages(list(CALLS[call])):
            lines.append(f"  {s.name:<16} timeout {s.timeout_s:>4} s  {'[TE] ' if s.needs_te else ''}{s.what}")
    lines += ["", "stages in order:"]
    lines += [f"{i:>2}. {s.name:<16} {s.timeout_s:>4} s  {shlex.join(s.argv)}" for i, s in enumerate(STAGES, 1)]
    return "\n".join(lines)


def dry_run_problems(pins: dict) -> list[str]:
    problems = list(validate_pins(pins))
    for s in STAGES:
        if s.script and not (REPO / s.script).is_file():
            problems.append(f"stage {s.name}: {s.script} does not exist")
    planned = [n for names in CALLS.values() for n in names]
    if sorted(planned) != sorted(s.name for s in STAGES):
        problems.append(f"CALLS must run every stage exactly once: {planned}")
    if sorted(carried_files(pins)) != [c for c in sorted(CALLS) if carried_files(pins).get(c)]:
        problems.append("a carried call is missing from CALLS")
    return problems


# ----------------------------------------------------------------------------- report


class Report:
    """One JSON + one markdown file, rewritten after every stage (so a killed call still leaves them)."""

    def __init__(self, home: str | os.PathLike, out: str | os.PathLike | None = None) -> None:
        self.home = Path(home)
        self.out = Path(out) if out else None
        self.path = self.home / "report.json"
        self.data = json.loads(self.path.read_text()) if self.path.is_file() else {"stages": {}, "events": []}

    def event(self, text: str) -> None:
        self.data["events"].append(f"{_now()} {text}")
        self.write()

    def record(self, name: str, **fields) -> None:
        self.data["stages"][name] = {**self.data["stages"].get(name, {}), **fields}
        self.write()

    def done(self, name: str) -> bool:
        return self.data["stages"].get(name, {}).get("status") in ("passed", "failed", "skipped-unsupported")

    def write(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)
        (self.home / "report.md").write_text(self.markdown())
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.path, self.out / "report.json")
            shutil.copy(self.home / "report.md", self.out / "report.md")

    def markdown(self) -> str:
        lines = ["# shardbridge GPU tier report", ""]
        env = self.data["stages"].get("env", {}).get("results")
        if isinstance(env, dict):
            lines += [f"- {k}: {v}" for k, v in env.items() if k != "summary"] + [""]
        lines += ["| stage | status | seconds | summary |", "| --- | --- | ---: | --- |"]
        for name, r in self.data["stages"].items():
            summary = str(r.get("summary", "")).replace("|", "/").replace("\n", " ")[:300]
            lines.append(f"| {name} | {r.get('status', '?')} | {r.get('seconds', '')} | {summary} |")
        for name, r in self.data["stages"].items():
            if r.get("results") is not None:
                lines += [
                    "",
                    f"## {name}",
                    "",
                    "```json",
                    json.dumps(r["results"], indent=1, default=str)[:6000],
                    "```",
                ]
            elif r.get("status") not in ("passed", None) and r.get("tail"):
                lines += ["", f"## {name} (log tail)", "", "```", r["tail"][-3000:], "```"]
        lines += ["", "## events", ""] + [f"- {e}" for e in self.data["events"]]
        return "\n".join(lines) + "\n"

    def ship_logs(self) -> None:
        if not self.out:
            return
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for p in sorted((self.home / "logs").glob("*.log")) + [self.home / "build.log"]:
                if p.is_file():
                    tar.add(p, arcname=p.name)
        (self.out / "logs.tar.gz").write_bytes(buf.getvalue()[: 15 * MIB])


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%H:%M:%S")


# ----------------------------------------------------------------------------- GPU side


def home_dir() -> Path:
    return Path(os.environ.get("SB_GPU_HOME", "/root/sbgpu"))


def stage_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO / d) for d in SRC_DIRS]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="4")
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return env


def stash(call: int, pins: dict, home: Path, report: Report) -> None:
    files = home / "files"
    files.mkdir(parents=True, exist_ok=True)
    src = CACHE / f"call{call}"
    for f in carried_files(pins).get(call, []):
        dst = files / f["name"]
        if (src / f["name"]).is_file():
            shutil.move(str(src / f["name"]), dst)
        if not dst.is_file():
            report.event(f"call {call}: {f['name']} NOT carried (carry tools/gpu/cache/call{call})")
            continue
        ok = sha256_file(dst) == f["sha256"]
        report.event(f"call {call}: {f['name']} {'sha256 ok' if ok else 'SHA256 MISMATCH (deleted)'}")
        if not ok:
            dst.unlink()


def _pip(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", *args]
    return subprocess.run(cmd, capture_output=True, text=True)


def _nvidia_includes() -> list[str]:
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    return sorted(glob.glob(str(site / "nvidia" / "*" / "include")))


def setup(pins: dict, home: Path, report: Report) -> None:
    files = home / "files"
    state = report.data.setdefault("setup", {})
    for a in pins["artifacts"]:
        path = files / a["file"]
        if a.get("parts") and not path.is_file() and all((files / p["name"]).is_file() for p in a["parts"]):
            join_parts(a["parts"], files, path, a["sha256"])
            for p in a["parts"]:
                (files / p["name"]).unlink()
            report.event(f"joined {a['file']} (sha256 ok)")
        if a["file"].endswith(".whl") and path.is_file() and not state.get(a["file"]):
            r = _pip(str(path))
            state[a["file"]] = "installed" if r.returncode == 0 else f"pip failed: {r.stderr[-500:]}"
            report.event(f"pip install {a['file']}: {state[a['file']]}")
        if a["file"].endswith(".tar.gz") and path.is_file() and not (home / "build.pid").is_file():
            start_te_build(path, home)
            report.event(f"TE build started in the background (log {home / 'build.log'})")
    report.write()


def start_te_build(sdist: Path, home: Path) -> None:
    env = dict(os.environ)
    includes = _nvidia_includes()
    env.update(
        MAX_JOBS="12",  # leaves 4 cores to the stages running beside it
        NVTE_PYTORCH_FORCE_BUILD="TRUE",  # do not try to download a prebuilt wheel (no network)
        NVTE_CUDA_ARCHS="90",
        NVTE_WITH_NCCL_EP="0",
        NVTE_FRAMEWORK="pytorch",
        CPLUS_INCLUDE_PATH=os.pathsep.join(includes + [env.get("CPLUS_INCLUDE_PATH", "")]).strip(os.pathsep),
    )
    dist = home / "dist"
    cmd = (
        f"{shlex.quote(sys.executable)} -m pip wheel -v --no-build-isolation --no-deps --no-index "
        f"-w {shlex.quote(str(dist))} {shlex.quote(str(sdist))}; echo $? > {shlex.quote(str(home / 'build.rc'))}"
    )
    with open(home / "build.log", "ab") as log:
        proc = subprocess.Popen(
            ["bash", "-c", cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # setsid: survives the end of this call
        )
    (home / "build.pid").write_text(str(proc.pid))
    (home / "build.start").write_text(str(time.time()))


def wait_te(home: Path, timeout_s: float) -> int:
    """Wait for the background build, then install its wheel. Returns 0 when TE imports."""
    rc_file = home / "build.rc"
    end = time.time() + timeout_s
    while not rc_file.is_file() and time.time() < end:
        time.sleep(5)
    if not rc_file.is_file():
        print(f"build still running after {timeout_s:.0f} s; tail of build.log:")
        print(_tail(home / "build.log"))
        return 124
    rc = int(rc_file.read_text().strip() or 1)
    started = float((home / "build.start").read_text()) if (home / "build.start").is_file() else None
    print(f"build rc={rc}" + (f", {time.time() - started:.0f} s since start" if started else ""))
    if rc:
        print(_tail(home / "build.log", 80))
        return rc
    wheels = sorted((home / "dist").glob("transformer_engine_torch-*.whl"))
    r = _pip(*map(str, wheels))
    print(r.stdout[-2000:], r.stderr[-2000:])
    if r.returncode:
        return r.returncode
    t = subprocess.run(
        [
            sys.executable,
            "-c",
            "import transformer_engine.pytorch as te, transformer_engine as t; print(t.__version__)",
        ],
        capture_output=True,
        text=True,
    )
    print(t.stdout, t.stderr[-3000:])
    return t.returncode


def _tail(path: Path, lines: int = 40) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def te_ready(home: Path) -> bool | None:
    """True: installed and importable; False: build failed; None: not known yet."""
    if (home / "te.ok").is_file():
        return True
    rc = home / "build.rc"
    if rc.is_file() and rc.read_text().strip() not in ("0", ""):
        return False
    return None


def run_stages(
    stages: list[Stage], home: Path, report: Report, deadline_s: float, resume: bool, dry_run: bool = False
) -> int:
    start = time.time()
    env = stage_env()
    (home / "logs").mkdir(parents=True, exist_ok=True)
    (home / "json").mkdir(parents=True, exist_ok=True)
    (home / "hf").mkdir(parents=True, exist_ok=True)
    failures = 0
    for s in stages:
        if resume and report.done(s.name):
            continue
        left = deadline_s - (time.time() - start)
        if left < min(60, s.timeout_s):
            report.record(s.name, status="not-started", summary=f"deadline: {left:.0f} s left")
            continue
        if s.needs_te and te_ready(home) is not True:
            why = "TE build failed (see te-build)" if te_ready(home) is False else "TE not installed yet"
            report.record(s.name, status="not-started", summary=why)
            continue
        timeout = int(min(s.timeout_s, left - 10))
        argv = [a.format(py=sys.executable, home=home) for a in s.argv]
        report.record(s.name, status="running", started=_now(), timeout_s=timeout, cmd=shlex.join(argv))
        if dry_run:
            report.record(s.name, status="dry-run", seconds=0)
            continue
        log = home / "logs" / f"{s.name}.log"
        t0 = time.time()
        with open(log, "wb") as f:
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = 124
        secs = round(time.time() - t0, 1)
        if s.name == "te-build" and rc == 0:
            (home / "te.ok").write_text("ok")
        results = None
        jpath = _results_path(s, home)
        if jpath and jpath.is_file():
            try:
                results = json.loads(jpath.read_text())
            except ValueError:
                results = {"unreadable": str(jpath)}
        status = "passed" if rc == 0 else ("timeout" if rc == 124 else "failed")
        if isinstance(results, dict) and results.get("failed"):
            status = "failed"
        summary = results.get("summary", "") if isinstance(results, dict) else ""
        report.record(
            s.name,
            status=status,
            rc=rc,
            seconds=secs,
            results=results,
            summary=summary or _tail(log, 3)[-300:],
            tail=_tail(log, 60),
        )
        failures += status != "passed"
    report.ship_logs()
    return failures


def _results_path(s: Stage, home: Path) -> Path | None:
    for i, a in enumerate(s.argv):
        if a in ("--json", "--report") and i + 1 < len(s.argv):
            return Path(s.argv[i + 1].format(home=home, py=""))
    return None


# ----------------------------------------------------------------------------- small stages


def probe(te: bool, json_path: str | None) -> int:
    info: dict = {"python": sys.version.split()[0]}
    import torch

    info.update(torch=torch.__version__, cuda=torch.version.cuda, gpu_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu=p.name,
            sm=f"{p.major}.{p.minor}",
            memory_gib=round(p.total_memory / 2**30, 1),
            multiprocessors=p.multi_processor_count,
        )
    from importlib import metadata

    for name in (
        "accelerate",
        "transformers",
        "torchao",
        "megatron-fsdp",
        "transformer_engine",
        "transformer_engine_cu13",
        "transformer_engine_torch",
        "numpy",
        "triton",
    ):
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    for tool in (
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        ["nvcc", "--version"],
    ):
        try:
            info[tool[0]] = subprocess.run(tool, capture_output=True, text=True, timeout=20).stdout.strip()[-200:]
        except (OSError, subprocess.TimeoutExpired) as e:
            info[tool[0]] = f"unavailable: {e}"
    info["cpus"] = os.cpu_count()
    if te:
        import transformer_engine.pytorch as tep

        for fn in ("is_fp8_available", "is_mxfp8_available", "is_fp8_block_scaling_available", "is_nvfp4_available"):
            f = getattr(tep, fn, None)
            try:
                info[fn] = str(f(return_reason=True)) if f else "absent"
            except TypeError:
                info[fn] = str(f())
            except Exception as e:  # noqa: BLE001
                info[fn] = f"error: {e}"
    info["summary"] = f"{info.get('gpu')} torch {info['torch']} te {info.get('transformer_engine')}"
    print(json.dumps(info, indent=1))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(info, default=str))
    return 0


def hf_compare(home: Path) -> int:
    """Per-step losses of each hf run vs the CPU reference (same global batch per step)."""
    ref_path = home / "hf" / "hf-cpu-ref.json"
    if not ref_path.is_file():
        print("no CPU reference (hf-cpu-ref did not run)")
        return 1
    ref = {int(k): v for k, v in json.loads(ref_path.read_text())["losses"].items()}
    tolerance = {"hf-bf16": 0.05, "hf-torchao": 0.10, "hf-te-fp8": 0.10}  # relative, per step
    out = {"reference": ref, "runs": {}, "failed": []}
    for name, tol in tolerance.items():
        p = home / "hf" / f"{name}.json"
        if not p.is_file():
            out["runs"][name] = "not run"
            continue
        got = {int(k): v for k, v in json.loads(p.read_text())["losses"].items()}
        rel = max(abs(got[k] - ref[k]) / max(abs(ref[k]), 1e-6) for k in ref if k in got)
        ok = rel <= tol and got[max(got)] < got[min(got)]
        out["runs"][name] = {"losses": got, "max_rel_diff": round(rel, 4), "tolerance": tol, "loss_falls": ok}
        if not ok:
            out["failed"].append(name)
    out["summary"] = ", ".join(
        f"{n}: {r['max_rel_diff']}" if isinstance(r, dict) else f"{n}: {r}" for n, r in out["runs"].items()
    )
    print(json.dumps(out, indent=1))
    (home / "json").mkdir(parents=True, exist_ok=True)
    (home / "json" / "hf-compare.json").write_text(json.dumps(out))
    return 1 if out["failed"] else 0


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("plan")
    sp.add_argument("--dry-run", action="store_true", help="also check pins, scripts and the call table")
    sub.add_parser("prepare", help="CPU machine: download, verify, split into tools/gpu/cache/callN (prepare.sh)")
    sp = sub.add_parser("stash")
    sp.add_argument("call", type=int)
    sub.add_parser("setup")
    sp = sub.add_parser("run")
    sp.add_argument("--stages", default=None, help="comma-separated stage names (default: all)")
    sp.add_argument("--group", type=int, default=None, help="the stages of call N")
    sp.add_argument("--deadline-s", type=float, default=540)
    sp.add_argument("--resume", action="store_true", help="skip stages already passed/failed in the report")
    sp.add_argument("--dry-run", action="store_true", help="record the plan into the report, run nothing")
    sp = sub.add_parser("call")
    sp.add_argument("n", type=int)
    sp.add_argument("--deadline-s", type=float, default=None)
    sp = sub.add_parser("probe")
    sp.add_argument("--te", action="store_true")
    sp.add_argument("--json", default=None)
    sp = sub.add_parser("wait-te")
    sp.add_argument("--timeout-s", type=float, default=560)
    sp = sub.add_parser("hf-compare")
    sp.add_argument("--json", default=None)
    args = p.parse_args(argv)
    pins = load_pins()
    home = home_dir()

    if args.cmd == "plan":
        print(render_plan(pins))
        if args.dry_run:
            problems = dry_run_problems(pins)
            print("\n".join(["", "dry run: " + ("OK" if not problems else "PROBLEMS"), *problems]))
            return 1 if problems else 0
        return 0
    if args.cmd == "prepare":
        problems = validate_pins(pins)
        if problems:
            raise SystemExit("pins.json: " + "; ".join(problems))
        for f in prepare(pins):
            print("ok", f)
        for call, files in carried_files(pins).items():
            print(f"call {call}: tools/gpu/cache/call{call}: {sum(f['size'] for f in files) / MIB:.1f} MiB")
        return 0
    if args.cmd == "probe":
        return probe(args.te, args.json)
    if args.cmd == "wait-te":
        return wait_te(home, args.timeout_s)
    if args.cmd == "hf-compare":
        return hf_compare(home)
    report = Report(home, os.environ.get("OUT"))
    if args.cmd == "stash":
        stash(args.call, pins, home, report)
        return 0
    if args.cmd == "setup":
        setup(pins, home, report)
        return 0
    if args.cmd == "call":
        t0 = time.time()
        stash(args.n, pins, home, report)
        setup(pins, home, report)
        deadline = (args.deadline_s or DEADLINE_S[args.n]) - (time.time() - t0)
        names = list(CALLS[args.n])
        if args.n == max(CALLS):  # the last call also finishes what earlier calls left
            names = [s.name for s in STAGES]
        failures = run_stages(order_stages(names), home, report, deadline, resume=True)
        print(report.markdown())
        return 1 if failures else 0
    if args.stages:
        names = args.stages.split(",")
    elif args.group:
        names = list(CALLS[args.group])
    else:
        names = [s.name for s in STAGES]
    failures = run_stages(order_stages(names), home, report, args.deadline_s, args.resume, args.dry_run)
    print(report.markdown())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
