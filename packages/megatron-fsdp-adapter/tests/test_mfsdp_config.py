"""Pure and small tests: errors, precision lowering, version gate, CPU patch."""

from __future__ import annotations

import sys

import pytest
import torch
from shardbridge import PrecisionPolicy
from shardbridge.testing import run_distributed
from shardbridge_megatron_fsdp import _compat, _cpu_patch, to_megatron_policy


def test_precision_lowering():
    p = to_megatron_policy(PrecisionPolicy.bf16_comm())
    assert (p.main_params_dtype, p.main_grads_dtype, p.grad_comm_dtype) == (
        torch.float32,
        torch.float32,
        torch.bfloat16,
    )
    p = to_megatron_policy(PrecisionPolicy.bf16())
    # fp32 main grads explicitly (Megatron-FSDP's None would follow a bf16 model)
    assert (p.main_grads_dtype, p.grad_comm_dtype) == (torch.float32, None)


def test_precision_refuses_what_megatron_cannot_do():
    with pytest.raises(NotImplementedError, match="output_dtype"):
        to_megatron_policy(PrecisionPolicy(output_dtype=torch.float32))
    with pytest.raises(ValueError, match="PrecisionPolicy"):
        to_megatron_policy("bf16")


def test_version_parse_and_gate():
    assert _compat.parse_version("0.6.1rc2") == (0, 6, 1)  # the core's parser, shared by every adapter
    assert (0, 6, 1) <= _compat.megatron_fsdp_version() < (0, 7)
    # The hazard is absent in this environment, and megatron_core_version has megatron_fsdp_version's contract.
    with pytest.raises(ImportError, match=r'needs megatron-core; install it with pip install "megatron-core==0\.16\.1".*the megatron-core extra'):
        _compat.megatron_core_version()


def test_cpu_patch_is_scoped_and_reversible():
    import megatron_fsdp.megatron_fsdp as mm

    was = _cpu_patch.installed()
    _cpu_patch.uninstall()
    assert mm.torch is torch
    with _cpu_patch.cpu_patch() as active:
        assert active  # no CUDA here
        assert mm.torch is not torch and isinstance(mm.torch.cuda.current_stream(), _cpu_patch._HostStream)
        assert torch.cuda.current_device is not mm.torch.cuda.current_device  # real torch untouched
    assert mm.torch is torch
    if was:
        _cpu_patch.install()


def _patch_outlives_context() -> tuple:
    # shard_model inside a cpu_patch() context: the model calls the shims on every step, so the
    # context must not take the patch away when it exits (without the pin this step dies with
    # "Torch not compiled with CUDA enabled").
    from mfsdp_helpers import build, train

    with _cpu_patch.cpu_patch():
        pm, model, opt = build({"dp_shard": 4}, "optim_grads_params")
    losses = train(pm, model, opt, steps=1)
    try:
        _cpu_patch.uninstall()
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return _cpu_patch.installed(), len(losses), refused


def test_cpu_patch_outlives_context_when_a_model_needs_it():
    for installed, steps, refused in run_distributed(_patch_outlives_context, world_size=4, timeout=300):
        assert installed and steps == 1
        assert "pinned" in refused and "uninstall(force=True)" in refused


def test_import_is_lazy():
    code = "import sys, shardbridge_megatron_fsdp; assert 'megatron_fsdp' not in sys.modules"
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)


def _comm_bytes() -> dict:
    import warnings

    from mfsdp_helpers import build, train
    from shardbridge._comm_stats import count_collectives

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        bf16 = PrecisionPolicy(grad_comm_dtype=torch.bfloat16)
    for name, policy in (("fp32", None), ("bf16", bf16)):
        pm, model, opt = build({"dp_shard": 4}, "optim_grads_params", policy=policy)
        with count_collectives() as counts:
            losses = train(pm, model, opt)
        out[name] = (counts.bytes["reduce_scatter"], losses)
    return out


def test_bf16_grad_comm_halves_bytes_within_bound():
    from mfsdp_helpers import reference

    result = run_distributed(_comm_bytes, world_size=4, timeout=300)[0]
    (b32, l32), (b16, l16) = result["fp32"], result["bf16"]
    assert b16 * 2 == b32 > 0
    ref, _ = reference()
    assert l32 == pytest.approx(ref, rel=1e-5)
    # bf16 keeps 8 significant bits: each reduced gradient element is off by <= 2**-8
    # relative, so 3 SGD steps move the loss by well under 1e-3 relative; and it is not
    # bit-identical to fp32 (the communication really was bf16).
    assert l16 == pytest.approx(ref, rel=1e-3)
    assert l16 != l32
