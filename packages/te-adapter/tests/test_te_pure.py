"""Pure tier: everything of the adapter that needs no TE (placement table, patch plan, records)."""

from __future__ import annotations

import dataclasses
import enum
import subprocess
import sys

import pytest
from shardbridge.tp import TPMode
from shardbridge_te._checkpoint import (
    EXTRA_STATE_FORMAT,
    decode_extra_state,
    encode_extra_state,
    is_portable_extra_state,
    recipe_from_record,
    recipe_to_record,
)
from shardbridge_te._compat import parse_version
from shardbridge_te._patches import MIN_VERSION, PATCHES, Patch, patch_plan
from shardbridge_te._placements import MODULE_KINDS, param_kind, tp_mode

C, R, N = TPMode.COLUMN, TPMode.ROW, TPMode.NONE


@pytest.mark.parametrize(
    "kind,mode,name,want",
    [
        ("Linear", "column", "weight", C), ("Linear", "column", "bias", C),
        ("Linear", "row", "weight", R), ("Linear", "row", "bias", N),
        ("Linear", None, "weight", N), ("Linear", "column", "query_weight", C),
        ("LayerNormLinear", "column", "layer_norm_weight", N), ("LayerNormLinear", "row", "layer_norm_bias", C),
        ("LayerNormMLP", None, "fc1_weight", C), ("LayerNormMLP", None, "fc1_bias", C),
        ("LayerNormMLP", None, "fc2_weight", R), ("LayerNormMLP", None, "fc2_bias", N),
        ("LayerNormMLP", None, "layer_norm_weight", N),
        ("LayerNorm", None, "weight", N), ("RMSNorm", None, "weight", N),
        ("DotProductAttention", None, "softmax_offset", C),
        ("GroupedLinear", "column", "weight3", C), ("GroupedLinear", "row", "weight0", R),
        ("GroupedLinear", "column", "bias1", C), ("GroupedLinear", "row", "bias1", N),
    ],
)  # fmt: skip
def test_table(kind, mode, name, want) -> None:
    assert tp_mode(kind, mode, True, name) is want


@pytest.mark.parametrize("kind", MODULE_KINDS)
def test_not_sharded_is_always_replicate(kind) -> None:
    name = {"DotProductAttention": "softmax_offset", "LayerNormMLP": "fc1_weight"}.get(kind, "weight")
    assert tp_mode(kind, None, False, name) is N


def test_param_kind() -> None:
    assert [param_kind(n) for n in ("weight", "bias12", "key_bias", "layer_norm_weight", "softmax_offset")] == [
        "weight", "bias", "bias", "layer_norm", "other"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "args,match",
    [
        (("Conv", None, True, "weight"), "no placement rule"),
        (("Linear", "diagonal", True, "weight"), "parallel_mode"),
        (("LayerNormMLP", None, True, "fc3_weight"), "fc3_weight"),
        (("Linear", "column", True, "scale"), "neither a weight nor a bias"),
        (("DotProductAttention", None, True, "weight"), "softmax_offset"),
    ],
)
def test_table_errors(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        tp_mode(*args)


def test_patch_plan_names_upstream_and_gates_versions() -> None:
    assert all(("TE PR #" in p.covers or "TE #" in p.covers) for p in PATCHES)
    assert [p.name for p in patch_plan((2, 20, 2))] == [p.name for p in PATCHES]
    fixed = Patch(name="x", covers="TE #1", what="-", fixed_in=(2, 21, 0))
    assert fixed.applies((2, 20, 9)) and not fixed.applies((2, 21, 0))
    with pytest.raises(ValueError, match="older than the supported"):
        patch_plan((MIN_VERSION[0], MIN_VERSION[1] - 1, 0))


def test_parse_version() -> None:
    assert parse_version("2.20.2") == (2, 20, 2)
    assert parse_version("2.8.0.dev0+cu12") == (2, 8, 0)
    assert parse_version("3.1") == (3, 1, 0)
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        parse_version("main")


class Fmt(enum.Enum):
    HYBRID = 2


@dataclasses.dataclass
class FakeRecipe:  # shaped like TE's DelayedScaling (a dataclass with an enum field)
    margin: int = 0
    fp8_format: Fmt = Fmt.HYBRID
    amax_compute_algo: object = "max"


def test_recipe_record_round_trip() -> None:
    rec = recipe_to_record(FakeRecipe(margin=3))
    assert rec == {
        "class": "FakeRecipe",
        "fields": {"margin": 3, "fp8_format": {"enum": "Fmt", "name": "HYBRID"}, "amax_compute_algo": "max"},
    }
    assert recipe_from_record(rec, sys.modules[__name__]) == FakeRecipe(margin=3)
    with pytest.raises(ValueError, match="amax_compute_algo"):
        recipe_to_record(FakeRecipe(amax_compute_algo=max))


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"class": "system", "fields": {}}, r"'system' is not a public name"),  # not in the module
        ({"class": "_private", "fields": {}}, r"'_private' is not a public name"),
        ({"class": "Fmt", "fields": {}}, r"'Fmt' is not a recipe class"),  # public, not a dataclass
        ({"class": "FakeRecipe", "fields": {"fp8_format": {"enum": "FakeRecipe", "name": "x"}}}, r"not an enum member"),
        ({"class": "FakeRecipe", "fields": {"fp8_format": {"enum": "Fmt", "name": "mro"}}}, r"not an enum member"),
        ({"class": "FakeRecipe", "fields": {"margin": [1, 2]}}, r"field 'margin' is not plain data"),
        ({"class": "FakeRecipe", "fields": None}, r"not a recipe record"),
    ],
)
def test_recipe_record_from_a_checkpoint_is_untrusted(record, match) -> None:
    """A crafted record can neither call nor reach anything but the module's recipes and enums."""
    with pytest.raises(ValueError, match=match):
        recipe_from_record(record, sys.modules[__name__])


