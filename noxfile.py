"""nox sessions: the core without extras, each adapter with its extra, lint and benchmarks.

Every session installs torch FIRST (``TORCH`` below, a local CPU wheel on the team's machines):
a package whose requirement admits a newer torch would otherwise pull a multi-GB CUDA build.
Run ``nox -l`` to list sessions, ``nox -s core`` to run one.
"""

import os
import shutil

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


# The oldest torch shardbridge supports (the project's GPU machines run 2.11+cu130), the newest
# before it, and the newest on PyPI. pip's default on PyPI is the newest (2.15.0 today: a CUDA 13.2
# build, ~2.6 GB with its nvidia-* wheels, that imports and runs on CPU; gloo works). Keep in step
# with TORCH_CHECKED in shardbridge/_compat.py and docs/testing.md, "torch versions".
TORCH_VERSIONS = ["2.11.0", "2.14.1", "2.15.0"]


# pip's configuration on the team's machines caps torch at the newest wheel on their disk
# (/etc/xdg/pip/constraints.txt): these sessions lift the cap for their own installs.
NO_CAP = {"PIP_CONSTRAINT": "/dev/null"}


@nox.session(python="3.11")
@nox.parametrize("torch", TORCH_VERSIONS)
def torch_versions(session, torch):
    """The core tests on the oldest supported and the newest torch (docs/testing.md, "torch versions")."""
    pin = f"torch=={torch}"
    session.install(pin, env=NO_CAP)
    session.install(pin, "-e", ".[test]", env=NO_CAP)
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("python", "-m", "pytest", "packages/core/tests", *session.posargs, env=ENV)


@nox.session(python="3.11")
def torch_cross(session):
    """Checkpoints cross torch versions: saved under the floor (2.11.0) and loaded bit-exact under the
    newest (2.15.0) at another layout, and the other way (2.15 pickles a field the older torch's DCP
    cannot read; shardbridge's reader drops it); the newest's own round trip (tools/torch_cross.py;
    docs/testing.md)."""
    floor, newest = TORCH_VERSIONS[0], TORCH_VERSIONS[-1]
    session.install(f"torch=={floor}", env=NO_CAP)
    session.install(f"torch=={floor}", "-e", ".[test]", env=NO_CAP)
    other = os.path.join(os.path.dirname(session.virtualenv.location), f"torch_cross-{newest}")
    other_python = os.path.join(other, "bin", "python")
    if not os.path.exists(other_python):
        session.run("python", "-m", "venv", other)
    session.run(other_python, "-m", "pip", "install", "-q", f"torch=={newest}", env=NO_CAP, external=True)
    session.run(other_python, "-m", "pip", "install", "-q", f"torch=={newest}", "-e", ".[test]", env=NO_CAP,
                external=True)  # fmt: skip
    root = session.create_tmp()
    for save, check in (("python", other_python), (other_python, "python")):
        where = os.path.join(root, "from-floor" if save == "python" else "from-newest")
        shutil.rmtree(where, ignore_errors=True)  # a rerun (-R) saves afresh
        session.run(save, "tools/torch_cross.py", "save", where, env=ENV, external=True)
        session.run(check, "tools/torch_cross.py", "check", where, env=ENV, external=True)
    # and the newest's checkpoint under the newest (the default pip install's own round trip)
    session.run(other_python, "tools/torch_cross.py", "check", where, env=ENV, external=True)


