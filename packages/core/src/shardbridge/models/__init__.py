"""shardbridge.models: the reference Llama every layout and adapter is checked against.

Public: :class:`LlamaConfig`, :class:`Llama`, :class:`ParamTP`, :func:`parallelize_llama` (and
its TP step alone, :func:`apply_llama_tp`), :func:`synthetic_batch`, and the Hugging Face view of
it: :func:`hf_llama_name`, :func:`hf_llama_config`, :func:`export_hf_llama`. The block classes
(``Attention``, ``FeedForward``, ``TransformerBlock``) are not public.
"""

from shardbridge.models._hf import export_hf_llama, hf_llama_config, hf_llama_export_record, hf_llama_name
from shardbridge.models._llama import Llama, LlamaConfig, ParamTP, synthetic_batch
from shardbridge.models._parallelize import apply_llama_tp, parallelize_llama

__all__ = [
    "Llama",
    "LlamaConfig",
    "ParamTP",
    "apply_llama_tp",
    "export_hf_llama",
    "hf_llama_config",
    "hf_llama_export_record",
    "hf_llama_name",
    "parallelize_llama",
    "synthetic_batch",
]
