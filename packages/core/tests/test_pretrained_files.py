"""Which files of a folder shard-on-read reads: the ones ``from_pretrained`` reads ([Note: file selection]).

Oracle: transformers' own ``from_pretrained`` on the same folder. Every combination of the
weights files a folder can hold, each holding a different model (A in ``model.safetensors``,
B in the index's shards), so reading the wrong file shows as different values.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardbridge.pretrained import INDEX_NAME, SINGLE_FILE_NAME, load_pretrained, read_index  # noqa: E402


def _config():
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip


def _model(seed: int):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config()).float()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A's one file, B's shards + index (several shards), saved by transformers."""
    root = tmp_path_factory.mktemp("saved")
    _model(1).save_pretrained(root / "a")
    _model(2).save_pretrained(root / "b", max_shard_size="4KB")
    assert (root / "a" / SINGLE_FILE_NAME).is_file() and (root / "b" / INDEX_NAME).is_file()
    return root


def _folder(saved, dst, *, single: bool, index: bool, drop_shard: bool = False, explicit: str | None = None):
    dst.mkdir()
    shutil.copy(saved / "a" / "config.json", dst / "config.json")
    if single:
        shutil.copy(saved / "a" / SINGLE_FILE_NAME, dst / SINGLE_FILE_NAME)
    if index:
        for f in (saved / "b").glob("model*.safetensors*"):
            shutil.copy(f, dst / f.name)
    if drop_shard:  # a leftover index: its shards deleted (or one of them)
        shards = sorted(dst.glob("model-*-of-*.safetensors"))
        for f in shards if single else shards[:1]:
            f.unlink()
    if explicit is not None:
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, "transformers_weights": explicit}))
    return dst


CASES = {
    "single": {"single": True, "index": False},
    "index": {"single": False, "index": True},
    "both": {"single": True, "index": True},
    "single+leftover-index": {"single": True, "index": True, "drop_shard": True},
    "index-missing-a-shard": {"single": False, "index": True, "drop_shard": True},
    "both, config names the index": {"single": True, "index": True, "explicit": INDEX_NAME},
    "both, config names the file": {"single": True, "index": True, "explicit": SINGLE_FILE_NAME},
}


@pytest.mark.parametrize("case", list(CASES))
def test_shard_on_read_reads_what_from_pretrained_reads(saved, tmp_path, case):
    folder = _folder(saved, tmp_path / "f", **CASES[case])
    try:
        oracle = transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()
    except (OSError, ValueError):  # transformers cannot load it: shard-on-read must refuse it by name
        with pytest.raises(ValueError, match=r"names 'model-\d+-of-\d+\.safetensors', which is not a file in"):
            read_index(folder)
        return
    mine = _model(99)  # other weights: every value must come from the folder
    load_pretrained(mine, folder)
    got = mine.state_dict()
    assert set(got) == set(oracle)
    for key, value in oracle.items():
        assert torch.equal(got[key], value), f"{case}: {key} differs from from_pretrained's"


@pytest.mark.parametrize("name", ["config.json", INDEX_NAME])
def test_a_json_nested_100000_deep_is_refused_by_name(saved, tmp_path, name):
    # [Note: bounded structure] (issue 42): before, a raw RecursionError out of load_pretrained.
    folder = _folder(saved, tmp_path / "f", single=False, index=True)
    text = (folder / name).read_text().rstrip().rstrip("}")
    (folder / name).write_text(text + ', "nested": ' + "[" * 100_000 + "]" * 100_000 + "}")
    model = _model(3)
    with pytest.raises(ValueError, match=rf"{name} nests arrays and objects 100001 deep, more than the 64"):
        load_pretrained(model, folder)