@nox.session(python="3.11")
@nox.parametrize(
    "adapter,extra",
    [
        # te-structural: the hf adapter's TE-through-Accelerate tests (test_hf_te.py) run TE's Python code
        nox.param("hf-adapter", "hf,te-structural", id="hf-adapter"),
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
    ("5.24.0", "1.10.1"),
    ("5.24.0", "1.15.0"),
]
# Keep in step with TRANSFORMERS_CHECKED in shardbridge_hf/_compat.py (the newest pinned here) and
# with the accelerate range of shardbridge_hf/_patches.py.


@nox.session(python="3.11")
@nox.parametrize("transformers,accelerate", HF_MATRIX)
def hf_matrix(session, transformers, accelerate):
    """The hf-adapter tests and its launcher integration tests against pinned transformers x accelerate."""
    _install(session, "hf,trl,fp8,test")
    session.install(TORCH, f"transformers=={transformers}", f"accelerate=={accelerate}")
    session.run(
        "python", "-m", "pytest", "packages/hf-adapter/tests", "integration_tests/test_launch_e2e.py",
        "integration_tests/test_trainer.py",
        *session.posargs, env={**ENV, "SHARDBRIDGE_LAUNCH_ALL": "1"},
    )  # fmt: skip


@nox.session(python="3.11")
def lint(session):
    """ruff over the whole tree (docstring rules D, google convention, on packages/*/src)."""
    session.install("ruff")
    session.run("ruff", "check", "packages", "tools", "integration_tests", "examples", "noxfile.py")


@nox.session(python="3.11")
def faults(session):
    """The checkpoint fault-injection suite with 10x the random-kill trials, and a failure before every collective of
    every entry point on every rank, local and S3 (docs/checkpoints.md, Reliability and Symmetric errors)."""
    _install(session)
    env = {**ENV, "SHARDBRIDGE_FAULT_TRIALS": "10", "SHARDBRIDGE_ENTRY_FAULTS": "all"}
    tests = ["packages/core/tests/checkpoint/test_faults.py", "packages/core/tests/checkpoint/test_entry_faults.py"]
    session.run("python", "-m", "pytest", *tests, "-s", *session.posargs, env=env)


@nox.session(python="3.11")
def gloo_exit(session):
    """The exit-abort reproducer (docs/testing.md, "Resolved flakes"): README's train_core.py 50 times and the
    Megatron-FSDP example 10 times, each gloo worker thread made late to the GIL (tools/repro/gloo_exit.py; needs
    cc). Any failed run fails the session; `-- --without-exit-wait` shows the failures the fix removed."""
    _install(session, "megatron,test")
    session.run("python", "tools/repro/gloo_exit.py", "--runs", "50", "--parallel", "2", *session.posargs, env=ENV)
    session.run("python", "tools/repro/gloo_exit.py", "--job", "megatron", "--runs", "10", "--parallel", "2",
                *session.posargs, env=ENV)  # fmt: skip


@nox.session(python="3.11")
def trust(session):
    """Every generated hostile input (docs/checkpoints.md, Threat model): chunk coverage with every chunk mutated and
    ~60x the layouts, every writer x file x link/overwrite case, convert config-vs-tensor mutants, the HF
    file-selection oracle, every key of an Accelerate config file misspelled by one edit (docs/hf.md), 2,500 mutated
    .metadata streams read by the restricted reader and by DCP's own reading, every forged layout.derived loaded on 4
    ranks; CI runs a slice."""
    _install(session, "all,test")
    env = {**ENV, "SHARDBRIDGE_TRUST": "all"}
    session.run(
        "python", "-m", "pytest", "packages/core/tests/checkpoint/test_coverage.py",
        "packages/core/tests/checkpoint/test_trust.py", "packages/core/tests/test_pretrained_files.py",
        "packages/megatron-fsdp-adapter/tests/test_convert_trust.py", "integration_tests/test_trust_writers.py",
        "packages/hf-adapter/tests/test_hf_keys.py", "packages/core/tests/checkpoint/test_metadata_stream.py",
        *session.posargs, env=env,
    )
    session.run("python", "-m", "pytest", "packages/core/tests/checkpoint/test_derived.py", "-k", "forged", *session.posargs, env=env)


@nox.session(python="3.11")
def s3(session):
    """Checkpoints on S3 against moto's real server: the default slice plus the whole fault matrix
    (kill -9 mid-upload, the server stopped before each request of a save and at random points, and
    at each verb's first request, also under the default timeouts; docs/checkpoints.md, Reliability)."""
    _install(session, "test,s3")
    env = {**ENV, "SHARDBRIDGE_S3_FAULTS": "all", "SHARDBRIDGE_DEMO_ALL": "1"}
    tests = ["packages/core/tests/checkpoint/test_s3.py", "packages/core/tests/checkpoint/test_s3_faults.py",
             "packages/core/tests/checkpoint/test_s3_errors.py", "integration_tests/test_demo_s3.py"]  # fmt: skip
    session.run("python", "-m", "pytest", *tests, "-s", *session.posargs, env=env)


@nox.session(python="3.11")
def multimachine(session):
    """Two machines of two processes on localhost (integration_tests/test_multimachine.py): the CI part
    (torchrun, SLURM's variables, the checkpoint a node-local path would split) plus `shardbridge launch
    --num_machines 2` of examples/hf/train.py against one machine (docs/concepts/mesh.md, Across machines)."""
    _install(session, "hf,test")
    env = {**ENV, "SHARDBRIDGE_MULTIMACHINE": "all"}
    session.run("python", "-m", "pytest", "integration_tests/test_multimachine.py", *session.posargs, env=env)


@nox.session(python="3.11")
def beyond_ci(session):
    """The end-to-end tests CI leaves out for its time budget (docs/testing.md, "CI budget"): the fp32 and Qwen2
    launches, the one-machine launch the two-machine launch is compared with, the uneven demo. The sweeps and
    matrices have sessions of their own (hf_sweep, moe, fp8_matrix, trust, s3, faults, megatron_core)."""
    _install(session, "all,te-structural,test")
    env = {**ENV, "SHARDBRIDGE_LAUNCH_ALL": "1", "SHARDBRIDGE_MULTIMACHINE": "all", "SHARDBRIDGE_DEMO_ALL": "1"}
    tests = ["integration_tests/test_launch_e2e.py", "integration_tests/test_multimachine.py", "integration_tests/test_demo.py",
             "integration_tests/test_demo_s3.py"]  # fmt: skip
    session.run("python", "-m", "pytest", *tests, *session.posargs, env=env)


@nox.session(python="3.11")
def fp8_matrix(session):
    """Every FP8 recipe x layout: torchao through the hf adapter and `shardbridge launch`, TE structural (docs/concepts/fp8.md)."""
    _install(session, "all,te-structural,test")
    env = {**ENV, "SHARDBRIDGE_FP8_MATRIX": "all"}
    session.run(
        "python", "-m", "pytest", "packages/core/tests/test_fp8_tp_styles.py", "packages/hf-adapter/tests/test_hf_fp8.py",
        "packages/hf-adapter/tests/test_hf_te.py", "packages/te-adapter/tests/test_te_fp8_checkpoint_structural.py",
        "integration_tests/test_launch_fp8.py", *session.posargs, env=env,
    )


@nox.session(python="3.11")
def megatron_tp_sweep(session):
    """Megatron-FSDP x TP (full TP plan): every strategy x layout incl. tp4 and 8-rank HSDP; microbatches under every strategy (docs/megatron-fsdp.md)."""
    _install(session, "megatron,test")
    env = {**ENV, "SHARDBRIDGE_MFSDP_TP_SWEEP": "1"}
    session.run(
        "python", "-m", "pytest", "packages/megatron-fsdp-adapter/tests/test_mfsdp_train.py",
        "packages/megatron-fsdp-adapter/tests/test_mfsdp_accumulate.py", *session.posargs, env=env
    )


@nox.session(python="3.11")
def megatron_core(session):
    """Megatron-Core GPTModel under Megatron-Core's own Megatron-FSDP (megatron-core 0.16.1, never beside
    megatron-fsdp): training, checkpoints, fsdp_dtensor reads, Hugging Face conversion, MoE with expert
    parallelism; every case (SHARDBRIDGE_MCORE_FULL=1), CI runs a slice (docs/megatron-fsdp.md, Megatron-Core)."""
    _install(session, "megatron-core,test")
    env = {**ENV, "SHARDBRIDGE_MCORE_FULL": "1"}
    session.run("python", "-m", "pytest", "packages/megatron-fsdp-adapter/tests/mcore", *session.posargs, env=env)


@nox.session(python="3.11")
def hf_sweep(session):
    """Every transformers architecture with a TP plan through the hf adapter (docs/hf.md, Architecture sweep).

    CI runs hf_sweep.CI_ARCHS; this runs all but the documented exceptions (hours on 2 cores).
    """
    _install(session, "hf,test")
    env = {**ENV, "SHARDBRIDGE_HF_SWEEP": "all"}
    session.run("python", "-m", "pytest", "packages/hf-adapter/tests/test_hf_sweep.py", *session.posargs, env=env)


@nox.session(python="3.11")
def trainer(session):
    """transformers.Trainer and TRL's SFTTrainer under `shardbridge launch`, unmodified scripts (docs/hf.md,
    "Trainer and TRL"): every case of integration_tests/test_trainer.py (SFTTrainer, a MoE at dp2 x tp2 with
    ep_size 2, HSDP x tp2, dp2 x cp2; CI runs the Trainer at dp2 x tp2) and the hf adapter's Trainer tests."""
    _install(session, "hf,trl,test")
    env = {**ENV, "SHARDBRIDGE_TRAINER": "all"}
    tests = [
        "integration_tests/test_trainer.py",
        "packages/hf-adapter/tests/test_hf_trainer.py",
        "packages/hf-adapter/tests/test_hf_arguments.py",
        "packages/hf-adapter/tests/test_hf_plugin.py",
    ]
    session.run("python", "-m", "pytest", *tests, *session.posargs, env=env)


@nox.session(python="3.11")
def moe(session):
    """Mixture of experts (docs/concepts/moe.md): the whole layout matrix (8-rank layouts included),
    the long checkpoint chains, the HF export and TE GroupedLinear experts. CI runs a slice of each."""
    _install(session, "hf,te-structural,test")
    env = {**ENV, "SHARDBRIDGE_MOE_MATRIX": "all"}
    tests = [
        "packages/core/tests/test_moe.py",
        "packages/core/tests/checkpoint/test_experts.py",
        "packages/core/tests/test_layout.py::test_expert_tensors_keep_item_coordinates_and_dcp_describes_them",
        "integration_tests/test_reference_moe_hf.py",
        # every MoE architecture of the installed transformers on the ep axis (docs/hf.md, Expert parallelism)
        "packages/hf-adapter/tests/test_hf_ep.py",
        "packages/hf-adapter/tests/test_hf_pretrained.py",
        # TE GroupedLinear experts on the ep axis, structural tier (docs/te.md, GroupedLinear experts)
        "packages/te-adapter/tests/test_te_experts_structural.py",
        "packages/te-adapter/tests/test_te_reference_kernels.py::test_grouped_linear_runs_as_f_linear_per_expert",
    ]
    session.run("python", "-m", "pytest", *tests, *session.posargs, env=env)


@nox.session(python="3.11")
def bench_hf_pretrained(session):
    """Shard-on-read pretrained loading vs from_pretrained on every rank (docs/hf.md, Pretrained weights)."""
    _install(session, "hf,test")
    session.run("python", "tools/bench/bench_pretrained.py", *session.posargs, env=ENV)


@nox.session(python="3.11")
def bench(session):
    """The benchmarks in tools/bench (ratios measured side by side in one run)."""
    _install(session)
    for script in ("bench_step.py", "bench_checkpoint.py", "bench_export.py", "bench_fp8.py"):
        session.run("python", f"tools/bench/{script}", *session.posargs, env=ENV)


@nox.session(python="3.11")
def scale(session):
    """The scale model of the checkpoint path: 8 -> 16,384 simulated ranks, Llama-3 8B/70B/405B, vs plain DCP
    (docs/benchmarks.md, "Scale"); its tiny-size checks run in the default suite (test_scale.py)."""
    _install(session)
    session.run("python", "tools/bench/bench_scale.py", *session.posargs, env=ENV)


@nox.session(python="3.11")
def trend(session):
    """The checkpoint path in real processes: save / load at 4, 8, 16 gloo processes vs plain DCP, time and
    collective rounds per rank (docs/benchmarks.md, "Trend")."""
    _install(session)
    session.run("python", "tools/bench/bench_trend.py", *session.posargs, env=ENV)
