"""Every writer x every file it writes x every hostile destination ([Note: writer destinations]).

Generated from the table ``WRITERS`` (the core's ``export_safetensors`` and ``shardbridge ckpt
export``, the hf adapter's ``export_pretrained``, ``shardbridge ckpt convert --to hf`` from a
shardbridge and from an fsdp_dtensor source, ``--to megatron``): for each file a writer writes
and each destination below, run it without and with ``--overwrite``::

    plain   DST/<file> is the user's regular file
    link    DST/<file> is a symbolic link to the user's file outside DST
    dirlink DST itself is a symbolic link to the user's (empty) folder

Without overwrite: refused (ValueError; exit 2 and one line at the CLI) naming the file or DST,
and every byte of the user's files unchanged. With overwrite: a plain file is replaced; nothing
is ever written through a link (the outside file and folder stay as they were).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from shardbridge import checkpoint as ck  # noqa: E402
from shardbridge.cli._main import main  # noqa: E402

HEADS, GROUPS, HIDDEN = 4, 2, 32
USER = b"the user's own file\n"


# --------------------------------------------------------------------------- sources (built once)


def _hf_folder(folder: Path) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=1, num_attention_heads=HEADS,
        num_key_value_heads=GROUPS, head_dim=HIDDEN // HEADS, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).float()
    model.save_pretrained(folder)
    return model


def _fsdp_dtensor(model: transformers.LlamaForCausalLM, path: Path) -> None:
    """A Megatron-LM fsdp_dtensor checkpoint of ``model`` (model.* keys, fused QKV and SwiGLU)."""
    import torch.distributed.checkpoint as dcp
    from shardbridge.fused import merge_fused
    from shardbridge_megatron_fsdp.mcore import MegatronQKVSpec, megatron_name

    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    spec = MegatronQKVSpec.megatron(num_heads=HEADS, num_query_groups=GROUPS, head_dim=HIDDEN // HEADS)
    for key in [k for k in sd if k.endswith("self_attn.q_proj.weight")]:
        base = key.rsplit(".q_proj.", 1)[0]
        parts = {f"{p}_proj": sd.pop(f"{base}.{p}_proj.weight") for p in "qkv"}
        layer = megatron_name(f"{base}.o_proj.weight").rsplit(".linear_proj.", 1)[0]
        out[f"model.{layer}.linear_qkv.weight"] = merge_fused(parts, spec, 1)
    for key in [k for k in sd if k.endswith("mlp.gate_proj.weight")]:
        base = key.rsplit(".gate_proj.", 1)[0]
        fc1 = torch.cat([sd.pop(f"{base}.gate_proj.weight"), sd.pop(f"{base}.up_proj.weight")])
        out[f"model.{megatron_name(base + '.down_proj.weight').rsplit('.linear_fc2.', 1)[0]}.linear_fc1.weight"] = fc1
    out.update({f"model.{megatron_name(k)}": v for k, v in sd.items()})
    dcp.save(out, checkpoint_id=str(path), no_dist=True)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    model = _hf_folder(root / "hf")
    ck.save(root / "core", model=model)  # a transformers model saved by the core
    assert main(["ckpt", "convert", str(root / "hf"), str(root / "mc"), "--to", "megatron"]) == 0
    _fsdp_dtensor(model, root / "fsdp_dtensor")
    return {"hf": root / "hf", "core": root / "core", "mc": root / "mc", "fsdp_dtensor": root / "fsdp_dtensor",
            "config": model.config}  # fmt: skip


# --------------------------------------------------------------------------- the writers


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc in (0, 2) and (rc == 0 or len(err.splitlines()) == 1), (rc, err)  # one line, never a traceback
    return rc, err


def _call(fn: Callable[[], object]) -> tuple[int, str]:
    try:
        fn()
    except ValueError as err:
        return 2, str(err)
    return 0, ""


@dataclass(frozen=True, kw_only=True)
class Writer:
    name: str
    files: tuple[str, ...]
    run: Callable[[dict, Path, bool, object], tuple[int, str]]  # (sources, dst, overwrite, capsys)


_EXPORT_FILES = ("model-00001-of-00001.safetensors", "model.safetensors.index.json")
_FLAG = ["--overwrite"]


def _export_pretrained(s, dst, overwrite, capsys):
    from shardbridge_hf import export_pretrained

    return _call(lambda: export_pretrained(s["core"], dst, config=s["config"], overwrite=overwrite))


WRITERS = (
    Writer(name="export_safetensors", files=_EXPORT_FILES,
           run=lambda s, dst, ow, capsys: _call(lambda: ck.export_safetensors(s["core"], dst, progress=False, overwrite=ow))),
    Writer(name="ckpt export", files=_EXPORT_FILES,
           run=lambda s, dst, ow, capsys: _cli(["ckpt", "export", str(s["core"]), str(dst), "--no-progress"]
                                               + _FLAG * ow, capsys)),
    Writer(name="export_pretrained", files=(*_EXPORT_FILES, "config.json"), run=_export_pretrained),
    Writer(name="convert --to hf (shardbridge)", files=(*_EXPORT_FILES, "config.json"),
           run=lambda s, dst, ow, capsys: _cli(["ckpt", "convert", str(s["mc"]), str(dst), "--to", "hf"] + _FLAG * ow,
                                               capsys)),
    Writer(name="convert --to hf (fsdp_dtensor)", files=("model.safetensors", "config.json"),
           run=lambda s, dst, ow, capsys: _cli(["ckpt", "convert", str(s["fsdp_dtensor"]), str(dst), "--to", "hf",
                                                "--num-attention-heads", str(HEADS)] + _FLAG * ow, capsys)),
    Writer(name="convert --to megatron", files=("shardbridge.json", ".metadata"),
           run=lambda s, dst, ow, capsys: _cli(["ckpt", "convert", str(s["hf"]), str(dst), "--to", "megatron"]
                                               + _FLAG * ow, capsys)),
)  # fmt: skip
CASES = [(w, f, kind) for w in WRITERS for f in w.files for kind in ("plain", "link")] + [
    (w, None, "dirlink") for w in WRITERS
]


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("overwrite", [False, True], ids=["no-overwrite", "overwrite"])
@pytest.mark.parametrize(("writer", "file", "kind"), CASES, ids=[f"{w.name}-{f or 'DST'}-{k}" for w, f, k in CASES])
def test_writer_never_writes_through_a_link_nor_over_a_file(sources, tmp_path, capsys, writer, file, kind, overwrite):
    dst, outside = tmp_path / "dst", tmp_path / "user"
    outside.mkdir()
    if kind == "dirlink":
        dst.symlink_to(outside, target_is_directory=True)
    else:
        dst.mkdir()
        (outside / "kept").write_bytes(USER)
        if kind == "plain":
            (dst / file).write_bytes(USER)
        else:
            (dst / file).symlink_to(outside / "kept")
    before = _snapshot(outside)

    rc, message = writer.run(sources, dst, overwrite, capsys)

    assert _snapshot(outside) == before, "a file outside DST was written through a link"
    if kind == "plain" and overwrite and writer.name == "convert --to megatron" and rc == 2:
        # core.save replaces DST as a whole and refuses to clobber a folder that is not a checkpoint
        assert str(dst) in message and (dst / file).read_bytes() == USER, message
        return
    if kind == "plain" and overwrite:
        assert rc == 0, message
        assert (dst / file).read_bytes() != USER and not (dst / file).is_symlink()
        return
    if kind == "link" and overwrite and rc == 0:  # replaced the link's name (never its target): allowed
        assert not (dst / file).is_symlink()
        return
    assert rc == 2, f"{writer.name} wrote into {kind} {file or 'DST'} without refusing"
    assert str(dst) in message, message  # the file, or DST (a writer that replaces DST as a whole)
    if kind == "plain":
        assert (dst / file).read_bytes() == USER


def test_demo_output_refuses_links(tmp_path):
    """``shardbridge demo --out``: its marker (the one file it writes before running) and --out itself."""
    from shardbridge.cli._demo import prepare_out

    outside = tmp_path / "user"
    outside.mkdir()
    (outside / "kept").write_bytes(USER)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".shardbridge-demo").symlink_to(outside / "kept")
    with pytest.raises(ValueError, match=r"\.shardbridge-demo' is a symbolic link"):
        prepare_out(tmp_path / "out", keep=False)
    (tmp_path / "out2").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match=r"out2' is a symbolic link"):
        prepare_out(tmp_path / "out2", keep=False)
    assert _snapshot(outside) == {"kept": USER}


def test_convert_config_json_is_the_sources(sources, tmp_path):
    """The config.json convert writes from a --to megatron checkpoint is the source folder's (no link needed)."""
    assert main(["ckpt", "convert", str(sources["mc"]), str(tmp_path / "back"), "--to", "hf"]) == 0
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["num_attention_heads"] == HEADS and back["num_key_value_heads"] == GROUPS


