"""Tier 1: shardbridge.json parsing/validation and the JSON check of user extras."""

from __future__ import annotations

import json

import pytest
from shardbridge.checkpoint.storage._local import LOCAL
from shardbridge.checkpoint.storage._manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, check_json_extra
from shardbridge.checkpoint.storage._manifest import read_manifest as _read_manifest


def read_manifest(path):
    return _read_manifest(LOCAL, str(path))


def _manifest(**overrides):
    fields = dict(step=3, world_size=4, has_optimizer=True, extra={"a": [1, 2.5, None]}, torch_version="2.13.0")
    fields.update(overrides)
    return Manifest(**fields)


def test_json_round_trip():
    m = _manifest()
    text = m.to_json()
    assert text.isascii() and json.loads(text)["format"] == "shardbridge.checkpoint"
    assert Manifest.from_json(text, "x") == m


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"format": "shardbridge.checkpoint", "step"', "is not valid JSON"),
        ('{"format": "other"}', "is not a shardbridge checkpoint manifest"),
        ('{"format": "shardbridge.checkpoint", "format_version": 99}', "newer than this shardbridge reads"),
        ('{"format": "shardbridge.checkpoint", "format_version": 1}', "missing 'step'"),
    ],
)
def test_invalid_manifests_are_rejected(text, match):
    with pytest.raises(ValueError, match=match):
        Manifest.from_json(text, "m.json")


def test_read_manifest_explains_what_the_directory_is(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_manifest(tmp_path / "none")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file; pass the checkpoint directory"):
        read_manifest(tmp_path / "file")
    with pytest.raises(ValueError, match="no shardbridge.json.*pass a directory written by"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text(_manifest().to_json())
    with pytest.raises(ValueError, match="no DCP .metadata; the checkpoint is damaged"):
        read_manifest(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"")
    assert read_manifest(tmp_path).format_version == FORMAT_VERSION


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"ok": 1, "bad": {"inner": {1, 2}}}, r"extra\['bad'\]\['inner'\] is a set"),
        ({"t": [1, object()]}, r"extra\['t'\]\[1\] is a object"),
        ({"nan": float("nan")}, r"extra\['nan'\] is nan, which strict JSON cannot store"),
        ({3: "x"}, r"extra has a key 3 of type int; JSON keys must be str"),
    ],
)
def test_extra_must_be_json(extra, match):
    with pytest.raises(ValueError, match=match):
        check_json_extra(extra)


def test_json_extra_accepts_plain_values():
    check_json_extra({"a": [1, 2.0, "s", True, None, {"b": (1, 2)}]})


