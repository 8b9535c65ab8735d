"""shardbridge.models: the reference Llama every layout and adapter is checked against.

Public: :class:`LlamaConfig`, :class:`Llama`, :class:`ParamTP`, :func:`parallelize_llama`,
:func:`synthetic_batch`, and the Hugging Face view of it: :func:`hf_llama_name`,
:func:`hf_llama_config`, :func:`export_hf_llama`, :func:`hf_llama_export_record` (what a checkpoint
records so that ``shardbridge ckpt export`` writes a ``from_pretrained`` folder). The block classes (``Attention``, ``FeedForward``,
``TransformerBlock``) and ``apply_tp`` in ``_parallelize`` are not public.
"""

from shardbridge.models._hf import export_hf_llama, hf_llama_config, hf_llama_export_record, hf_llama_name
from shardbridge.models._llama import Llama, LlamaConfig, ParamTP, synthetic_batch
from shardbridge.models._parallelize import parallelize_llama

__all__ = [
    "Llama",
    "LlamaConfig",
    "ParamTP",
    "export_hf_llama",
    "hf_llama_config",
    "hf_llama_export_record",
    "hf_llama_name",
    "parallelize_llama",
    "synthetic_batch",
]