def test_convert_of_a_refused_tensor_record_is_one_line(sources, tmp_path, capsys):
    """An fsdp_dtensor tensor record replaced by a pickle that would run code: exit 2, one line naming
    the file; before, DCP's CheckpointException escaped as a traceback with exit 1."""
    import pickle

    from shardbridge.testing._hostile import Payload, torch_save

    src, marker = tmp_path / "src", tmp_path / "code-ran"
    shutil.copytree(sources["fsdp_dtensor"], src)
    md = pickle.loads((src / ".metadata").read_bytes())  # the test's own file
    (index,) = [i for i in md.storage_data if i.fqn == "model.decoder.final_layernorm.weight"]  # 128 bytes: the payload is longer
    info, data = md.storage_data[index], torch_save(Payload(marker))
    file = src / info.relative_path
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(data)
    md.storage_data[index] = type(info)(info.relative_path, offset, len(data))
    (src / ".metadata").write_bytes(pickle.dumps(md))
    rc, err = _cli(["ckpt", "convert", str(src), str(tmp_path / "dst"), "--to", "hf",
                    "--num-attention-heads", str(HEADS)], capsys)  # fmt: skip
    assert rc == 2 and str(file) in err and "not trusted; nothing from it was executed" in err, err
    assert not marker.exists() and not (tmp_path / "dst" / "model.safetensors").exists()


def test_convert_of_an_equal_volume_overlap_is_refused(sources, tmp_path, capsys):
    """fsdp_dtensor source, the embedding (64 rows) stored as rows [0, 33) and [32, 63): exit 2 naming
    the tensor; before, convert wrote model.safetensors with row 63 uninitialised memory, exit 0."""
    from shardbridge.testing._hostile import overlap_chunks

    src = tmp_path / "src"
    shutil.copytree(sources["fsdp_dtensor"], src)
    overlap_chunks(src, "model.embedding.word_embeddings.weight")
    rc, err = _cli(["ckpt", "convert", str(src), str(tmp_path / "dst"), "--to", "hf",
                    "--num-attention-heads", str(HEADS)], capsys)  # fmt: skip
    assert rc == 2 and str(src / ".metadata") in err, err
    assert "'model.embedding.word_embeddings.weight' (size (64, 32)) chunks that overlap" in err, err
    assert not (tmp_path / "dst" / "model.safetensors").exists()
