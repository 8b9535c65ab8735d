"""shardbridge.models: the reference Llama and mixture-of-experts models every layout is checked against.

Public: :class:`LlamaConfig`, :class:`Llama`, :class:`ParamTP`, :func:`parallelize_llama` (and
its TP step alone, :func:`apply_llama_tp`), :func:`synthetic_batch`; the mixture of experts
:class:`MoEConfig`, :class:`MoELlama`, :func:`parallelize_moe`; and the
Hugging Face view of both: :func:`hf_llama_name`, :func:`hf_llama_config`, :func:`export_hf_llama`,
:func:`hf_llama_export_record` (what a checkpoint records so that ``shardbridge ckpt export``
writes a ``from_pretrained`` folder), :func:`hf_moe_name`, :func:`hf_moe_config`,
:func:`export_hf_moe`. The block classes (``Attention``, ``FeedForward``, ``TransformerBlock``,
``MoEFeedForward``, ``GroupedExperts``) are not public.
"""

from shardbridge._deprecation import deprecated_getattr as _deprecated_getattr
from shardbridge.models._hf import export_hf_llama, hf_llama_config, hf_llama_export_record, hf_llama_name
from shardbridge.models._hf_moe import export_hf_moe, hf_moe_config, hf_moe_name
from shardbridge.models._llama import Llama, LlamaConfig, ParamTP, synthetic_batch
from shardbridge.models._moe import MoEConfig, MoELlama
from shardbridge.models._parallelize import apply_llama_tp, parallelize_llama
from shardbridge.models._parallelize_moe import parallelize_moe

__all__ = [
    "Llama",
    "LlamaConfig",
    "MoEConfig",
    "MoELlama",
    "ParamTP",
    "apply_llama_tp",
    "export_hf_llama",
    "export_hf_moe",
    "hf_llama_config",
    "hf_llama_export_record",
    "hf_llama_name",
    "hf_moe_config",
    "hf_moe_name",
    "parallelize_llama",
    "parallelize_moe",
    "synthetic_batch",
]


# Public in two places in 0.1.0; its one home is shardbridge.ep ([Note: deprecated aliases] in
# shardbridge/_deprecation.py).
_DEPRECATED = {"expert_shard_dim": "shardbridge.ep.expert_shard_dim"}
__getattr__ = _deprecated_getattr(__name__, _DEPRECATED)
