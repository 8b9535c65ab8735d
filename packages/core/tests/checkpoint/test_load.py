"""Tier 3: save in one layout, load in another, bit-exact; fused reshard; load errors.

Oracles: the source model's own ``full_tensor()`` (and ``split_fused`` for fused params), and
torch's ``dcp_to_torch_save`` of the written checkpoint.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from ckpt_helpers import LAYOUTS, Mlp, assert_equal_states, build, full_state
from ckpt_helpers import step as train_step
from shardbridge import checkpoint as ck
from shardbridge.checkpoint.storage._manifest import MANIFEST_NAME
from shardbridge.testing import run_distributed
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

EXTRA = {"tokens": 1234, "schedule": {"warmup": 10}, "tags": ["a", "b"]}


def _save(root: str, layout: str, fused: bool, step: int, ac: bool = False) -> dict[str, torch.Tensor] | None:
    model, opt = build(LAYOUTS[layout], fused=fused, ac=ac)
    path = ck.save(ck.step_dir(root, step), model=model, optimizer=opt, step=step, extra=EXTRA)
    state = full_state(model, opt)
    assert path == ck.step_dir(root, step)
    return state if not dist.is_initialized() or dist.get_rank() == 0 else None


def _load(path: str, layout: str, fused: bool) -> tuple[dict[str, torch.Tensor], float, object] | None:
    # Different seed and lr: every value must come from the checkpoint.
    model, opt = build(LAYOUTS[layout], fused=fused, seed=7, lr=0.5)
    train_state = ck.load(path, model=model, optimizer=opt, rng=False)  # RNG: test_rng.py
    state = full_state(model, opt)
    lr = opt.param_groups[0]["lr"]
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return state, lr, train_state


def _run(fn, *args, layout: str):
    """fn on the ranks of ``layout`` (4), or in this process for "single"."""
    if LAYOUTS[layout] is None:
        return fn(*args)
    return run_distributed(fn, *args, world_size=4)[0]


def _oracle(path: os.PathLike[str], tmp_path) -> dict[str, torch.Tensor]:
    """torch's own reading of the checkpoint, flattened to checkpoint key names."""
    out = tmp_path / "oracle.pt"
    dcp_to_torch_save(path, out)
    sd = torch.load(out, weights_only=True)
    flat = {f"model.{k}": v for k, v in sd["model"].items()}
    flat.update({f"optim.{k}": v for k, v in sd["optim"].items() if k.startswith("state.")})
    return flat


# Each layout is a source once and a target once.
RING = [
    ("fsdp4", "fsdp2_tp2"),
    ("fsdp2_tp2", "hsdp2_tp2"),
    ("hsdp2_tp2", "tp4"),
    ("tp4", "single"),
    ("single", "fsdp4"),
]


@pytest.mark.parametrize(("source", "target"), RING, ids=[f"{s}-to-{t}" for s, t in RING])
def test_round_trip_is_bit_exact_across_layouts(tmp_path, source, target):
    want = _run(_save, str(tmp_path), source, False, 3, layout=source)
    path = ck.step_dir(tmp_path, 3)
    assert_equal_states(_oracle(path, tmp_path), want)

    got, lr, train_state = _run(_load, str(path), target, False, layout=target)
    assert_equal_states(got, want)
    assert lr == 0.01
    assert train_state.step == 3 and train_state.extra == EXTRA
    assert train_state.world_size == (1 if LAYOUTS[source] is None else 4)


@pytest.fixture(scope="module")
def fused_tp2(tmp_path_factory):
    """A fused [gate; up] model saved at dp_shard=2 x tp=2, and its full state."""
    root = tmp_path_factory.mktemp("fused")
    want = run_distributed(_save, str(root), "fsdp2_tp2", True, 5, world_size=4)[0]
    return ck.step_dir(root, 5), want


@pytest.mark.parametrize("target", ["tp4", "fsdp4", "single"])
def test_fused_params_reshard_across_tp_sizes(fused_tp2, target):
    path, want = fused_tp2
    assert "model.gate_proj.weight" in want and "optim.state.up_proj.weight.exp_avg_sq" in want
    got, _, _ = _run(_load, str(path), target, True, layout=target)
    assert_equal_states(got, want)


