"""Checkpoint paths and URIs ([Note: checkpoint URIs] in ``storage/_location.py``): a typo in a URI is
refused by name with the URI meant, never taken for a local folder (which ``save`` would create and
``latest`` would find empty: training silently restarting from scratch)."""

from __future__ import annotations

import os

import pytest
from ckpt_helpers import Mlp
from shardbridge import checkpoint as ck
from shardbridge.checkpoint.storage._location import locate

# (typed, what the error must say): every malformed form of each object-store scheme is generated below
_FORMS = {
    "{s}:/b/run": r"is not a URI \(a scheme needs '://'\): did you mean '{s}://b/run'\?",
    "{s}:b/run": r"is not a URI \(a scheme needs '://'\): did you mean '{s}://b/run'\?",
    "{s}//b/run": r"is not a URI \(a scheme needs '://'\): did you mean '{s}://b/run'\?",
    "{S}://b/run": r"has an upper-case scheme \(fsspec knows no '{S}': schemes are case-sensitive\); write '{s}://b/run'",
    "{S}:/b/run": r"is not a URI \(a scheme needs '://'\): did you mean '{s}://b/run'\?",
    "{s}://": r"names no bucket; write {s}://BUCKET/PREFIX",
    "{s}:///run": r"names no bucket; write {s}://BUCKET/PREFIX",
    " {s}://b/run": r"has white space around it; write '{s}://b/run'",
    "{s}://b/run\n": r"has white space around it; write '{s}://b/run'",
}
_SCHEMES = ["s3", "gs", "az"]
CASES = [(form.format(s=s, S=s.upper()), want.format(s=s, S=s.upper())) for s in _SCHEMES for form, want in _FORMS.items()]
CASES += [
    ("s4://b/run", r"fsspec knows no filesystem for the scheme 's4'; did you mean 's3'\?"),
    ("file:/tmp/run", r"did you mean 'file:///tmp/run'\?"),
]


@pytest.mark.parametrize(("typed", "want"), CASES, ids=[repr(c[0]) for c in CASES])
def test_a_malformed_uri_is_refused_by_name(typed, want):
    with pytest.raises(ValueError, match=want) as info:
        locate(typed)
    assert "\n" not in str(info.value)


def test_every_verb_refuses_a_typo_and_creates_nothing(tmp_path, monkeypatch):
    """``save`` of ``s3:/b/run`` made a local folder ``s3:``; ``latest`` / ``load_latest`` answered None."""
    monkeypatch.chdir(tmp_path)
    for typed in ("s3:/b/run/step-00000001", "s3//b/run", "S3://b/run"):
        verbs = {
            "save": lambda p=typed: ck.save(p, model=Mlp()),
            "latest": lambda p=typed: ck.latest(p),
            "load_latest": lambda p=typed: ck.load_latest(p, model=Mlp()),
            "load": lambda p=typed: ck.load(p, model=Mlp()),
            "verify": lambda p=typed: ck.verify(p),
            "inspect": lambda p=typed: ck.inspect(p),
            "step_dir + save": lambda p=typed: ck.save(ck.step_dir(p, 3), model=Mlp()),
            "export out_dir": lambda p=typed: ck.export_safetensors(str(tmp_path / "none"), p),
        }
        for verb, call in verbs.items():
            with pytest.raises(ValueError, match=r"is not a URI|upper-case scheme") as info:
                call()
            assert "s3://b/run" in str(info.value), (verb, typed, info.value)
    assert os.listdir(tmp_path) == []


def test_a_local_path_with_a_colon_elsewhere_still_works(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in ("runs/exp:1", str(tmp_path / "s3:" / "b")):  # a colon inside; an absolute path
        saved = ck.save(ck.step_dir(path, 1), model=Mlp(), step=1)
        assert ck.latest(path) == saved and ck.load_latest(path, model=Mlp()).step == 1
