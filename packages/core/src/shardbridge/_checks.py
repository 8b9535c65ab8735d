"""Input checks shared by the core and the adapters: argument types of entry points, and did-you-mean.

Private: adapters reach :func:`checked_args` and :func:`did_you_mean` through
:mod:`shardbridge.adapters`; training code does not need them. Two helpers, so that every entry point and every config reader words a
mistake the same way:

- :func:`checked_args`: a decorator that turns API misuse (swapped arguments, an uncalled
  preset such as ``PrecisionPolicy.bf16``, a ``ParallelDims`` where a built mesh belongs) into
  ONE ``TypeError`` naming the function, the parameter, the expected type and the fix, before
  any work -- instead of an ``AttributeError`` deep inside torch.
- :func:`did_you_mean`: the closest known names to a misspelled key (edit distance), for the
  "unknown key" errors of config files.

[Note: argument checks]
~~~~~~~~~~~~~~~~~~~~~~~
Only the parameters an entry point declares are checked, by ``isinstance`` against the types
it names (``None`` in the tuple allows None), once per call: microseconds, on calls made once
per run (``parallelize_llama``, ``apply_fsdp``, ...). Hot paths (a forward, a collective)
are not decorated. The message says, in this order of preference:

1. an uncalled preset or factory whose result would fit (``PrecisionPolicy.bf16``):
   "pass PrecisionPolicy.bf16() (call it)";
2. a class where an instance belongs: "pass an instance";
3. a value that fits another parameter of the same call: "were `model` and `mesh` swapped?";
4. a known near miss (:data:`NEAR_MISSES`: a ``ParallelDims`` for a ``ParallelMesh``, torch's
   ``MixedPrecisionPolicy`` for shardbridge's ``PrecisionPolicy``, ...).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["NEAR_MISSES", "checked_args", "did_you_mean", "edit_distance"]

F = TypeVar("F", bound=Callable[..., Any])

#: (expected class name, given class name) -> the fix (``{value!r}``: the argument), for mistakes seen in the wild.
NEAR_MISSES: dict[tuple[str, str], str] = {
    ("ParallelMesh", "ParallelDims"): "call .build_mesh(device_type) on it and pass the result",
    ("ParallelMesh", "DeviceMesh"): "pass the ParallelMesh that ParallelDims(...).build_mesh(device_type) returned",
    ("DeviceMesh", "ParallelMesh"): "pass one of its 1-D meshes, e.g. pm['tp']",
    ("PrecisionPolicy", "MixedPrecisionPolicy"): "that is torch's FSDP2 class; pass a shardbridge.PrecisionPolicy, "
    "e.g. PrecisionPolicy.bf16()",
    ("PrecisionPolicy", "str"): "pass PrecisionPolicy.from_name({value!r})",
    ("HFConfig", "dict"): "pass HFConfig.from_block(the mapping)",
    ("LlamaConfig", "dict"): "pass LlamaConfig(**the mapping)",
}


def _describe(types: tuple[type | None, ...]) -> str:
    names = [("None" if t is None else t.__name__) for t in types]
    return names[0] if len(names) == 1 else " or ".join(names)


def _given(value: Any) -> str:
    if isinstance(value, type):
        return f"the class {value.__name__}"
    if inspect.ismethod(value) or inspect.isfunction(value):
        return f"the {'method' if inspect.ismethod(value) else 'function'} {value.__qualname__}"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _fix(name: str, value: Any, types: tuple[type | None, ...], others: dict[str, Any], expected: dict) -> str:
    """What the caller should do instead (see [Note: argument checks]); '' when nothing specific applies."""
    real = tuple(t for t in types if t is not None)
    # 1. a preset / factory passed without calling it: PrecisionPolicy.bf16, LlamaConfig.tiny
    owner = getattr(value, "__self__", None)
    if inspect.ismethod(value) and isinstance(owner, type) and issubclass(owner, real):
        return f"pass {owner.__name__}.{value.__name__}() (call it)"
    if callable(value) and not isinstance(value, type):
        qualname = getattr(value, "__qualname__", "")
        if any(qualname.startswith(f"{t.__name__}.") for t in real):
            return f"pass {qualname}() (call it)"
    # 2. the class itself
    if isinstance(value, type) and issubclass(value, real):
        return f"pass an instance, e.g. {value.__name__}(...)"
    # 3. an argument that belongs to another parameter of the same call
    for other, other_types in expected.items():
        if other != name and other in others:
            fits = tuple(t for t in other_types if t is not None)
            if fits and isinstance(value, fits) and not isinstance(value, real):
                return f"were `{name}` and `{other}` swapped?"
    # 4. a known near miss
    for t in real:
        hint = NEAR_MISSES.get((t.__name__, type(value).__name__))
        if hint:
            return hint.format(value=value)
    return ""


def checked_args(**expected: type | tuple[type | None, ...]) -> Callable[[F], F]:
    """Decorator: a one-line ``TypeError`` when a named argument is not of its type.

    Args:
        **expected: parameter name -> a type or a tuple of types (``None`` in it allows None).

    Example:
        >>> import torch
        >>> @checked_args(module=torch.nn.Module, scale=(float, None))
        ... def scale_params(module, scale=None): ...
        >>> scale_params(torch.nn.Linear(2, 2), 0.5)
        >>> scale_params(0.5, torch.nn.Linear(2, 2))
        Traceback (most recent call last):
        ...
        TypeError: scale_params(module=...): expected a Module, got a float; were `module` and `scale` swapped?
    """
    spec = {name: (t if isinstance(t, tuple) else (t,)) for name, t in expected.items()}

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        unknown = set(spec) - set(signature.parameters)
        if unknown:
            raise AssertionError(f"checked_args on {fn.__qualname__}: no parameter(s) {sorted(unknown)}")

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                arguments = signature.bind(*args, **kwargs).arguments
            except TypeError:
                return fn(*args, **kwargs)  # a missing / extra argument: Python's own message
            for name, types in spec.items():
                if name not in arguments:
                    continue
                value = arguments[name]
                if value is None and None in types:
                    continue
                real = tuple(t for t in types if t is not None)
                if isinstance(value, real):
                    continue
                fix = _fix(name, value, types, arguments, spec)
                article = "an" if _describe(types)[:1].lower() in "aeiou" else "a"
                raise TypeError(
                    f"{fn.__qualname__}({name}=...): expected {article} {_describe(types)}, got {_given(value)}"
                    + (f"; {fix}" if fix else "")
                )
            return fn(*args, **kwargs)

        return checked  # type: ignore[return-value]

    return decorate


def edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions, adjacent swaps each cost 1.

    Example:
        >>> edit_distance("tp_sise", "tp_size"), edit_distance("precison", "precision")
        (1, 1)
    """
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], previous2[j - 2] + 1)
        previous2, previous = previous, row
    return previous[-1]


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the known names closest to ``name``, or ``""`` when none is close.

    Close: case-insensitive edit distance at most ``max(2, len(name) // 4)``; every name at the
    smallest distance is offered (a one-letter slip may be as near to two keys: ``xp_size``).

    Example:
        >>> did_you_mean("parallelism_config_tp_sise", ["parallelism_config_tp_size", "parallelism_config_cp_size"])
        "; did you mean 'parallelism_config_tp_size'?"
        >>> did_you_mean("banana", ["precision", "fp8"])
        ''
    """
    if not isinstance(name, str):
        return ""
    scored = sorted((edit_distance(name.lower(), k.lower()), k) for k in set(known))
    if not scored or scored[0][0] > max(2, len(name) // 4):
        return ""
    best = [repr(k) for d, k in scored if d == scored[0][0]]
    return f"; did you mean {' or '.join(best)}?"
