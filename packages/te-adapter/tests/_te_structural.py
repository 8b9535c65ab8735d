"""STRUCTURAL TIER support: TransformerEngine's real Python code on a CPU machine, kernels absent.

TEST SUPPORT ONLY. Nothing in ``shardbridge_te`` imports this module; it is never on the
adapter's runtime path.

[Note: the structural tier]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
TransformerEngine cannot be installed on a CPU machine: ``transformer_engine.pytorch`` needs the
compiled extension ``transformer_engine_torch`` (an sdist that builds only against CUDA), and
``transformer_engine.common`` loads libtransformer_engine.so, cuDNN, nvrtc and curand with ctypes.
The Python code of its modules (``Linear``, ``LayerNormMLP``, ``TransformerLayer``, ...) ships
in the pure-Python wheel ``transformer_engine-2.20.2-py3-none-any.whl`` (1.2 MB). This module:

1. ``ensure_te_sources()``: ``pip download --no-deps transformer_engine==2.20.2`` into a cache
   directory outside the repository and the venv (:func:`cache_dir`), keeps the wheel there and
   extracts ``transformer_engine/**.py`` and its dist-info, once per machine; later runs, fresh
   clones and nox venvs reuse it. The packages TE's import needs beyond ``test`` are declared in
   the ``te-structural`` extra (pyproject.toml), not fetched here;
2. ``import_te()``: imports TE from there with
   * ``NVTE_PROJECT_BUILDING=1`` (TE's own switch for building from source: ``common/__init__``
     skips every ctypes load), and
   * ``transformer_engine_torch`` replaced by :data:`STAND_IN`, a module named
     ``shardbridge_te_structural_stand_in``: the enums TE reads at import time with the values of
     TE's C headers, and every kernel a function that raises
     ``RuntimeError("structural tier: kernel <name> not available")``;
3. ``cuda_construction(device)``: a context manager that makes ``torch.cuda.is_available()``
   true while TE modules are CONSTRUCTED (``TransformerEngineBaseModule.__init__`` raises
   "TransformerEngine needs CUDA." otherwise, even on meta) and maps TE's hard-coded
   ``device="cuda"`` to ``device`` (meta).

What this tier can show: module structure (parameter names, shapes, TP placements), the adapter's
DTensor conversion, FSDP2 sharding of TE modules, DCP round trips of values. What it cannot:
anything a kernel computes (forward/backward numerics, FP8 quantization, amax reductions). A
test that reaches a kernel fails with the message above, never with a wrong number.
"""

from __future__ import annotations

import compileall
import contextlib
import enum
import fcntl
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

TE_VERSION = "2.20.2"
CACHE_ENV = "SHARDBRIDGE_TE_CACHE"
STAND_IN_NAME = "shardbridge_te_structural_stand_in"
EXTRA_HINT = 'pip install -e ".[te-structural,test]"'
"""The packages ``import transformer_engine.pytorch`` needs beyond ``test`` (pyproject.toml)."""


def cache_dir() -> Path:
    """Where the TE wheel and its extracted sources live, the same for every clone and venv.

    ``$SHARDBRIDGE_TE_CACHE``, else ``$XDG_CACHE_HOME/shardbridge/te-2.20.2``, else
    ``~/.cache/shardbridge/te-2.20.2``. Never inside the repository or a venv, so fresh clones,
    ``tools/test.sh`` and every nox session share one download.
    """
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardbridge" / f"te-{TE_VERSION}"


def _wanted(name: str) -> bool:
    if name.startswith("transformer_engine-") and ".dist-info/" in name:
        return True  # metadata.version("transformer_engine") reads it
    if not name.endswith(".py"):
        return False
    return name == "transformer_engine/__init__.py" or name.startswith(
        ("transformer_engine/common/", "transformer_engine/pytorch/", "transformer_engine/debug/")
    )


def _measure(root: Path, wheel_bytes: int) -> dict[str, float | int | str]:
    files = list((root / "transformer_engine").rglob("*.py"))
    return {
        "path": str(root),
        "download_s": 0.0,
        "wheel_bytes": wheel_bytes,
        "extracted_files": len(files),
        "extracted_bytes": sum(p.stat().st_size for p in files),
        "cached": "yes",
    }


