"""shardbridge.models: the reference Llama every layout and adapter is checked against.

Public: :class:`LlamaConfig`, :class:`Llama`, :class:`ParamTP`, :func:`parallelize_llama`,
:func:`synthetic_batch`. The block classes (``Attention``, ``FeedForward``,
``TransformerBlock``) and ``apply_tp`` in ``_parallelize`` are not public.
"""

from shardbridge.models._llama import Llama, LlamaConfig, ParamTP, synthetic_batch
from shardbridge.models._parallelize import parallelize_llama

__all__ = ["Llama", "LlamaConfig", "ParamTP", "parallelize_llama", "synthetic_batch"]