_GOOD_LAYOUT = {
    "parallel_dims": {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2},
    "mesh_axes": {"dp_shard": 2, "tp": 2},
    "tensors": {"model.w": {"mesh": {"tp": 2}, "placements": ["Shard(dim=0)"], "stored_as": "dtensor"}},
}
_GOOD_FUSED = {"w": {"dim": 0, "tp_size": 2, "components": [{"name": "gate", "size": 4, "fqn": "w.gate"}]}}


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("world_size", 0, r"world_size=0 must be an int >= 1"),
        ("world_size", True, r"world_size=True must be an int >= 1"),
        ("step", -1, r"step=-1 must be an int >= 0 or null"),
        ("format_version", True, r"format_version"),
        ("layout", {"mesh_axes": {"tp": "2"}}, r"layout.mesh_axes\['tp'\]='2' must be an int >= 1"),
        ("layout", {"parallel_dims": [1, 2]}, r"layout.parallel_dims=\[1, 2\] must be an object"),
        ("layout", {"tensors": {"model.w": {"placements": "S(0)"}}}, r"layout.tensors\['model.w'\]="),
        ("fused", {"w": {"dim": 0, "tp_size": 0, "components": []}}, r"fused\['w'\]=.*tp_size.*int >= 1"),
        ("fused", {"w": {"dim": 0, "tp_size": 2, "components": [{"name": "g"}]}}, r"fused\['w'\]="),
        ("rng", {"world_size": -2, "files": "rng/x"}, r"rng.world_size=-2 must be an int >= 1"),
        ("rng", {"world_size": 1, "files": 5}, r"rng.files=5 must be a str"),
    ],
)
def test_manifest_values_and_substructure_are_validated(field, value, match):
    # Format 2 (no file records, no self-checksum): the values are checked in every format.
    data = {
        "format": "shardbridge.checkpoint",
        "format_version": 2,
        "step": 3,
        "world_size": 4,
        "has_optimizer": True,
        "layout": _GOOD_LAYOUT,
        "fused": _GOOD_FUSED,
        "extra": {},
        "rng": {"world_size": 4, "files": "rng/rank-{rank:05d}.pt"},
        "torch_version": "2.13.0",
        "shardbridge_version": "0.1.0",
        "created": "2026-11-23T00:00:00+00:00",
    }
    Manifest.from_json(json.dumps(data), "m.json")  # the good one parses
    data[field] = value
    with pytest.raises(ValueError, match=match) as info:
        Manifest.from_json(json.dumps(data), "m.json")
    assert str(info.value).startswith("m.json")


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({"../x": {"size": 1, "xxh3_128": "0" * 32}}, "not a plain relative file name"),
        ({"/etc/passwd": {"size": 1, "xxh3_128": "0" * 32}}, "not a plain relative file name"),
        ({"rng//a": {"size": 1, "xxh3_128": "0" * 32}}, "not a plain relative file name"),
        ({MANIFEST_NAME: {"size": 1, "xxh3_128": "0" * 32}}, "must not record the manifest"),
        ({"a": {"size": -1, "xxh3_128": "0" * 32}}, r"\['size'\] = -1 must be an int >= 0"),
        ({"a": {"size": True, "xxh3_128": "0" * 32}}, r"\['size'\] = True must be an int >= 0"),
        ({"a": {"size": 1, "xxh3_128": "XYZ"}}, "must be 32 lowercase hex digits"),
        ({"a": {"size": 1}}, "must be {'size': int"),
        ([], "no 'files' record"),
    ],
)
def test_files_record_is_validated_strictly(files, match):
    """Format 3: every name inside the checkpoint, sizes ints >= 0, checksums hex (the
    manifest's own checksum is recomputed so that only the record is wrong)."""
    from shardbridge.checkpoint.storage._manifest import SELF_CHECKSUM_KEY, _self_checksum

    data = json.loads(_manifest().to_json())
    data["files"] = files
    data[SELF_CHECKSUM_KEY] = _self_checksum(data)
    with pytest.raises(ValueError, match=match):
        Manifest.from_json(json.dumps(data), "m.json")


def test_manifest_checksum_refuses_an_edited_manifest():
    data = json.loads(_manifest().to_json())
    data["step"] = 4
    with pytest.raises(ValueError, match="does not match its own checksum"):
        Manifest.from_json(json.dumps(data), "m.json")
    # Formats 1 and 2 have neither: their "files" (if any) are ignored.
    old = {k: v for k, v in data.items() if k != "manifest_xxh3_128"}
    assert Manifest.from_json(json.dumps({**old, "format_version": 2}), "m.json").files == {}


# [Note: bounded structure] in shardbridge/_json.py (issue 42)


def test_a_manifest_nesting_past_the_bound_is_refused_by_name():
    deep = '{"format": "shardbridge.checkpoint", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(ValueError, match=r"m\.json nests arrays and objects 100001 deep, more than the 64"):
        Manifest.from_json(deep, "m.json")  # before: RecursionError


def test_extra_nested_past_what_a_reader_takes_is_refused_at_save():
    extra: dict = {}
    inner = extra
    for _ in range(70):
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(ValueError, match=r"extra\['a'\].* nests dicts and lists more than 63 deep.*flatten it"):
        check_json_extra(extra)
    looped: dict = {}
    looped["self"] = looped  # before: RecursionError
    with pytest.raises(ValueError, match="nests dicts and lists more than 63 deep"):
        check_json_extra(looped)
    ok: dict = {}
    inner = ok
    for _ in range(62):
        inner["a"] = {}
        inner = inner["a"]
    check_json_extra(ok)  # 63 levels: the manifest holding it nests 64, what its reader takes
    assert Manifest.from_json(_manifest(extra=ok).to_json(), "m.json").extra == ok