_private = FakeRecipe  # a dataclass under a private name: still refused


def test_extra_state_bytes_are_weights_only_and_tagged() -> None:
    import torch

    state = {"recipe": FakeRecipe(), "scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(4, 3),
             "extra_fp8_variables": {"num_gemms": 1, "obj": object()}}  # fmt: skip
    data = encode_extra_state(state)
    assert isinstance(data, bytes) and is_portable_extra_state(data)
    payload = decode_extra_state(data)
    assert payload["format"] == EXTRA_STATE_FORMAT and payload["extra"] == {"num_gemms": 1}
    assert torch.equal(payload["tensors"]["scale_fwd"], torch.ones(3))
    assert not is_portable_extra_state(torch.empty(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not a shardbridge_te"):
        import io

        buf = io.BytesIO()
        torch.save({"format": "other"}, buf)
        decode_extra_state(buf.getvalue())


def test_import_without_te_gives_install_hint() -> None:
    code = (
        "import shardbridge_te, sys\n"
        "assert not any(m.startswith('transformer_engine') for m in sys.modules)\n"
        "try:\n    shardbridge_te.te_version()\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # the TE packages themselves, and the extra as it installs from a clone ([Note: install hints])
    assert '"transformer_engine[pytorch]' in out and 'pip install -e ".[te]"' in out, out


class _PreAllGatherHost:
    """A minimal class with TE 2.20.2's ``Float8Tensor.fsdp_pre_all_gather`` contract (float8_tensor.py:966:
    with a mesh, the amax group becomes ``mesh.get_group()``; with None it is left alone). Not TE:
    this tests only the wrapper's logic; the real class is patched on GPU."""

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        if mesh is not None:
            self.amax_reduction_group = mesh
        return ("gathered", mesh)


def test_float8_pre_all_gather_patch_keeps_pinned_group_and_undoes() -> None:
    from shardbridge_te._patches import patch_float8_pre_all_gather

    original = _PreAllGatherHost.fsdp_pre_all_gather
    undo = patch_float8_pre_all_gather(_PreAllGatherHost)
    try:
        assert patch_float8_pre_all_gather(_PreAllGatherHost)() is None  # second patch: no-op undo
        free, pinned = _PreAllGatherHost(), _PreAllGatherHost()
        pinned._shardbridge_amax_group = "weight-group"
        assert free.fsdp_pre_all_gather("fsdp-mesh", 0, 0, None, None) == ("gathered", "fsdp-mesh")
        assert free.amax_reduction_group == "fsdp-mesh"  # unpinned tensors: TE's behaviour unchanged
        assert pinned.fsdp_pre_all_gather("fsdp-mesh", 0, 0, None, None) == ("gathered", None)
        assert pinned.amax_reduction_group == "weight-group"
    finally:
        undo()
    assert _PreAllGatherHost.fsdp_pre_all_gather is original


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_each_patch_is_gated_by_its_checked_range(patch) -> None:
    from shardbridge_te._patches import gate

    low, high = patch.checked
    assert patch.target and patch.undo and ("TE PR #" in patch.covers or "TE #" in patch.covers)
    assert gate(patch.name, low) and gate(patch.name, high)  # inside: applied
    newer = (high[0], high[1] + 1, 0)
    if patch.outside == "error":
        with pytest.raises(
            RuntimeError, match=rf"'{patch.name}'.*checked against TransformerEngine 2\.8\.0 to 2\.20\.2"
        ):
            gate(patch.name, newer)
    else:
        with pytest.warns(UserWarning, match=rf"'{patch.name}'.*the patch is skipped"):
            assert gate(patch.name, newer) is False
    with pytest.raises(ValueError, match="older than the supported"):
        gate(patch.name, (2, 7, 9))


def test_gate_skips_a_patch_whose_fix_is_released(monkeypatch) -> None:
    from shardbridge_te import _patches

    fixed = dataclasses.replace(PATCHES[1], fixed_in=(2, 20, 0))
    monkeypatch.setattr(_patches, "PATCHES", (PATCHES[0], fixed, *PATCHES[2:]))
    assert _patches.gate("local_forward", (2, 20, 2)) is False
    assert _patches.gate("local_forward", (2, 19, 0)) is True
    with pytest.raises(KeyError, match="no TE patch named 'nope'"):
        _patches.gate("nope", (2, 20, 2))


def test_patch_attr_undo_restores_the_identical_attribute() -> None:
    from shardbridge_te._patches import patch_attr

    class Host:
        @staticmethod
        def f():
            return "class"

    raw = vars(Host)["f"]  # the staticmethod object itself
    undo = patch_attr(Host, "f", lambda: "patched")
    assert Host.f() == "patched"
    undo()
    assert vars(Host)["f"] is raw
    host = Host()
    undo = patch_attr(host, "f", lambda: "instance")
    assert host.f() == "instance"
    undo()
    assert "f" not in vars(host) and host.f() == "class"


def test_float8_class_patch_undo_is_kept_and_unpatch_restores_it() -> None:
    from shardbridge_te import _patches, unpatch

    original = vars(_PreAllGatherHost)["fsdp_pre_all_gather"]
    assert "float8_pre_all_gather_amax_group" not in _patches._CLASS_UNDO
    _patches.apply_float8_pre_all_gather(_PreAllGatherHost)
    _patches.apply_float8_pre_all_gather(_PreAllGatherHost)  # once per process
    try:
        assert vars(_PreAllGatherHost)["fsdp_pre_all_gather"] is not original
        assert list(_patches._CLASS_UNDO) == ["float8_pre_all_gather_amax_group"]
    finally:
        assert unpatch() == ["float8_pre_all_gather_amax_group"]
    assert vars(_PreAllGatherHost)["fsdp_pre_all_gather"] is original
    assert unpatch() == []


# --------------------------------------------------------------------------- the FP8 backend (pure)


def test_te_backend_is_registered_and_maps_every_recipe():
    import sys

    from shardbridge.fp8 import FP8Recipe, get_backend
    from shardbridge_te import TEBackend, recipe_spec

    assert isinstance(get_backend("te"), TEBackend)
    assert "transformer_engine" not in sys.modules  # check() and recipe_spec() import no TE
    want = {
        "tensorwise": ("Float8CurrentScaling", {"fp8_format": "HYBRID"}),
        "delayed": (
            "DelayedScaling",
            {"fp8_format": "HYBRID", "amax_history_len": 1024, "amax_compute_algo": "most_recent", "margin": 0},
        ),
        "mxfp8": ("MXFP8BlockScaling", {"fp8_format": "E4M3", "margin": 0}),
        "blockwise": ("Float8BlockScaling", {"fp8_format": "E4M3"}),
        "nvfp4": ("NVFP4BlockScaling", {}),
    }
    for name, spec in want.items():
        recipe = FP8Recipe(backend="te", name=name)
        get_backend("te").check(recipe)
        assert recipe_spec(recipe) == spec


def test_te_backend_refuses_by_name():
    import pytest
    from shardbridge.fp8 import FP8Recipe, get_backend

    te = get_backend("te")
    with pytest.raises(ValueError, match=r"'rowwise' is not supported by backend 'te'.*\['torchao'\] run 'rowwise'"):
        te.check(FP8Recipe(backend="te", name="rowwise"))
    with pytest.raises(ValueError, match=r"fp8.params.margin: TE recipe 'nvfp4' \(NVFP4BlockScaling\) takes no parameters"):
        te.check(FP8Recipe(backend="te", name="nvfp4", params={"margin": 1}))
    with pytest.raises(ValueError, match=r"fp8.params.amax_compute_algo='mean': choose one of \['max', 'most_recent'\]"):
        te.check(FP8Recipe(backend="te", name="delayed", params={"amax_compute_algo": "mean"}))
    with pytest.raises(ValueError, match=r"all_gather_fp8=true with backend te needs fp8_params: true"):
        te.check(FP8Recipe(backend="te", all_gather_fp8=True))


def test_parallelize_refuses_a_non_te_fp8_recipe_by_name():
    import pytest
    import shardbridge_te
    from shardbridge.fp8 import FP8Recipe
    from torch import nn

    recipe = FP8Recipe(backend="torchao", name="rowwise")
    with pytest.raises(NotImplementedError, match=r"shardbridge_te.parallelize runs TransformerEngine modules.*backend='te'"):
        shardbridge_te.parallelize(nn.Linear(2, 2), None, fp8=recipe)
    with pytest.raises(ValueError, match=r"FP8 parameters of backend 'torchao'; only TE builds FP8 parameters"):
        shardbridge_te.model_init_context(FP8Recipe(backend="torchao", name="rowwise", fp8_params=True))
    with shardbridge_te.model_init_context(FP8Recipe(backend="te", name="delayed")):  # no fp8_params: a no-op, no TE
        pass
