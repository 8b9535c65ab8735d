"""shardbridge._compat: the one home of torch's private names (tier 1 and tier 3)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.distributed as dist
from shardbridge import _compat
from shardbridge._compat import (
    TORCH_CHECKED,
    distribution_version,
    fsdp_param_groups,
    fsdp_params,
    fsdp_shard_process_group,
    fsdp_unit_key,
    fsdp_unit_modules,
    local_tensor,
    parse_version,
    require_attr,
    require_module,
    reset_sharded_params,
)
from shardbridge.testing import run_distributed

REPO = pathlib.Path(__file__).resolve().parents[3]

# Private torch names the monorepo may reach only through shardbridge._compat.
PRIVATE_TORCH = (
    "_local_tensor",
    "_get_fsdp_state",
    "_fsdp_param_group",
    "_fsdp_param_groups",
    "reset_sharded_param",
    "_flatten",
    "_unflatten",
    "_compute_local_shape_and_global_offset",
    "_flatten_sharded_tensors",
    "_StoragePrefix",
)
PRIVATE_TORCH_MODULES = (
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.checkpoint._nested_dict",
    "torch.distributed.checkpoint._sharded_tensor_utils",
    "torch.distributed.checkpoint._fsspec_filesystem",
    "torch.distributed.tensor._utils",
    "torch.testing._internal",
    "torch.utils._pytree",
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.13.0", (2, 13, 0)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.20.2+cu12", (2, 20, 2)),
        ("2.8.0.dev0+abc", (2, 8, 0)),
        ("1.10rc2", (1, 10)),
        ("0.6.1", (0, 6, 1)),
        (" 5.23 ", (5, 23)),
    ],
)
def test_parse_version(text: str, expected: tuple[int, ...]) -> None:
    assert parse_version(text) == expected


def test_parse_version_refuses_garbage() -> None:
    with pytest.raises(ValueError, match=r"version 'abc' does not start with a number"):
        parse_version("abc")


def test_distribution_version() -> None:
    assert distribution_version("torch") == parse_version(torch.__version__)
    assert distribution_version("no-such-distribution-shardbridge") is None


def test_require_module_names_the_hint() -> None:
    with pytest.raises(ImportError, match=r'no_such_module_xyz is not importable: pip install "xyz>=1.0"'):
        require_module("no_such_module_xyz", hint='pip install "xyz>=1.0"')


def test_require_attr_names_torch_version_and_checked_range() -> None:
    lo = ".".join(map(str, TORCH_CHECKED[0]))
    with pytest.raises(RuntimeError, match=rf"torch .* has no '_gone'.*checked against torch {lo}"):
        require_attr(object(), "_gone", what="unit test")


def test_checked_range_contains_this_torch() -> None:
    assert TORCH_CHECKED[0] <= parse_version(torch.__version__)[:3] <= TORCH_CHECKED[1]


def _private_uses(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_TORCH:
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PRIVATE_TORCH_MODULES):
            found.append(f"{path.name}:{node.lineno}: from {node.module}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            found.extend(
                f"{path.name}:{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and a.name != "_StridedShard"  # the placement's own name (upstream names are kept)
            )
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("torch")
        ):
            found.append(f"{path.name}:{node.lineno}: import_module({node.args[0].value!r})")
        elif isinstance(node, ast.Import):
            found.extend(
                f"{path.name}:{node.lineno}: import {a.name}" for a in node.names if a.name.startswith(PRIVATE_TORCH_MODULES)
            )
    return found


def test_private_torch_names_live_only_in_compat() -> None:
    """Every package's source reaches torch internals through shardbridge._compat only."""
    sources = sorted((REPO / "packages").glob("*/src/**/*.py"))
    assert len(sources) > 40
    core_compat = REPO / "packages/core/src/shardbridge/_compat.py"
    offenders = [o for p in sources if p != core_compat for o in _private_uses(p)]
    assert offenders == [], "private torch names outside shardbridge/_compat.py:\n" + "\n".join(offenders)


def _fsdp_helpers() -> dict[str, object]:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2), nn.Linear(2, 2))
    fully_shard([model[0], model[1]], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = [local_tensor(p).clone() for p in model.parameters()]
    reset_sharded_params(model[0])
    after = [local_tensor(p) for p in model.parameters()]
    return {
        "groups": [len(fsdp_param_groups(m)) for m in (model[0], model[2], model)],
        "unit0": [type(m).__name__ for m in fsdp_unit_modules(model[0])],
        "same_unit": fsdp_unit_key(model[0]) == fsdp_unit_key(model[1]),
        "different_unit": fsdp_unit_key(model[0]) != fsdp_unit_key(model[2]),
        "params0": len(list(fsdp_params(model[0]))),
        "root_params": len(list(fsdp_params(model))),
        "backend": dist.get_backend(fsdp_shard_process_group(model[0])),
        "local_is_plain": all(type(t) is torch.Tensor for t in after),
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
    }


def test_fsdp_helpers_on_real_fsdp2() -> None:
    results = run_distributed(_fsdp_helpers, world_size=2)
    for r in results:
        assert r["groups"] == [1, 1, 1]
        assert r["unit0"] == ["FSDPLinear", "FSDPReLU"]  # fully_shard swaps in FSDP subclasses
        assert r["same_unit"] and r["different_unit"]
        assert r["params0"] == 2 and r["root_params"] == 2
        assert r["backend"] == "gloo"
        assert r["local_is_plain"] and r["unchanged"]


def test_compat_exports_exist() -> None:
    for name in _compat.__all__:
        assert hasattr(_compat, name), name
