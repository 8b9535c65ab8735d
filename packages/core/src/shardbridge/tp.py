"""shardbridge.tp: a framework's local tensor-parallel shards as DTensor parameters.

For modules that keep their own TP shard as a plain parameter (TransformerEngine, Megatron):
:func:`to_dtensor_param` builds the DTensor parameter on the ``tp`` axis (uneven-safe: the global
shape is explicit or gathered), :func:`convert_module_params` does it for a module's parameters,
:func:`local_view` hands the framework its local tensor inside forward with the gradient
re-wrapped. :class:`TPMode` names how a weight is split, :func:`tp_placements` the placements it
gives, :func:`check_tp_divides` refuses sizes a tp degree does not divide. See [Note: TP
placements] in ``_tp.py``. Torch modules use torch's own ``parallelize_module`` instead.
"""

from shardbridge._tp import (
    TPMode,
    check_tp_divides,
    convert_module_params,
    local_view,
    to_dtensor_param,
    tp_placements,
    unview_tp_output,
)

__all__ = [
    "TPMode",
    "check_tp_divides",
    "convert_module_params",
    "local_view",
    "to_dtensor_param",
    "tp_placements",
    "unview_tp_output",
]
