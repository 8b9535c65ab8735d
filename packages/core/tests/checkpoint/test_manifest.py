"""Tier 1: shardbridge.json parsing/validation and the JSON check of user extras."""

from __future__ import annotations

import json

import pytest
from shardbridge.checkpoint._manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, check_json_extra, read_manifest


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
