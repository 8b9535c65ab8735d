"""nox sessions: the core without extras, each adapter with its extra, lint and benchmarks.

Every session installs torch FIRST (``TORCH`` below, a local CPU wheel on the team's machines):
a package whose requirement admits a newer torch would otherwise pull a multi-GB CUDA build.
Run ``nox -l`` to list sessions, ``nox -s core`` to run one.
"""

import os

import nox

nox.options.sessions = ["core", "lint"]
nox.options.reuse_existing_virtualenvs = True

TORCH = f"torch=={os.environ.get('SHARDBRIDGE_TORCH', '2.13.0')}"
ENV = {"OMP_NUM_THREADS": "1"}


def _install(session, extras="test"):
    session.install(TORCH)
    session.install(TORCH, "-e", f".[{extras}]")


@nox.session(python="3.11")
def core(session):
    """The core library and integration tests, no host framework installed."""
    _install(session)
    session.run("python", "-m", "pytest", "packages/core/tests", "integration_tests", *session.posargs, env=ENV)


# The oldest torch shardbridge supports (the project's GPU machines run 2.11+cu130) and the newest
# installable here (pip's local cap; 2.15 exists only as multi-GB CUDA builds). Both are CUDA
# builds that run on CPU. Keep in step with TORCH_CHECKED in shardbridge/_compat.py.
TORCH_VERSIONS = ["2.11.0", "2.14.1"]


@nox.session(python="3.11")
@nox.parametrize("torch", TORCH_VERSIONS)
def torch_versions(session, torch):
    """The core tests on the oldest supported and the newest installable torch (docs/testing.md)."""
    pin = f"torch=={torch}"
    session.install(pin)
    session.install(pin, "-e", ".[test]")
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("python", "-m", "pytest", "packages/core/tests", *session.posargs, env=ENV)


@nox.session(python="3.11")
@nox.parametrize(
    "adapter,extra",
    [
        nox.param("hf-adapter", "hf", id="hf-adapter"),
        nox.param("megatron-fsdp-adapter", "megatron", id="megatron-fsdp-adapter"),
        nox.param("te-adapter", "te-structural", id="te-adapter"),
    ],
)
def adapter(session, adapter, extra):
    """One adapter's tests with its extra installed.

    The TE adapter's CPU tiers need no TE install: the ``te-structural`` extra holds what TE's
    Python code imports, and the structural tier fetches TE's pure-Python wheel into a cache
    outside the repo and the venv on first use, shared by every session and clone (docs/te.md).
    """
    _install(session, f"{extra},test")
    tests = f"packages/{adapter}/tests"
    if not any(name.startswith("test_") for name in os.listdir(tests)):
        session.skip(f"{adapter} has no tests yet")
    session.run("python", "-m", "pytest", tests, *session.posargs, env=ENV)


# transformers 5.0.x still has ReplicateParallel (upstream bug 1 appears in >= 5.1); accelerate
# 1.10 is the oldest with ParallelismConfig. Newest pins move with releases.
HF_MATRIX = [
    ("5.0.0", "1.10.1"),
    ("5.0.0", "1.15.0"),
    ("5.23.0", "1.10.1"),
    ("5.23.0", "1.15.0"),
]


@nox.session(python="3.11")
@nox.parametrize("transformers,accelerate", HF_MATRIX)
def hf_matrix(session, transformers, accelerate):
    """The hf-adapter tests and its launcher integration tests against pinned transformers x accelerate."""
    _install(session, "hf,fp8,test")
    session.install(TORCH, f"transformers=={transformers}", f"accelerate=={accelerate}")
    session.run(
        "python", "-m", "pytest", "packages/hf-adapter/tests", "integration_tests/test_launch_e2e.py",
        *session.posargs, env=ENV,
    )  # fmt: skip


@nox.session(python="3.11")
def lint(session):
    """ruff over the whole tree (docstring rules D, google convention, on packages/*/src)."""
    session.install("ruff")
    session.run("ruff", "check", "packages", "tools", "integration_tests", "examples", "noxfile.py")


@nox.session(python="3.11")
def faults(session):
    """The checkpoint fault-injection suite with 10x the random-kill trials (docs/checkpoints.md, Reliability)."""
    _install(session)
    env = {**ENV, "SHARDBRIDGE_FAULT_TRIALS": "10"}
    session.run("python", "-m", "pytest", "packages/core/tests/checkpoint/test_faults.py", "-s", *session.posargs, env=env)


@nox.session(python="3.11")
def bench(session):
    """The benchmarks in tools/bench (ratios measured side by side in one run)."""
    _install(session)
    for script in ("bench_step.py", "bench_checkpoint.py", "bench_export.py"):
        session.run("python", f"tools/bench/{script}", *session.posargs, env=ENV)