def _pip(args: list[str], what: str, root: Path) -> float:
    """Run ``python -m pip <args>``; RuntimeError naming ``what`` failed (with pip's output) if it does."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"structural tier: `pip {' '.join(args[:2])} ... {what}` failed (rc={proc.returncode}). The TE "
            f"structural tests need the package registry once per machine (then {root} is reused); check "
            f"network / PIP_INDEX_URL, or copy a filled cache there ({CACHE_ENV} overrides the path).\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return time.perf_counter() - t0


def _download(root: Path, work: Path) -> dict[str, float | int | str]:
    """Fill ``work`` (a private temp dir) with the wheel and its sources, then move it to ``root``."""
    wheel_dir, staged = work / "wheel", work / "staged"
    spec = f"transformer_engine=={TE_VERSION}"
    download_s = _pip(["download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(wheel_dir), spec], spec, root)
    wheels = list(wheel_dir.glob("transformer_engine-*.whl"))
    if not wheels:
        raise RuntimeError(f"structural tier: pip downloaded no transformer_engine wheel into {wheel_dir}")
    with zipfile.ZipFile(wheels[0]) as zf:
        for name in zf.namelist():
            if _wanted(name):
                zf.extract(name, staged)
    # Workers run with python -B (no .pyc written): compile once here so each pool start reads bytecode.
    compileall.compile_dir(str(staged / "transformer_engine"), quiet=1)
    wheel_bytes = wheels[0].stat().st_size
    (staged / "wheel").mkdir()
    shutil.copy2(wheels[0], staged / "wheel" / wheels[0].name)  # kept: the cache holds what was fetched
    (staged / ".complete").write_text(str(wheel_bytes))
    shutil.rmtree(root, ignore_errors=True)  # a partial copy left by a killed run
    staged.rename(root)  # same file system: atomic, readers see no half-filled cache
    info = _measure(root, wheel_bytes)
    info.update(download_s=round(download_s, 2), cached="no")
    return info


def ensure_te_sources() -> dict[str, float | int | str]:
    """Download (once per machine) and extract TE's Python sources; returns what it measured.

    Safe under concurrency (pytest-xdist workers, parallel CI jobs sharing a home): an
    exclusive ``flock`` on ``<cache>.lock`` lets one process download while the others wait,
    then see the complete cache. Each download works in its own temp dir next to the cache.

    Returns:
        ``{"path", "download_s", "wheel_bytes", "extracted_files", "extracted_bytes", "cached"}``.

    Raises:
        RuntimeError: pip could not download (registry unreachable); names the package and has pip's output.
    """
    root = cache_dir()
    marker = root / ".complete"
    if marker.exists():
        return _measure(root, int(marker.read_text().strip() or 0))
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        if marker.exists():  # another process finished while we waited
            return _measure(root, int(marker.read_text().strip() or 0))
        work = Path(tempfile.mkdtemp(prefix=root.name + ".download-", dir=root.parent))
        try:
            return _download(root, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- the stand-in


class _Kernel:
    """A compiled-extension function: raises when called, so no test can take a fake number."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError(f"structural tier: kernel {self._name} not available")

    def __getattr__(self, attr: str) -> _Kernel:  # tex.layernorm.default (torch.ops style)
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Kernel(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<structural stand-in kernel {self._name}>"


class _StandInClass:
    """A compiled-extension class (CommOverlap, ...): constructing it is a kernel call."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"structural tier: kernel {type(self).__name__} not available")


def _enum(name: str, members: dict[str, int]) -> type[enum.IntEnum]:
    return enum.IntEnum(name, members, module=STAND_IN_NAME)


# Values from TE 2.20.2's C headers (transformer_engine.h, fused_attn.h, activation.h, in the
# transformer_engine_cu12 wheel) and
# pytorch/csrc/common.h (FP8FwdTensors / FP8BwdTensors: quantizer slots).
_ENUMS: dict[str, dict[str, int]] = {
    "DType": {
        # the members the pybind enum exposes (constants.py asserts the set)
        "kByte": 0, "kInt32": 2, "kFloat32": 4, "kFloat16": 5, "kBFloat16": 6, "kFloat8E4M3": 7,
        "kFloat8E5M2": 8, "kFloat4E2M1": 10,
    },
    "FP8FwdTensors": {
        "GEMM1_INPUT": 0, "GEMM1_WEIGHT": 1, "GEMM1_OUTPUT": 2, "GEMM2_INPUT": 3, "GEMM2_WEIGHT": 4,
        "GEMM2_OUTPUT": 5, "GEMM3_INPUT": 6, "GEMM3_WEIGHT": 7, "GEMM3_OUTPUT": 8,
    },
    "FP8BwdTensors": {
        "GRAD_OUTPUT1": 0, "GRAD_INPUT1": 1, "GRAD_OUTPUT2": 2, "GRAD_INPUT2": 3,
        "GRAD_OUTPUT3": 4, "GRAD_INPUT3": 5,
    },
    "NVTEScalingMode": {
        "NVTE_DELAYED_TENSOR_SCALING": 0, "NVTE_MXFP8_1D_SCALING": 1, "NVTE_BLOCK_SCALING_1D": 2,
        "NVTE_BLOCK_SCALING_2D": 3, "NVTE_NVFP4_1D_SCALING": 4, "NVTE_INVALID_SCALING": 100,
    },
    "NVTE_QKV_Format": {
        "NVTE_SBHD": 0, "NVTE_BSHD": 1, "NVTE_THD": 2, "NVTE_BSHD_2SBHD": 3, "NVTE_SBHD_2BSHD": 4,
        "NVTE_THD_2BSHD": 5, "NVTE_THD_2SBHD": 6, "NVTE_BHSD": 7, "NVTE_QKV_Format_NOT_SET": 8,
    },
    "NVTE_QKV_Layout": {
        "NVTE_SB3HD": 0, "NVTE_SBH3D": 1, "NVTE_SBHD_SB2HD": 2, "NVTE_SBHD_SBH2D": 3, "NVTE_SBHD_SBHD_SBHD": 4,
        "NVTE_BS3HD": 5, "NVTE_BSH3D": 6, "NVTE_BSHD_BS2HD": 7, "NVTE_BSHD_BSH2D": 8, "NVTE_BSHD_BSHD_BSHD": 9,
        "NVTE_T3HD": 10, "NVTE_TH3D": 11, "NVTE_THD_T2HD": 12, "NVTE_THD_TH2D": 13, "NVTE_THD_THD_THD": 14,
        "NVTE_SBHD_BSHD_BSHD": 15, "NVTE_BSHD_SBHD_SBHD": 16, "NVTE_THD_BSHD_BSHD": 17, "NVTE_THD_SBHD_SBHD": 18,
        "NVTE_Paged_KV_BSHD_BSHD_BSHD": 19, "NVTE_Paged_KV_BSHD_SBHD_SBHD": 20, "NVTE_Paged_KV_SBHD_BSHD_BSHD": 21,
        "NVTE_Paged_KV_SBHD_SBHD_SBHD": 22, "NVTE_Paged_KV_THD_BSHD_BSHD": 23, "NVTE_Paged_KV_THD_SBHD_SBHD": 24,
        "NVTE_BHSD_BHSD_BHSD": 25, "NVTE_QKV_Layout_NOT_SET": 26,
    },
    "NVTE_QKV_Layout_Group": {
        "NVTE_3HD": 0, "NVTE_H3D": 1, "NVTE_HD_2HD": 2, "NVTE_HD_H2D": 3, "NVTE_HD_HD_HD": 4,
        "NVTE_Paged_KV_HD_HD_HD": 5, "NVTE_SD_SD_SD": 6,
    },
    "NVTE_Bias_Type": {"NVTE_NO_BIAS": 0, "NVTE_PRE_SCALE_BIAS": 1, "NVTE_POST_SCALE_BIAS": 2, "NVTE_ALIBI": 3},
    "NVTE_Mask_Type": {
        "NVTE_NO_MASK": 0, "NVTE_PADDING_MASK": 1, "NVTE_CAUSAL_MASK": 2, "NVTE_PADDING_CAUSAL_MASK": 3,
        "NVTE_CAUSAL_BOTTOM_RIGHT_MASK": 4, "NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK": 5,
    },
    "NVTE_Softmax_Type": {"NVTE_VANILLA_SOFTMAX": 0, "NVTE_OFF_BY_ONE_SOFTMAX": 1, "NVTE_LEARNABLE_SOFTMAX": 2},
    "NVTE_Fused_Attn_Backend": {"NVTE_No_Backend": -1, "NVTE_F16_arbitrary_seqlen": 1, "NVTE_FP8": 2},
    "NVTE_Activation_Type": {
        "GELU": 0, "GEGLU": 1, "GLU": 2, "SILU": 3, "SWIGLU": 4, "RELU": 5, "REGLU": 6, "QGELU": 7,
        "QGEGLU": 8, "SRELU": 9, "SREGLU": 10, "CLAMPED_SWIGLU": 11,
    },
    "CommOverlapType": {"RS": 0, "AG": 1},
    "CommOverlapAlgo": {"BULK_OVERLAP_AG": 0, "BULK_OVERLAP_RS": 1},
    "NVTERoutingMapFormat": {"NVTE_ROUTING_MAP_DENSE": 0},
    "NVTEQBHistogramMode": {"NVTE_QB_HISTOGRAM_NONE": 0},
}  # fmt: skip
_CLASSES = ("CommOverlap", "CommOverlapP2P", "CommOverlapHelper", "CommOverlapCore", "CommOverlapP2PBase")


def _make_stand_in() -> types.ModuleType:
    mod = types.ModuleType(STAND_IN_NAME, "STRUCTURAL TIER stand-in for transformer_engine_torch (no kernels).")
    for name, members in _ENUMS.items():
        setattr(mod, name, _enum(name, members))
    for name in _CLASSES:
        setattr(mod, name, type(name, (_StandInClass,), {"__module__": STAND_IN_NAME}))

    def __getattr__(name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Kernel(name)  # every other attribute is a kernel

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    mod.get_cudnn_version = lambda: 91200  # read at import by version checks; 9.12.0
    mod.is_structural_stand_in = True
    return mod


STAND_IN = _make_stand_in()


# --------------------------------------------------------------------------- importing TE


def _fake_is_available() -> bool:
    return True


class _CudaToDevice(TorchFunctionMode):
    """Rewrites ``device="cuda"`` in torch calls to ``device`` (TE hard-codes it, e.g. DPA's softmax_offset)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self._device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        # An int is a CUDA device index (TE passes torch.cuda.current_device(), e.g. NVFP4's sign vectors).
        if dev is not None and (isinstance(dev, int) or torch.device(dev).type == "cuda"):
            kwargs["device"] = self._device
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_construction(device: str = "meta") -> Iterator[None]:
    """TE modules can be constructed inside this block; see [Note: the structural tier].

    ``torch.cuda.is_available`` reports True, ``current_device`` 0, ``synchronize`` does
    nothing, and torch calls with ``device="cuda"`` get ``device`` instead, only while the
    block runs.
    """
    names = ("is_available", "current_device", "get_device_capability", "synchronize")
    saved = {name: getattr(torch.cuda, name) for name in names}
    torch.cuda.is_available = _fake_is_available
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.synchronize = lambda *a, **k: None  # TE's get/set_extra_state synchronize
    try:
        with _CudaToDevice(device):
            yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


@contextlib.contextmanager
def no_cuda_sync() -> Iterator[None]:
    """``torch.cuda.synchronize`` does nothing inside (TE's get_extra_state calls it); nothing else changes."""
    saved = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.synchronize = saved


_TE: types.ModuleType | None = None


def import_te() -> types.ModuleType:
    """``transformer_engine.pytorch`` (real Python code, stand-in extension). Cached per process."""
    global _TE
    if _TE is not None:
        return _TE
    info = ensure_te_sources()
    path = info["path"]
    if path not in sys.path:
        sys.path.insert(0, path)
    os.environ["NVTE_PROJECT_BUILDING"] = "1"  # common/__init__: skip ctypes loads of CUDA libraries
    os.environ.pop("NVTE_RELEASE_BUILD", None)
    sys.modules["transformer_engine_torch"] = STAND_IN
    with warnings.catch_warnings():
        # transformer_engine/__init__ tries `from . import pytorch` with the REAL
        # load_framework_extension first, which finds no .so and warns; the import below redoes it.
        warnings.simplefilter("ignore", RuntimeWarning)
        common = importlib.import_module("transformer_engine.common")

    def load_framework_extension(framework: str) -> None:
        # The real one loads transformer_engine_torch*.so; the stand-in is already in sys.modules.
        if framework != "torch":
            raise ImportError(f"structural tier: only the torch extension is stood in, not {framework}")

    common.load_framework_extension = load_framework_extension
    try:
        with cuda_construction():
            te = importlib.import_module("transformer_engine.pytorch")
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"structural tier: TransformerEngine {TE_VERSION}'s Python code imports {err.name!r}, which is not "
            f"installed; install the te-structural extra: {EXTRA_HINT}",
            name=err.name,
        ) from err
    _TE = te
    return te
