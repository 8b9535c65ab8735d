"""The docs describe today's code (tier 1): [Note: docs that cannot drift] in tools/docs_architecture.py.

Lists the code can produce (modules, every public ``__all__``, deprecated names, mesh axes,
the checkpoint's layers, nox sessions, CLI verbs) are generated blocks; this test fails when
the code changed and a page did not (run ``python tools/docs_architecture.py``). Prose that
names code (a backticked Python path, file or repository path, a ``[Note: ...]``) must name
something that exists and is not a deprecated alias.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("docs_architecture", REPO / "tools" / "docs_architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_blocks_match_the_code_and_prose_names_what_exists(tool):
    assert tool.problems() == [], "run python tools/docs_architecture.py, then fix the prose it names"


def test_every_required_block_is_there(tool):
    for page, keys in tool.REQUIRED.items():
        present = tool.blocks((REPO / page).read_text(encoding="utf-8"))
        assert set(keys) <= set(present), page
    arch = tool.blocks(tool.DOC.read_text(encoding="utf-8"))
    for axis in ("`ep`", "`efsdp`", "`dp_shard_cp`", "`weight`"):
        assert axis in arch["mesh-axes"]
    assert "`shardbridge.adapters`" in arch["public-names"]


def test_the_check_sees_drift(tool):
    """Guard against a vacuous pass: a stale list, a deleted path, a bad name, each is found."""
    text = tool.DOC.read_text(encoding="utf-8")
    assert "`PrecisionPolicy`" in text and "`packages/core/src/shardbridge/_wrap.py`" in text
    assert "public-names" in tool.drifted(text.replace("`PrecisionPolicy`, ", "", 1))
    assert "mesh-axes" in tool.drifted(text.replace("| `efsdp` |", "| `efsdp_old` |", 1))
    layers = (REPO / "docs" / "checkpoints.md").read_text(encoding="utf-8")
    assert "checkpoint-layers" in tool.drifted(layers.replace("`_repair.py`", "`_fix.py`", 1), "docs/checkpoints.md")
    assert "names shardbridge.checkpoint" in tool.drifted(layers.replace("`verify`, ", "", 1), "docs/checkpoints.md")
    with pytest.raises(ValueError, match="has no generated block"):
        tool.render(layers.replace("<!-- generated: checkpoint-layers", "<!-- gone", 1), "docs/checkpoints.md")
    assert tool.missing_paths(text + "\n`packages/core/src/shardbridge/_fp8.py`\n") == [
        "packages/core/src/shardbridge/_fp8.py"
    ]


def test_the_name_check_sees_each_kind_of_bad_name(tool):
    prose = "\n".join(
        [
            "`shardbridge.cp.cp_split` and `shardbridge.checkpoint.save(path, ...)` exist;",  # 1 fine
            "`shardbridge.ParallelDims.build_mesh` and `shardbridge.ParallelDims.dp_shard` too;",  # 2 fine
            "`shardbridge.json` is a string the code uses, `fp8.refresh(model)` a call;",  # 3 fine
            "`shardbridge.cp_split(batch)` moved;",  # 4 deprecated
            "`shardbridge.checkpoint.no_such_verb` never was;",  # 5 missing
            "`fp8.no_such_hook(model)` neither;",  # 6 missing (short form of a call)
            "`state/_provider.py` exists, `checkpoint/_gone.py` and `_gone.py` do not;",  # 7 two files
            "`torch/distributed/fsdp/_fully_shard/_fsdp_param.py` is upstream: not checked;",  # 8 fine
            "```python",
            "shardbridge.cp_split  # code blocks run in the docs test instead",
            "```",
            "[Note: deprecated aliases] exists, [Note: no such note] does not.",
            '`ValueError` ("pass optimizer=None to load the model only") is the code\'s,',
            '`ValueError` ("pass optimizer=None to load every tensor of it") is not;',
            "`ValueError: a message from upstream` is not checked.",
        ]
    )
    found = tool.bad_names(prose, "x.md")
    assert [f.split(": ", 1)[0] for f in found] == ["x.md:4", "x.md:5", "x.md:6", "x.md:7", "x.md:7", "x.md", "x.md"]
    assert "name `shardbridge.cp.cp_split`" in found[0]
    assert "'to load every tensor of it' is in no string" in found[-2]
    assert "[Note: no such note]" in found[-1]
    assert tool.message_pieces("checkpoint '/c/step-2' is damaged: __0_0.distcp: checksum mismatch (x); not 3 loading it") == [
        "is damaged: __0_0.distcp: checksum mismatch"
    ]