def test_fused_checkpoint_stores_components_in_plain_order(fused_tp2, tmp_path):
    path, want = fused_tp2
    oracle = _oracle(path, tmp_path)
    assert "model.gate_up.weight" not in oracle
    assert torch.equal(oracle["model.gate_proj.weight"], want["model.gate_proj.weight"])
    assert torch.equal(oracle["optim.state.gate_proj.weight.exp_avg"], want["optim.state.gate_proj.weight.exp_avg"])
    info = ck.inspect(path)
    assert info.fused["gate_up.weight"]["tp_size"] == 2


def test_fused_params_under_activation_checkpointing(tmp_path):
    """AC's ``checkpoint_wrapper`` renames every parameter (``gate_up._checkpoint_wrapped_module.weight``);
    the checkpoint's keys drop the wrapper, and the fused spec follows them: the components (not the
    TP-interleaved ``gate_up.weight``), loaded bit-exact by a model without AC."""
    want = run_distributed(_save, str(tmp_path), "fsdp2_tp2", True, 5, True, world_size=4)[0]
    assert "model.gate_proj.weight" in want and not any("_checkpoint_wrapped_module" in k for k in want)
    path = ck.step_dir(tmp_path, 5)
    oracle = _oracle(path, tmp_path)
    assert "model.gate_up.weight" not in oracle, sorted(oracle)
    assert torch.equal(oracle["model.gate_proj.weight"], want["model.gate_proj.weight"])
    assert ck.inspect(path).fused["gate_up.weight"]["tp_size"] == 2
    got, _, _ = _run(_load, str(path), "single", True, layout="single")
    assert_equal_states(got, want)


def test_unfused_model_reads_fused_checkpoint(fused_tp2):
    """Components are ordinary keys: separate gate_proj / up_proj modules load them."""
    path, want = fused_tp2

    class Unfused(Mlp):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(6, 4, bias=False)
            self.up_proj = nn.Linear(6, 4, bias=False)

    model = Unfused()
    ck.load(path, model=model, rng=False)
    assert torch.equal(model.gate_proj.weight.detach(), want["model.gate_proj.weight"])
    assert torch.equal(model.up_proj.weight.detach(), want["model.up_proj.weight"])


# --------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def single_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    _save(str(root), "single", False, 1)
    return ck.step_dir(root, 1)


def test_missing_path_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="does not exist; pass a directory written by shardbridge"):
        ck.load(tmp_path / "nope", model=Mlp())


def test_plain_dcp_directory_is_not_a_shardbridge_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "plain", no_dist=True)
    with pytest.raises(ValueError, match=r"not a shardbridge checkpoint.*plain DCP checkpoint"):
        ck.load(tmp_path / "plain", model=Mlp())


def test_incompatible_model_lists_missing_and_unexpected_keys(single_ckpt):
    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(6, 9)
            self.extra_a = nn.Linear(2, 2)

    with pytest.raises(
        ValueError,
        match=r"2 key\(s\) of the model are not in the checkpoint: 'model.extra_a.*"
        r"not in the model: 'model.down.weight'.*strict=False",
    ):
        ck.load(single_ckpt, model=Other())


def test_a_model_that_does_not_fit_is_told_what_saved_the_checkpoint(tmp_path):
    """Issue: 84 missing and 100 unexpected keys, and not a word of whose checkpoint it is. The
    error now names what the manifest and metadata know: architecture, parameters, modules."""
    from shardbridge.models import Llama, LlamaConfig, hf_llama_export_record

    config = LlamaConfig.tiny(num_layers=2, vocab_size=64)
    llama = Llama(config)
    path = ck.save(tmp_path / "llama", model=llama, step=7, extra={"export": hf_llama_export_record(config)})
    params = sum(p.numel() for p in llama.parameters())  # the oracle: the model that saved it
    with pytest.raises(ValueError) as info:
        ck.load(path, model=Mlp())
    message = str(info.value)
    assert "\n" not in message
    assert f"the checkpoint holds a LlamaForCausalLM of {params:,} parameters in " in message, message
    assert "top-level modules tok_embeddings, layers (" in message and "saved at step 7 by 1 rank(s)" in message
    mlp = sum(p.numel() for p in Mlp().parameters())
    assert f"this model has {mlp:,} parameters in 7 tensors (top-level modules up (2 tensors), down, head (2" in message


