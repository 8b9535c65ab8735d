"""shardbridge._checks: argument checks of entry points and did-you-mean (tier 1)."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardbridge import PrecisionPolicy
from shardbridge._checks import checked_args, did_you_mean, edit_distance
from torch import nn


@functools.cache
def _oracle(a: str, b: str) -> int:
    """Edit distance by plain recursion (insert, delete, substitute, swap two neighbours): the definition itself."""
    if not a or not b:
        return len(a) + len(b)
    best = min(_oracle(a[1:], b) + 1, _oracle(a, b[1:]) + 1, _oracle(a[1:], b[1:]) + (a[0] != b[0]))
    if len(a) > 1 and len(b) > 1 and a[0] == b[1] and a[1] == b[0]:
        best = min(best, _oracle(a[2:], b[2:]) + 1)
    return best


@settings(max_examples=300, deadline=None)
@given(st.text("abc_", max_size=7), st.text("abc_", max_size=7))
def test_edit_distance_matches_the_definition(a, b):
    assert edit_distance(a, b) == _oracle(a, b) == edit_distance(b, a)


@pytest.mark.parametrize(
    ("name", "known", "expected"),
    [
        ("parallelism_config_tp_sise", ["parallelism_config_tp_size", "parallelism_config_cp_size"], "; did you mean 'parallelism_config_tp_size'?"),
        ("xp_size", ["tp_size", "cp_size", "dp_shard_size"], "; did you mean 'cp_size' or 'tp_size'?"),  # equally near: both
        ("Precision", ["precision"], "; did you mean 'precision'?"),  # case
        ("banana", ["precision", "fp8"], ""),  # nothing near: no guess
        (3, ["precision"], ""),
    ],
)  # fmt: skip
def test_did_you_mean(name, known, expected):
    assert did_you_mean(name, known) == expected


@checked_args(model=nn.Module, mesh=(int, None), policy=(PrecisionPolicy, None))
def _entry(model, mesh=None, policy=None, *, scale: float = 1.0):
    """An entry point."""
    return model, mesh, policy


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: _entry(3, nn.Linear(1, 1)), r"^_entry\(model=\.\.\.\): expected a Module, got an int; were `model` and `mesh` swapped\?$"),
        (lambda: _entry(nn.Linear(1, 1), policy=PrecisionPolicy.bf16), r"got the method PrecisionPolicy\.bf16; pass PrecisionPolicy\.bf16\(\) \(call it\)$"),
        (lambda: _entry(nn.Linear(1, 1), policy=PrecisionPolicy), r"got the class PrecisionPolicy; pass an instance"),
        (lambda: _entry(nn.Linear(1, 1), policy="bf16"), r"pass PrecisionPolicy\.from_name\('bf16'\)$"),
        (lambda: _entry(nn.Linear(1, 1), policy=torch.distributed.fsdp.MixedPrecisionPolicy()), r"that is torch's FSDP2 class"),
        (lambda: _entry(nn.Linear), r"^_entry\(model=\.\.\.\): expected a Module, got the class Linear; pass an instance"),
    ],
)  # fmt: skip
def test_checked_args_names_the_parameter_and_the_fix(call, message):
    with pytest.raises(TypeError, match=message):
        call()


def test_checked_args_passes_good_calls_and_keeps_the_function_s_face():
    linear = nn.Linear(1, 1)
    assert _entry(linear) == (linear, None, None)  # None where None is allowed
    assert _entry(linear, 2, PrecisionPolicy.bf16(), scale=2.0)[1:] == (2, PrecisionPolicy.bf16())
    assert inspect.signature(_entry) == inspect.signature(_entry.__wrapped__) and _entry.__doc__ == "An entry point."
    with pytest.raises(TypeError, match="missing a required argument|missing 1 required"):  # Python's own message
        _entry()
    with pytest.raises(AssertionError, match=r"no parameter\(s\) \['modle'\]"):  # a typo in the declaration itself
        checked_args(modle=nn.Module)(_entry.__wrapped__)


def test_every_checked_entry_point_declares_real_parameters():
    """The decorator is applied where the issue asked: entry points taking modules, meshes, policies, configs."""
    import shardbridge
    import shardbridge.cp
    import shardbridge.ep
    import shardbridge.fp8
    import shardbridge.fused
    import shardbridge.models
    import shardbridge.tp

    checked = [
        name
        for module in (shardbridge, shardbridge.models, shardbridge.fp8, shardbridge.tp, shardbridge.cp, shardbridge.ep, shardbridge.fused)
        for name in module.__all__
        if getattr(getattr(module, name), "__wrapped__", None) is not None
    ]
    for name in ("apply_fsdp", "parallelize_llama", "apply_llama_tp", "parallelize_moe", "convert", "shard_experts"):
        assert name in checked, name
    assert len(checked) >= 20, checked
