"""JSON from files anyone may have written, read with its structure bounded first.

[Note: bounded structure]
~~~~~~~~~~~~~~~~~~~~~~~~~
Python's ``json`` parser, its encoder, ``hash``, ``==`` and ``repr`` recurse once per level
of nesting, in C. A file nesting arrays 100,000 deep (a few hundred KB) makes ``json.loads``
raise ``RecursionError``, which no caller names (``latest(root)`` died on the whole root for one
such manifest; ``load_pretrained`` and ``ckpt convert`` showed a raw traceback); a tuple nested
10**6 deep in a pickle crashes the process when it is hashed (SIGSEGV: tuple hashing has no
recursion guard). So every structure read from a checkpoint or a ``from_pretrained`` folder is
bounded BEFORE anything recursive touches it, without recursing to find out:

- JSON (``shardbridge.json``, ``config.json``, ``model.safetensors.index.json``): :func:`loads`
  measures the nesting of brackets outside strings (a regular expression drops the strings, a
  cumulative sum over the brackets left gives the depth) and the size, then parses;
- ``.metadata`` (a pickle): the restricted unpickler counts each object's depth and each tuple's
  size as its stack builds them (``MetadataUnpickler`` in ``checkpoint/storage/_trust.py``).

Past a bound the file is refused by name, with the bound. The bounds are far above what
shardbridge, DCP or transformers write (a manifest nests 9 deep, a Hugging Face config 5).
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

__all__ = ["MAX_BYTES", "MAX_DEPTH", "loads"]

MAX_DEPTH = 64
"""Levels of arrays and objects a JSON file may nest (``save`` refuses an ``extra`` that would pass it)."""
MAX_BYTES = 256 << 20
"""Bytes of one JSON file (a 65,536-rank checkpoint's manifest: ~35 MB; a 1T-parameter index: ~10 MB)."""
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def depth(data: bytes) -> int:
    """How deep the arrays and objects of the JSON text ``data`` nest (brackets inside strings do not count)."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    t = torch.frombuffer(bytearray(brackets), dtype=torch.uint8)
    steps = ((t == ord("[")) | (t == ord("{"))).to(torch.int32) * 2 - 1
    return int(torch.cumsum(steps, 0).max())


def loads(data: str | bytes, where: str, *, max_bytes: int = MAX_BYTES) -> Any:
    """``json.loads(data)`` once its size and nesting are within bounds ([Note: bounded structure]).

    Raises:
        ValueError: ``data`` is larger than ``max_bytes``, nests deeper than :data:`MAX_DEPTH`, or
            is not JSON; the message names ``where`` and the bound.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if len(raw) > max_bytes:
        raise ValueError(f"{where} is {len(raw)} bytes, more than the {max_bytes} this reader takes; not reading it")
    levels = depth(raw)
    if levels > MAX_DEPTH:
        raise ValueError(
            f"{where} nests arrays and objects {levels} deep, more than the {MAX_DEPTH} this reader takes; not reading it"
        )
    return json.loads(data)