def test_non_strict_loads_the_common_keys(single_ckpt):
    class Smaller(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(6, 9)
            self.other = nn.Linear(2, 2)

    model = Smaller()
    before = model.other.weight.detach().clone()
    ck.load(single_ckpt, model=model, strict=False, rng=False)
    assert torch.equal(model.up.weight.detach(), ck_tensor(single_ckpt, "model.up.weight"))
    assert torch.equal(model.other.weight.detach(), before)


def ck_tensor(path, key):
    import torch.distributed.checkpoint as dcp
    from shardbridge.checkpoint._export import read_tensor

    reader = dcp.FileSystemReader(path)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    return read_tensor(reader, md, key)


def test_shape_mismatch_names_key_and_shapes(single_ckpt):
    model = Mlp()
    model.up = nn.Linear(6, 10)
    with pytest.raises(ValueError, match=r"shape mismatch for 'model.up.weight': checkpoint \(9, 6\), model \(10, 6\)"):
        ck.load(single_ckpt, model=model)


def test_optimizer_requested_but_not_saved(tmp_path):
    model = Mlp()
    path = ck.save(tmp_path / "m", model=model)
    with pytest.raises(ValueError, match="has no optimizer state.*pass optimizer=None"):
        ck.load(path, model=model, optimizer=torch.optim.AdamW(model.parameters()))
    assert ck.load(path, model=Mlp()).step is None


def test_load_latest_picks_newest_and_returns_none_without_checkpoints(tmp_path):
    assert ck.load_latest(tmp_path, model=Mlp()) is None  # an existing, empty root: a first run
    for step in (1, 20, 3):
        ck.save(ck.step_dir(tmp_path, step), model=Mlp(), step=step)
    assert ck.load_latest(tmp_path, model=Mlp()).step == 20


def test_load_latest_of_a_root_that_does_not_exist_says_so_unless_asked(tmp_path):
    """Before: None, so a mistyped root silently started training from scratch."""
    with pytest.raises(ValueError, match=r"checkpoint root '.*/cktp' does not exist.*missing_ok=True"):
        ck.load_latest(tmp_path / "cktp", model=Mlp())
    assert ck.load_latest(tmp_path / "cktp", model=Mlp(), missing_ok=True) is None
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="checkpoint root '.*/file' is a file"):
        ck.load_latest(tmp_path / "file", model=Mlp(), missing_ok=True)
    with pytest.raises(ValueError, match="missing_ok='yes' must be True or False"):
        ck.load_latest(tmp_path, model=Mlp(), missing_ok="yes")


def test_load_latest_loads_the_previous_step_past_a_manifest_nested_100000_deep(tmp_path):
    """Issue 42: the newest manifest's RecursionError ended load_latest for the whole root."""
    from test_commit import nest

    model, opt = build(None, seed=1)
    ck.save(ck.step_dir(tmp_path, 1), model=model, optimizer=opt, step=1)
    want = full_state(model, opt)
    train_step(model, opt, seed=5)
    ck.save(ck.step_dir(tmp_path, 2), model=model, optimizer=opt, step=2)
    nest(ck.step_dir(tmp_path, 2) / MANIFEST_NAME)
    fresh, fresh_opt = build(None, seed=9, lr=0.5)
    assert ck.load_latest(tmp_path, model=fresh, optimizer=fresh_opt).step == 1
    assert_equal_states(full_state(fresh, fresh_opt), want)


@pytest.mark.parametrize("verb", ["save", "load", "load_latest"])
def test_swapped_model_and_optimizer_are_one_type_error(tmp_path, verb):
    model = Mlp()
    opt = torch.optim.AdamW(model.parameters())
    ck.save(tmp_path / "c", model=model, optimizer=opt)
    call = {
        "save": lambda **kw: ck.save(tmp_path / "d", **kw),
        "load": lambda **kw: ck.load(tmp_path / "c", **kw),
        "load_latest": lambda **kw: ck.load_latest(tmp_path, **kw),
    }[verb]
    with pytest.raises(TypeError, match=r"^model must be a torch.nn.Module, got torch.optim.adamw.AdamW; model and "
                       r"optimizer look swapped: pass model=<the nn.Module>, optimizer=<its optimizer>$"):  # fmt: skip
        call(model=opt, optimizer=model)
    with pytest.raises(TypeError, match=r"^optimizer must be a torch.optim.Optimizer or None, got dict$"):
        call(model=model, optimizer={"lr": 0.1})
    assert not (tmp_path / "d").exists()


