"""[Note: bounded structure] in ``shardbridge/_json.py``: JSON measured before it is parsed."""

from __future__ import annotations

import json

import pytest
from shardbridge._json import MAX_DEPTH, depth, loads


@pytest.mark.parametrize(
    ("text", "levels"),
    [
        ("1", 0),
        ("{}", 1),
        ('[[1], {"a": [2, [3]]}]', 4),
        ('"[[[{{{"', 0),  # brackets inside strings do not nest
        ('["a\\"[[", {"b": "\\\\"}, ["]"]]', 2),  # escaped quotes and backslashes
        ('{"k": "\\u005b\\u005b"}', 1),
    ],
)
def test_depth_counts_brackets_outside_strings(text, levels):
    assert json.loads(text) is not None or text == "null"
    assert depth(text.encode()) == levels


def test_loads_refuses_by_name_past_either_bound():
    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH, "x.json") == json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)
    with pytest.raises(ValueError, match=rf"x\.json nests arrays and objects {MAX_DEPTH + 1} deep, more than the {MAX_DEPTH}"):
        loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "x.json")
    with pytest.raises(ValueError, match=r"x\.json is 11 bytes, more than the 10 this reader takes"):
        loads('{"a": "bc"}', "x.json", max_bytes=10)
    with pytest.raises(json.JSONDecodeError):
        loads('{"a": ', "x.json")
