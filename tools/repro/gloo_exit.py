"""Run a 4-process gloo job N times and count how its processes ended: the exit-abort reproducer.

    python tools/repro/gloo_exit.py --parallel 2             # README's train_core.py, 50 runs, 2 at a time
    python tools/repro/gloo_exit.py --job megatron --runs 10 # the Megatron-FSDP example (docs' flags)
    python tools/repro/gloo_exit.py --without-exit-wait      # the same, as before the fix (the "before")

The CI failures this reproduces (docs/testing.md, "Resolved flakes"): a rank of a 4-process gloo
job aborted after its last line with ``terminate called without an active exception`` (SIGABRT),
because a gloo worker thread took the GIL while the interpreter finalized ([Note: gloo threads at
exit] in ``packages/core/src/shardbridge/_distributed.py``). On an idle machine that needs the
worker to be preempted at the wrong millisecond; to see it in tens of runs rather than thousands,
``--late-worker-ms`` (default 100) preloads ``late_gloo_worker.c`` (built with ``cc`` into a
temporary directory): every gloo worker stays runnable that long before it takes the GIL, as a
worker preempted on a loaded machine does. ``--late-worker-ms 0`` runs the jobs unchanged;
``--load K`` adds K busy processes (the CI machine is loaded).

``--without-exit-wait`` runs each process through a wrapper that unregisters shardbridge's exit
wait (``atexit.unregister(shardbridge._distributed.wait_for_gloo_workers)``), which is the one
thing the fix changes at run time: the job as it ran before.

Each run gets a fresh directory under ``--out`` (default: a temporary one); a failed run's output
stays there (``log.txt``). The summary counts runs and processes: ``ok``, ``abort`` (SIGABRT with
``terminate called without an active exception``), ``segfault`` (SIGSEGV) and ``other``. Exit
code 1 when any run failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).with_name("late_gloo_worker.c")
WRAPPER = """\
import atexit, runpy, sys
from shardbridge._distributed import wait_for_gloo_workers
atexit.unregister(wait_for_gloo_workers)  # --without-exit-wait: the job as it ran before the fix
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""
TERMINATE = "terminate called without an active exception"
RANK_EXIT = re.compile(r"^\s*rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)", re.M)  # torchrun's report, per rank


def readme_train_core() -> str:
    """README.md's ``# train_core.py`` block, as the docs test writes it."""
    text = (REPO / "README.md").read_text()
    match = re.search(r"```python\n(# train_core\.py\n.*?)```", text, re.S)
    if match is None:
        raise SystemExit("README.md has no ```python block starting with '# train_core.py'")
    return match.group(1)


def build_shim(into: Path) -> Path:
    """Compile late_gloo_worker.c; the shared library's path."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise SystemExit("--late-worker-ms needs a C compiler (cc, or $CC); or pass --late-worker-ms 0")
    out = into / "late_gloo_worker.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(SHIM), "-ldl"], check=True)
    return out


def job_command(job: str, run_dir: Path, wrap: bool) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    if job == "core":
        (run_dir / "train_core.py").write_text(readme_train_core())
        script = ["train_core.py"]
    else:  # docs/megatron-fsdp.md's command
        script = [str(REPO / "examples/megatron_fsdp/train_llama.py"), "--out", "mfsdp_ckpt", "--steps", "3",
                  "--microbatches", "2"]  # fmt: skip
    if wrap:
        (run_dir / "without_exit_wait.py").write_text(WRAPPER)
        script = ["without_exit_wait.py", *script]
    return torchrun + script


def classify(returncode: int, log: str) -> Counter:
    """How the job's processes ended, from torchrun's report (one entry per failed process)."""
    ends: Counter = Counter()
    codes = [int(c) for _, c in dict(RANK_EXIT.findall(log)).items()]
    for code in codes:
        if code == -6 and TERMINATE in log:
            ends["abort"] += 1
        elif code == -6:
            ends["abort (other message)"] += 1
        elif code == -11:
            ends["segfault"] += 1
        elif code == -15:
            ends["stopped by torchrun (a peer failed)"] += 1
        else:
            ends[f"exit code {code}"] += 1
    if returncode != 0 and not codes:
        ends[f"torchrun exit code {returncode}"] += 1
    return ends


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", choices=("core", "megatron"), default="core")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--late-worker-ms", type=float, default=100.0)
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the job")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (each late worker spins: CPU load, as on a loaded machine)")
    parser.add_argument("--without-exit-wait", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.runs < 1 or args.parallel < 1 or args.late_worker_ms < 0 or args.load < 0:
        parser.error(f"--runs={args.runs} and --parallel={args.parallel} must be >= 1, "
                     f"--late-worker-ms={args.late_worker_ms} and --load={args.load} >= 0")  # fmt: skip
    out = args.out or Path(tempfile.mkdtemp(prefix="gloo-exit-"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if args.late_worker_ms > 0:
        env["LD_PRELOAD"] = str(build_shim(out))
        env["LATE_GLOO_WORKER_US"] = str(int(args.late_worker_ms * 1000))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    runs: Counter = Counter()
    procs: Counter = Counter()
    print(f"{args.job}: {args.runs} runs ({args.parallel} at once), late worker {args.late_worker_ms:g} ms, load {args.load}, "
          f"{'WITHOUT' if args.without_exit_wait else 'with'} shardbridge's exit wait; logs in {out}", flush=True)  # fmt: skip
    def one(i: int) -> tuple[int, int, str, float]:
        run_dir = out / f"run{i:03d}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir()
        start = time.monotonic()
        p = subprocess.run(job_command(args.job, run_dir, args.without_exit_wait), cwd=run_dir, env=env,
                           capture_output=True, text=True)  # fmt: skip
        return i, p.returncode, p.stdout + p.stderr, time.monotonic() - start

    try:
        with ThreadPoolExecutor(args.parallel) as pool:
            for done, (i, returncode, log, seconds) in enumerate(pool.map(one, range(args.runs)), 1):
                ends = classify(returncode, log)
                verdict = "ok" if returncode == 0 else "FAILED: " + ", ".join(f"{n} {k}" for k, n in sorted(ends.items()))
                print(f"run {i + 1:3d} ({done}/{args.runs}): {verdict} ({seconds:.0f} s)", flush=True)
                runs["ok" if returncode == 0 else "failed"] += 1
                procs.update(ends)
                procs["ok"] += 4 - sum(ends.values())
                if returncode == 0:
                    shutil.rmtree(out / f"run{i:03d}")
                else:
                    (out / f"run{i:03d}" / "log.txt").write_text(log)
    finally:
        for h in hogs:
            h.kill()
    print(f"runs: {runs['failed']} of {args.runs} failed; processes: "
          + ", ".join(f"{k} {n}" for k, n in procs.most_common()))  # fmt: skip
    return 1 if runs["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
