"""Checkpoints (``_checkpoint``) through ShardbridgeAccelerator on 4 gloo ranks: resume, reshard, export.

Oracles: torch.equal against the trained run's full_tensor() weights (resume and reshard),
from_pretrained logits and weights (export).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hf_helpers as H  # noqa: E402
from shardbridge import ParallelDims  # noqa: E402
from shardbridge.testing import run_distributed  # noqa: E402

DP2_TP2 = {"dp_shard": 2, "tp": 2}


# -- checkpoints: resume bit-exact, reshard, export --------------------------------------------


def _run_and_save(root: str, arch: str) -> dict:
    acc = H.sb_accelerator(ParallelDims(**DP2_TP2))
    model = H.tiny_model(arch)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    model, opt, sched = acc.prepare(model, opt, sched)
    losses = H.train_steps(acc, model, opt, 2, scheduler=sched)
    acc.save_state(f"{root}/step-2")
    losses += H.train_steps(acc, model, opt, 2, start=2, scheduler=sched)
    acc.save_state(f"{root}/step-4")
    with torch.no_grad():
        logits = model(input_ids=H.global_batch(99, 1)).logits
    return {"losses": losses, "params": H.full_params(model), "logits": logits, "lr": sched.get_last_lr()}


def _resume(root: str, arch: str, dims: dict, ckpt: str, more_steps: int) -> dict:
    acc = H.sb_accelerator(ParallelDims(**dims))
    model = H.tiny_model(arch, seed=123)  # different init: everything must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    model, opt, sched = acc.prepare(model, opt, sched)
    step = acc.load_state(f"{root}/{ckpt}")
    loaded = H.full_params(model)
    with torch.no_grad():
        logits = model(input_ids=H.global_batch(99, 1)).logits
    losses = H.train_steps(acc, model, opt, more_steps, start=step, scheduler=sched)
    return {
        "step": step,
        "loaded": loaded,
        "logits": logits,
        "losses": losses,
        "params": H.full_params(model),
        "lr": sched.get_last_lr(),
    }


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, run_distributed(_run_and_save, root, "llama", world_size=4, timeout=240)[0]


def test_resume_is_bit_exact(saved_run):
    root, first = saved_run
    for r in run_distributed(_resume, root, "llama", DP2_TP2, "step-2", 2, world_size=4, timeout=240):
        assert r["step"] == 2
        assert r["losses"] == first["losses"][2:]  # bit-exact: same layout, same RNG, same scheduler
        assert r["lr"] == first["lr"]
        for name, value in first["params"].items():
            assert torch.equal(r["params"][name], value), name


def _steps_under_accumulation(root: str) -> dict:
    """4 micro-batches with gradient_accumulation_steps=2: 2 optimizer steps; no step set by hand."""
    acc = H.sb_accelerator(ParallelDims(dp_shard=2), gradient_accumulation_steps=2)
    model = H.tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    for micro in range(1, 5):
        with acc.accumulate(model):
            ids = H.local_batch(micro, acc.parallel_mesh["dp"].get_local_rank(), 2)
            acc.backward(model(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()
    saved = acc.save_state(f"{root}/acc")
    fresh = H.sb_accelerator(ParallelDims(dp_shard=2), gradient_accumulation_steps=2)
    model2 = H.tiny_model("llama", seed=7)
    fresh.prepare(model2, torch.optim.AdamW(model2.parameters(), lr=3e-3))
    returned = fresh.load_state(saved)
    return {"counted": acc.num_optimizer_steps, "returned": returned, "restored": fresh.num_optimizer_steps,
            "accelerate_step": (acc.step, fresh.step)}  # fmt: skip


def test_load_state_restores_the_optimizer_steps_without_user_code(tmp_path):
    """[Note: the step a checkpoint records]: Accelerator.step counts micro-batches inside accumulate()
    (0 without it); the checkpoint's step is the optimizer steps that ran, and both are restored."""
    for r in run_distributed(_steps_under_accumulation, str(tmp_path), world_size=2, timeout=240):
        assert r["counted"] == r["returned"] == r["restored"] == 2, r
        assert r["accelerate_step"] == (4, 4), r


