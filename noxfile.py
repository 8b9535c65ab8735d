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


@nox.session(python="3.11")
@nox.parametrize("adapter,extra", [("hf-adapter", "hf"), ("megatron-fsdp-adapter", "megatron"), ("te-adapter", "test")])
def adapter(session, adapter, extra):
    """One adapter's tests with its extra installed.

    The TE adapter's CPU tiers need no TE install: the structural tier fetches TE's pure-Python
    wheel into a cache on first use (docs/te.md).
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
        "python", "-m", "pytest", "packages/hf-adapter/tests", "integration_tests/test_hf_launch.py",
        *session.posargs, env=ENV,
    )  # fmt: skip


@nox.session(python="3.11")
def lint(session):
    """ruff over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", "packages", "tools", "integration_tests", "noxfile.py")


@nox.session(python="3.11")
def bench(session):
    """The benchmarks in tools/bench (ratios measured side by side in one run)."""
    _install(session)
    for script in ("bench_step.py", "bench_checkpoint.py", "bench_export.py"):
        session.run("python", f"tools/bench/{script}", *session.posargs, env=ENV)