def _load_latest_all_ranks(root: str):
    model, opt = build(LAYOUTS["fsdp4"], seed=3)
    try:
        state = ck.load_latest(root, model=model, optimizer=opt, rng=False)
    except ValueError as exc:
        return str(exc)
    return None if state is None else state.step


def test_load_latest_on_every_rank(fused_tp2):
    path, _ = fused_tp2
    (path.parent / "empty").mkdir(exist_ok=True)
    assert run_distributed(_load_latest_all_ranks, str(path.parent / "empty"), world_size=4) == [None] * 4
    missing = run_distributed(_load_latest_all_ranks, str(path.parent / "missing"), world_size=4)
    assert all("missing' does not exist" in e for e in missing), missing  # every rank, rank 0's words
    assert all(("[raised on rank 0;" in e) == (r > 0) for r, e in enumerate(missing)), missing
    # The fused checkpoint has gate_proj / up_proj keys the unfused model lacks: strict load
    # fails on every rank alike (no hang), naming the keys.
    errors = run_distributed(_load_latest_all_ranks, str(path.parent), world_size=4)
    assert all("not in the model: 'model.gate_proj.weight'" in e for e in errors), errors


# --------------------------------------------------------------------------- reference Llama


def _llama(root: str, layout: dict, mode: str, seed: int):
    """Train the reference Llama one step in ``layout``; save it, or load into it."""
    import torch.nn.functional as F
    from shardbridge._mesh import ParallelDims
    from shardbridge.models import Llama, LlamaConfig, parallelize_llama, synthetic_batch

    cfg = LlamaConfig.tiny(num_layers=1, vocab_size=64)
    pm = ParallelDims(**layout).build_mesh("cpu")
    model = parallelize_llama(Llama(cfg, seed=seed), pm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, labels = synthetic_batch(cfg, 4, 8, seed=seed, dp_rank=pm["dp"].get_local_rank(), dp_size=pm["dp"].size())
    F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
    opt.step()
    if mode == "save":
        ck.save(f"{root}/llama", model=model, optimizer=opt, step=1, parallel_dims=pm.dims)
    else:
        ck.load(f"{root}/llama", model=model, optimizer=opt, rng=False)
    state = full_state(model, opt)
    return state if dist.get_rank() == 0 else None


def test_reference_llama_resumes_in_another_layout(tmp_path):
    """Fused qkv and gate_up under FSDP2 x TP(2), trained for real, loaded at FSDP(4) (tp=1)."""
    want = run_distributed(_llama, str(tmp_path), {"dp_shard": 2, "tp": 2}, "save", 0, world_size=4)[0]
    assert {"model.layers.0.attention.k_proj.weight", "model.layers.0.feed_forward.up_proj.weight"} <= set(want)
    got = run_distributed(_llama, str(tmp_path), {"dp_shard": 4}, "load", 1, world_size=4)[0]
    assert_equal_states(got, want)


def _trained_mlp(lr: float):
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.9))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def test_param_groups_are_one_item_and_format_1_still_loads(tmp_path, monkeypatch):
    """[Note: packed param groups]: one DCP item for all hyperparameters; old checkpoints load."""
    import torch.distributed.checkpoint as dcp
    from shardbridge.checkpoint.state import _state

    model, opt = _trained_mlp(lr=0.02)
    ck.save(tmp_path / "v2", model=model, optimizer=opt, step=1)
    keys = dcp.FileSystemReader(tmp_path / "v2").read_metadata().state_dict_metadata
    assert [k for k in keys if k.startswith("optim.param_groups")] == ["optim.param_groups"]

    # A format-1 checkpoint: every hyperparameter its own item, manifest version 1.
    monkeypatch.setattr(_state, "_pack_param_groups", lambda state: None)
    ck.save(tmp_path / "v1", model=model, optimizer=opt, step=1)
    monkeypatch.undo()
    manifest_path = tmp_path / "v1" / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "format_version": 1}))
    keys = dcp.FileSystemReader(tmp_path / "v1").read_metadata().state_dict_metadata
    assert "optim.param_groups.up.weight.lr" in keys and "optim.param_groups" not in keys

    for version in ("v1", "v2"):
        fresh, fresh_opt = _trained_mlp(lr=0.5)
        ck.load(tmp_path / version, model=fresh, optimizer=fresh_opt)
        assert fresh_opt.param_groups[0]["lr"] == 0.02 and fresh_opt.param_groups[0]["betas"] == (0.8, 0.9)
        for p, q in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(p, q)
            assert torch.equal(opt.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])