@pytest.mark.parametrize(
    "dims",
    [{"dp_shard": 4}, {"dp_shard": 1, "tp": 4}, {"dp_replicate": 2, "dp_shard": 1, "tp": 2}],
    ids=["dp_shard4", "tp4", "dp_replicate2_tp2"],
)
def test_reshard_loads_identical_weights(saved_run, dims):
    root, first = saved_run
    for r in run_distributed(_resume, root, "llama", dims, "step-4", 1, world_size=4, timeout=240):
        assert r["step"] == 4
        for name, value in first["params"].items():
            assert torch.equal(r["loaded"][name], value), name
        torch.testing.assert_close(r["logits"], first["logits"], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(torch.tensor(r["losses"])).all()


def test_export_loads_with_from_pretrained(saved_run, tmp_path):
    from shardbridge_hf import export_pretrained
    from transformers import AutoModelForCausalLM

    root, first = saved_run
    out = export_pretrained(f"{root}/step-4", tmp_path / "hf")  # config recorded in the checkpoint
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        logits = model(input_ids=H.global_batch(99, 1)).logits
    torch.testing.assert_close(logits, first["logits"], rtol=1e-5, atol=1e-5)
    for name, value in first["params"].items():
        assert torch.equal(model.state_dict()[name], value), name
    # A second export into the same folder: refused without overwrite, replaces it with overwrite=True.
    with pytest.raises(ValueError, match="overwrite"):
        export_pretrained(f"{root}/step-2", out)
    export_pretrained(f"{root}/step-2", out, overwrite=True)
    again = AutoModelForCausalLM.from_pretrained(out)
    assert not torch.equal(again.lm_head.weight, model.lm_head.weight)  # step 2's weights, not step 4's


def test_save_state_before_prepare_is_refused():
    assert all(run_distributed(_refuse_before_prepare, world_size=4, timeout=60))


def _refuse_before_prepare() -> bool:
    acc = H.sb_accelerator(ParallelDims(dp_shard=4))
    try:
        acc.save_state("/nonexistent")
    except ValueError as e:
        return "prepare" in str(e)
    return False


def _ignored_arguments_are_refused() -> dict:
    """Every argument of Accelerate's save_state / load_state / prepare is honoured or refused by name."""
    acc = H.sb_accelerator(ParallelDims(dp_shard=2))
    out = {}
    for name, call in {
        "safe_serialization": lambda: acc.save_state("/nonexistent", safe_serialization=False),
        "save_kwargs": lambda: acc.save_state("/nonexistent", max_shard_size="1GB"),
        "load_kwargs": lambda: acc.load_state("/nonexistent", load_kwargs={"map_location": "cpu"}),
        "load_func_kwargs": lambda: acc.load_state("/nonexistent", weights_only=False),
        "placement_length": lambda: acc.prepare(object(), device_placement=[True, True]),
    }.items():
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    model = H.tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        acc.prepare(model, opt, device_placement=[False, True])
        out["placement_model"] = None
    except ValueError as e:
        out["placement_model"] = str(e)
    return out


def test_ignored_arguments_are_refused_by_name():
    for r in run_distributed(_ignored_arguments_are_refused, world_size=2, timeout=120):
        assert "safe_serialization=False" in r["safe_serialization"] and "always safe" in r["safe_serialization"]
        assert "does not use ['max_shard_size']" in r["save_kwargs"]
        assert "does not use ['map_location']" in r["load_kwargs"]
        assert "does not use ['weights_only']" in r["load_func_kwargs"]
        assert "has 2 entries for 1 objects" in r["placement_length"]
        assert "device_placement[0]=False" in r["placement_model"] and "LlamaForCausalLM" in r["placement_model"]


def test_core_cli_export_writes_a_folder_from_pretrained_loads(saved_run, tmp_path):
    # `shardbridge ckpt export` is the core's (no adapter import): the config.json comes from the
    # checkpoint's manifest (extra["export"], written by the adapter's save_state).
    from shardbridge.cli._main import main
    from transformers import AutoModelForCausalLM

    root, first = saved_run
    assert main(["ckpt", "export", f"{root}/step-4", str(tmp_path / "hf"), "--no-progress"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        logits = model(input_ids=H.global_batch(99, 1)).logits
    torch.testing.assert_close(logits, first["logits"], rtol=1e-5, atol=1e-5)


# -- async save and tied embeddings (core [Note: async save], [Note: tied tensors]) ------------


def _tied_async_save(root: str) -> dict:
    from shardbridge import checkpoint

    acc = H.sb_accelerator(ParallelDims(**DP2_TP2))
    model = H.tiny_model("llama", tie_word_embeddings=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    H.train_steps(acc, model, opt, 1)
    want = H.full_params(model)
    pending = acc.save_state(f"{root}/tied", async_=True)  # the accelerator passes async_ through
    assert isinstance(pending, checkpoint.AsyncSave)
    H.train_steps(acc, model, opt, 1, start=1)  # changes the weights while the writer runs
    pending.wait()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return {"want": want, "tied": tied}


def _tied_load(root: str) -> dict:
    acc = H.sb_accelerator(ParallelDims(dp_shard=4))
    model = H.tiny_model("llama", seed=5, tie_word_embeddings=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    acc.load_state(f"{root}/tied")
    return {"params": H.full_params(model), "tied": model.lm_head.weight is model.model.embed_tokens.weight}


def test_async_save_state_of_tied_embeddings_is_one_entry_and_bit_exact(tmp_path):
    """accelerator.save_state(async_=True) holds the weights of its call; the tied embedding is stored
    once (no lm_head.weight entry) and loads bit-exact into dp_shard=4, still tied."""
    import torch.distributed.checkpoint as dcp

    saved = run_distributed(_tied_async_save, str(tmp_path), world_size=4, timeout=240)[0]
    assert saved["tied"]
    keys = dcp.FileSystemReader(tmp_path / "tied").read_metadata().state_dict_metadata
    assert "model.model.embed_tokens.weight" in keys
    assert not [k for k in keys if "lm_head" in k]
    loaded = run_distributed(_tied_load, str(tmp_path), world_size=4, timeout=240)[0]
    assert loaded["tied"]
    assert sorted(loaded["params"]) == sorted(saved["want"])
    assert all(torch.equal(loaded["params"][k], v) for k, v in saved["want"].items())


def test_non_finite_config_values_round_trip_through_the_strict_json_manifest(tmp_path):
    """GraniteMoeHybrid's time_step_limit holds inf ([Note: non-finite config values])."""
    import json
    import math

    from shardbridge_hf import _checkpoint as C
    from transformers import AutoConfig

    config = AutoConfig.for_model("granitemoehybrid", num_hidden_layers=2, time_step_limit=(0.5, float("inf")))
    recorded = C._config_record(config)
    text = json.dumps(recorded, allow_nan=False)  # strict JSON: the manifest accepts it
    back = C._decode_nonfinite(json.loads(text))
    assert back["time_step_limit"][0] == 0.5 and math.isinf(back["time_step_limit"][1])
    (tmp_path / "config.json").write_text(text)  # what `shardbridge ckpt export` writes
    assert AutoConfig.from_pretrained(tmp_path).time_step_limit == (0.5, math.inf)
