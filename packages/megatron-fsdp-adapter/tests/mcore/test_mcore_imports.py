"""Import isolation: the mcore subpackage imports neither megatron.core nor any megatron_fsdp until
it is used, and the Megatron-Core <-> Llama name map is pure."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_import_is_lazy():
    code = (
        "import sys, shardbridge_megatron_fsdp, shardbridge_megatron_fsdp.mcore; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'megatron_fsdp', 'transformers')]; "
        "print(bad); assert not bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_name_map_round_trip():
    from shardbridge_megatron_fsdp.mcore import hf_name, megatron_name

    for name in (
        "embedding.word_embeddings.weight",
        "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.1.self_attention.q_proj.weight",
        "decoder.layers.1.self_attention.v_proj.weight",
        "decoder.layers.1.self_attention.linear_proj.weight",
        "decoder.layers.1.pre_mlp_layernorm.weight",
        "decoder.layers.1.mlp.gate_proj.weight",
        "decoder.layers.1.mlp.linear_fc2.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    ):
        assert megatron_name(hf_name(name)) == name
    # TE layer spec: the norms fused into the linear layers map to the same Llama norms.
    assert (
        hf_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")
        == "model.layers.0.input_layernorm.weight"
    )
    assert hf_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == (
        "model.layers.0.post_attention_layernorm.weight"
    )
    assert hf_name("decoder.layers.0.self_attention.linear_qkv.weight") is None  # stored as components


def test_megatron_qkv_spec_is_per_group_at_every_tp():
    import torch
    from shardbridge._fused import split_fused
    from shardbridge_megatron_fsdp.mcore import MegatronQKVSpec

    spec = MegatronQKVSpec.megatron(num_heads=4, num_query_groups=2, head_dim=1)
    fused = torch.tensor([0, 1, 10, 20, 2, 3, 11, 21])  # [q0 q1 k0 v0 | q2 q3 k1 v1]
    for tp in (1, 2):
        parts = split_fused(fused, spec, tp)
        assert parts["q_proj"].tolist() == [0, 1, 2, 3]
        assert parts["k_proj"].tolist() == [10, 11] and parts["v_proj"].tolist() == [20, 21]
    with pytest.raises(ValueError, match="num_query_groups=2 is not divisible by tp_size=4"):
        spec.segments(4)


def test_cpu_config_check_names_the_field():
    pytest.importorskip("megatron.core")
    from mcore_helpers import gpt_config
    from shardbridge_megatron_fsdp.mcore import check_cpu_config

    with pytest.raises(ValueError, match="masked_softmax_fusion=True.*set masked_softmax_fusion=False"):
        check_cpu_config(gpt_config(1, masked_softmax_fusion=True))
