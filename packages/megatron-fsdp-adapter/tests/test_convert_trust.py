"""``shardbridge ckpt convert``: hostile sources refused in one line, exit 2 ([Note: config against tensors]).

Generated over every tensor of a real ``save_pretrained`` folder: each key dropped, each key
cast to int32, each key given one more row, and config.json's dtype contradicting the files:
``--to megatron`` refuses each by name before writing anything (``load_pretrained`` and
``from_pretrained`` do not load them as the same model). A refused tensor record in an
fsdp_dtensor source comes out as its one line, not DCP's ``CheckpointException`` traceback.
Convert reads the file ``from_pretrained`` reads when a folder holds ``model.safetensors`` and an
index ([Note: file selection]).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from shardbridge.cli._main import main  # noqa: E402

TIED = {"untied": False, "tied": True}


@pytest.fixture(scope="module", params=list(TIED))
def folder(request, tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=16, tie_word_embeddings=TIED[request.param],
    )  # fmt: skip
    path = tmp_path_factory.mktemp("hf") / request.param
    transformers.LlamaForCausalLM(config).float().save_pretrained(path)
    return path


def _convert(src, dst, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["ckpt", "convert", str(src), str(dst), "--to", "megatron"])
    err = capsys.readouterr().err.strip()
    return rc, err


def _mutant(folder, dst, change) -> None:
    shutil.copytree(folder, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def _mutants(keys):
    for key in keys:
        yield f"drop {key}", key, lambda t, k=key: t.pop(k)
        yield f"int32 {key}", key, lambda t, k=key: t.__setitem__(k, t[k].to(torch.int32))
        yield f"one more row {key}", key, lambda t, k=key: t.__setitem__(k, torch.cat([t[k], t[k][:1]]))
    yield "a layer beyond num_hidden_layers", "model.layers.2.", lambda t: t.__setitem__(
        "model.layers.2.input_layernorm.weight", t["model.layers.0.input_layernorm.weight"].clone()
    )


def test_the_source_folder_converts(folder, tmp_path, capsys):
    assert _convert(folder, tmp_path / "mc", capsys) == (0, "")


def test_every_tensor_contradicting_config_is_refused(folder, tmp_path, capsys):
    keys = sorted(load_file(folder / "model.safetensors"))
    tried = 0
    for n, (what, key, change) in enumerate(_mutants(keys)):
        src, dst = tmp_path / f"src{n}", tmp_path / f"dst{n}"
        _mutant(folder, src, change)
        rc, err = _convert(src, dst, capsys)
        assert rc == 2 and len(err.splitlines()) == 1, f"{what}: exit {rc}: {err}"
        assert key in err and str(src) in err, f"{what}: {err}"
        assert not dst.exists(), f"{what}: something was written"
        tried += 1
    assert tried == 3 * len(keys) + 1


def test_lm_head_missing_when_untied_names_the_setting(folder, tmp_path, capsys):
    if json.loads((folder / "config.json").read_text())["tie_word_embeddings"]:
        pytest.skip("tied: lm_head is the embedding")  # the untied param covers it
    _mutant(folder, tmp_path / "src", lambda t: t.pop("lm_head.weight"))
    rc, err = _convert(tmp_path / "src", tmp_path / "dst", capsys)
    assert rc == 2 and "'lm_head.weight' (config.json tie_word_embeddings is false" in err, err


def test_config_dtype_contradicting_the_files_is_refused(folder, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    rc, err = _convert(src, tmp_path / "dst", capsys)
    assert rc == 2 and "is float32, config.json says dtype 'bfloat16'" in err, err
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("leftover", [False, True], ids=["single+index", "single+leftover-index"])
def test_convert_reads_the_file_from_pretrained_reads(tmp_path, capsys, leftover):
    """``--to megatron`` of a folder holding model A in ``model.safetensors`` and model B's index
    beside it (B's shards deleted when ``leftover``), then ``--to hf`` back: from_pretrained reads
    A from both folders. Before: convert read B's shards, or refused the leftover index."""
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip
    for name, seed in (("a", 1), ("b", 2)):
        torch.manual_seed(seed)
        transformers.LlamaForCausalLM(config).float().save_pretrained(tmp_path / name, max_shard_size="4KB" if name == "b" else "1GB")
    src = tmp_path / "src"
    shutil.copytree(tmp_path / "a", src)
    for f in (tmp_path / "b").glob("model*.safetensors*"):
        if not (leftover and f.name.startswith("model-")):
            shutil.copy(f, src / f.name)
    assert _convert(src, tmp_path / "mc", capsys) == (0, "")
    assert main(["ckpt", "convert", str(tmp_path / "mc"), str(tmp_path / "back"), "--to", "hf"]) == 0
    oracle = transformers.LlamaForCausalLM.from_pretrained(src).state_dict()
    other = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "b").state_dict()
    assert not torch.equal(oracle["model.embed_tokens.weight"], other["model.embed_tokens.weight"])  # two models
    got = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    assert set(got) == set(oracle)
    for key, value in oracle.items():
        assert torch.equal(got[key], value), key


def test_a_config_json_nested_100000_deep_is_refused_in_one_line(folder, tmp_path, capsys):
    # [Note: bounded structure] (issue 42): before, "unexpected; rerun with --debug" (RecursionError).
    src = tmp_path / "deep"
    shutil.copytree(folder, src)
    text = (src / "config.json").read_text().rstrip().rstrip("}")
    (src / "config.json").write_text(text + ', "nested": ' + "[" * 100_000 + "]" * 100_000 + "}")
    rc, err = _convert(src, tmp_path / "out", capsys)
    assert rc == 2 and err.count("\n") == 0, err
    assert "config.json nests arrays and objects 100001 deep, more than the 64" in err, err
