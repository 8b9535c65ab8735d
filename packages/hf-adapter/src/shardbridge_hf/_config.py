"""The shardbridge block of an Accelerate config file, validated into frozen configs.

[Note: where the block lives in the yaml]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Accelerate 1.15 refuses unknown TOP-LEVEL keys of a config file ("had unknown keys"), has no
plugin entry points, and a custom ``KwargsHandler`` raises ``KeyError``. Its ``fsdp_config``
section, however, is copied key by key onto the launch arguments (``fsdp_config.x`` ->
``args.fsdp_x``), and keys it does not know are dropped without error. So the block is
namespaced under ``fsdp_config.shardbridge``::

    distributed_type: FSDP
    fsdp_config:
      fsdp_version: 2
      shardbridge:              # <- read by shardbridge-launch, ignored by accelerate
        precision: bf16
        fp8: {backend: torchao, recipe: tensorwise}
        checkpoint: {export_dtype: bfloat16}
    parallelism_config:
      parallelism_config_dp_shard_size: 2
      parallelism_config_tp_size: 2

Accelerate's own loader (``load_config_from_file``) accepts this file (tested). Since the
block never reaches the workers through Accelerate, the launcher validates it and hands it
over as JSON in the environment variable :data:`ENV_VAR`, together with the parallel degrees
and ``use_cpu``; :class:`~shardbridge_hf.ShardbridgeAccelerator` reads it there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from shardbridge import ParallelDims, PrecisionPolicy, fp8
from shardbridge.adapters import did_you_mean, parse_size
from shardbridge.fp8 import FP8Recipe
from torch.distributed.tensor.parallel import ParallelStyle

from shardbridge_hf._ep import EP_STYLES
from shardbridge_hf._tp import SUPPORTED_STYLES

__all__ = [
    "BLOCK_KEY",
    "ENV_VAR",
    "CheckpointConfig",
    "FP8Config",
    "HFConfig",
]

#: Where the block sits in an Accelerate config file.
BLOCK_KEY = "fsdp_config.shardbridge"
#: Environment variable the launcher passes the validated config in (JSON).
ENV_VAR = "SHARDBRIDGE_HF_CONFIG"

#: ``ep_implementation`` values ("all_reduce" runs as "all_gather", see :attr:`HFConfig.ep_implementation`).
EP_IMPLEMENTATIONS = ("auto", "all_to_all", "all_gather", "all_reduce")

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


@dataclass(frozen=True, kw_only=True)
class FP8Config:
    """The yaml block ``fsdp_config.shardbridge.fp8``: the core's :class:`~shardbridge.fp8.FP8Recipe`, spelled for yaml.

    :meth:`to_recipe` gives the recipe ``parallelize`` converts the model with; validation is the
    recipe's own (the names) and the backend's (``shardbridge.fp8.get_backend(backend).check``),
    each rule in one place, so every error names a yaml key and what the backend supports. The TE knobs keep Accelerate's yaml names (``amax_history_length``,
    upstream bug 7) and become recipe parameters; ``params`` passes any other backend parameter.

    Example:
        >>> FP8Config(backend="torchao", recipe="rowwise").to_recipe().name
        'rowwise'
    """

    PARAM_KEYS: ClassVar[Mapping[str, str]] = {
        "amax_history_length": "amax_history_len",
        "amax_compute_algo": "amax_compute_algo",
        "fp8_format": "fp8_format",
        "margin": "margin",
    }
    """yaml key -> recipe parameter name."""

    backend: str = "none"
    """"none" = no FP8; "torchao" (CPU/gloo and GPU) or "te" (TransformerEngine, GPU): the
    registered backend (``shardbridge.fp8.backend_names()``)."""

    recipe: str | None = None
    """Scaling recipe (:class:`shardbridge.fp8.FP8Recipe` names): torchao tensorwise, rowwise,
    rowwise_with_gw_hp, mxfp8; te tensorwise (= current), delayed, mxfp8, blockwise, nvfp4.
    None = tensorwise. Refused with backend "none" (it would be ignored)."""

    fp8_params: bool = False
    """te only: keep the weights themselves in FP8 (``te.quantized_model_init``)."""

    all_gather_fp8: bool | None = None
    """None = the recipe's own choice (torchao tensorwise: float8 all-gather)."""

    amax_history_length: int | None = None
    """te delayed: TE ``amax_history_len`` (None = 1024)."""

    amax_compute_algo: str | None = None
    """te delayed: "max" or "most_recent" (None = most_recent)."""

    fp8_format: str | None = None
    """te: "HYBRID" or "E4M3" (None = the TE recipe's default)."""

    margin: int | None = None
    """te delayed / mxfp8: scaling-factor margin (None = 0)."""

    params: Mapping[str, Any] = field(default_factory=dict)
    """Further recipe parameters, e.g. torchao mxfp8 ``{kernel: emulated}``."""

    def __post_init__(self) -> None:
        _one_of("fp8.backend", self.backend, ("none", *fp8.backend_names()))
        _bool("fp8.fp8_params", self.fp8_params)
        if not isinstance(self.params, Mapping):
            raise ValueError(f"{BLOCK_KEY}.fp8.params={self.params!r} must be a mapping")
        twice = [key for key, ours in self.PARAM_KEYS.items() if getattr(self, key) is not None and ours in self.params]
        if twice:
            raise ValueError(
                f"{BLOCK_KEY}.fp8 sets {twice} both as key(s) and in fp8.params "
                f"({[self.PARAM_KEYS[k] for k in twice]}); keep one"
            )
        self.to_recipe()  # the recipe's and the backend's checks, named by yaml key

    @property
    def enabled(self) -> bool:
        """Whether FP8 is on."""
        return self.backend != "none"

    def recipe_params(self) -> dict[str, Any]:
        """The recipe parameters the block sets (yaml names translated; upstream bug 7).

        Example:
            >>> FP8Config(backend="te", recipe="delayed", amax_history_length=16).recipe_params()
            {'amax_history_len': 16}
        """
        out = {ours: getattr(self, key) for key, ours in self.PARAM_KEYS.items() if getattr(self, key) is not None}
        return {**out, **dict(self.params)}

    def to_recipe(self) -> FP8Recipe | None:
        """The core recipe, checked by its backend, or None for backend "none".

        Raises:
            ValueError: a bad recipe name or field, naming the yaml key.
        """
        if not self.enabled:
            if self.recipe is not None:
                raise ValueError(
                    f"{BLOCK_KEY}.fp8.recipe={self.recipe!r} is set but fp8.backend is none (no FP8: the recipe would be "
                    "ignored); set fp8.backend: torchao or te"
                )
            if self.fp8_params or self.recipe_params() or self.all_gather_fp8 is not None:
                raise ValueError(f"{BLOCK_KEY}.fp8 sets recipe options with backend: none; set backend: torchao or te")
            return None
        try:
            recipe = FP8Recipe(
                backend=self.backend,
                name=self.recipe or "tensorwise",
                params=self.recipe_params(),
                all_gather_fp8=self.all_gather_fp8,
                fp8_params=self.fp8_params,
            )
        except ValueError as e:
            # FP8Recipe names its fields ("FP8Recipe.params=..."); the yaml keys are fp8.<field>.
            raise ValueError(
                f"{BLOCK_KEY}.{str(e).replace('FP8Recipe.name=', 'fp8.recipe=').replace('FP8Recipe.', 'fp8.')}"
            ) from None
        try:
            fp8.get_backend(recipe.backend).check(recipe)
        except (ValueError, NotImplementedError) as e:
            where = f"backend {recipe.backend!r}, recipe {recipe.name!r}"
            raise ValueError(f"{BLOCK_KEY}.fp8 ({where}): {self._yaml_names(str(e))}") from None
        return recipe

    def _yaml_names(self, message: str) -> str:
        """A backend's message with each recipe parameter named by the yaml key the user wrote.

        Backends name recipe parameters as ``fp8.params.<name>`` (``amax_history_len``); a
        parameter set through one of :attr:`PARAM_KEYS` (``amax_history_length: 16``) is named
        ``fp8.amax_history_length`` instead, the key in the user's file.
        """
        for key, ours in self.PARAM_KEYS.items():
            if getattr(self, key) is None or ours in self.params:
                continue
            message = message.replace(f"fp8.params.{ours}", f"fp8.{key}")
            if ours != key:
                message = message.replace(f"'{ours}'", f"'{key}'")
        return message


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How ``save_state`` / ``load_state`` / export behave.

    Example:
        >>> CheckpointConfig(export_dtype="bfloat16").export_dtype
        'bfloat16'
    """

    export_dtype: str | None = None
    """dtype of exported safetensors ("bfloat16", "float32", "float16"); None = as trained."""

    max_shard_size: str = "2GB"
    """Largest exported safetensors file."""

    on_bad_layout: str = "repair"
    """"repair" or "error": what to do with DTensor layouts DCP would describe wrongly."""

    def __post_init__(self) -> None:
        if self.export_dtype is not None:
            _one_of("checkpoint.export_dtype", self.export_dtype, ("bfloat16", "float32", "float16"))
        if not isinstance(self.max_shard_size, (str, int)) or isinstance(self.max_shard_size, bool):
            raise ValueError(f"{BLOCK_KEY}.checkpoint.max_shard_size={self.max_shard_size!r}: use e.g. '2GB'")
        try:
            parse_size(self.max_shard_size)
        except ValueError:
            raise ValueError(
                f"{BLOCK_KEY}.checkpoint.max_shard_size={self.max_shard_size!r} is not a size > 0; use an int of "
                "bytes or e.g. '2GB', '500MB', '1GiB'"
            ) from None
        _one_of("checkpoint.on_bad_layout", self.on_bad_layout, ("repair", "error"))


@dataclass(frozen=True, kw_only=True)
class HFConfig:
    """Everything shardbridge adds to an Accelerate run: the validated yaml block.

    Example:
        >>> cfg = HFConfig.from_block({"precision": "bf16", "fp8": {"backend": "torchao"}})
        >>> cfg.policy().param_dtype, cfg.fp8.backend
        (torch.bfloat16, 'torchao')
    """

    precision: str | Mapping[str, str | None] = "fp32"
    """A preset ("fp32", "bf16", "bf16_comm") or a mapping of the policy's dtypes:
    ``{param_dtype, main_params_dtype, main_grads_dtype, grad_comm_dtype, output_dtype}``
    (names as "bfloat16"/"bf16", None = default)."""

    fp8: FP8Config = field(default_factory=FP8Config)
    """FP8 training (off by default)."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint and export options."""

    tp_plan: str | Mapping[str, str] = "auto"
    """"auto" = the model's own plan (``model.tp_plan``: ``base_model_tp_plan`` + its
    ``_tp_plan``); or an explicit ``{module pattern: style}`` (``*`` matches a layer index)."""

    ep_size: int = 1
    """Expert-parallel degree (transformers' ``DistributedConfig.ep_size``): the model's
    expert-parallel plan splits its experts over ``ep_size`` of the ``dp_shard x cp x tp`` ranks
    (it must divide their product; it adds no ranks) and FSDP2 shards each expert over the rest
    (``ParallelDims.ep``, docs/concepts/moe.md). 1 = the TP plan shards the experts over tp."""

    ep_plan: str | Mapping[str, str] = "auto"
    """With ``ep_size > 1``: "auto" = the model's own plan (``model.ep_plan``:
    ``base_model_ep_plan``); or ``{module / parameter pattern: style}`` with the styles
    ``ep_dispatch_experts`` (an experts module) and ``grouped_gemm`` (each of its parameters)."""

    ep_implementation: str = "auto"
    """How tokens reach their experts (transformers' name): "all_to_all", "all_gather" or "auto"
    (``shardbridge.ep.choose_dispatch``: all_gather when top_k >= ep). "all_reduce", transformers'
    variant for ep groups sharing one batch, is the same computation here and runs as "all_gather"."""

    reshard_after_forward: bool | str = "default"
    """FSDP2: "default" (all units but the last), True, or False."""

    sync_module_states: bool = True
    """Broadcast rank 0's weights before sharding (ranks may have initialised differently)."""

    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them
    (transformers' gradient checkpointing, non-reentrant). Accelerate's
    ``fsdp_activation_checkpointing`` sets it."""

    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer states on CPU (FSDP2's
    ``CPUOffloadPolicy`` through the core's ``apply_fsdp``). Accelerate's ``fsdp_offload_params`` sets it."""

    dims: ParallelDims | None = None
    """The parallel degrees (filled by the launcher from ``parallelism_config``). None = read
    Accelerate's ``ParallelismConfig``."""

    use_cpu: bool | None = None
    """Train on CPU with gloo (filled by the launcher from ``use_cpu``). None = CPU when no GPU."""

    PRECISION_FIELDS: ClassVar[tuple[str, ...]] = (
        "param_dtype",
        "main_params_dtype",
        "main_grads_dtype",
        "grad_comm_dtype",
        "output_dtype",
    )

    def __post_init__(self) -> None:
        if isinstance(self.precision, str):
            _one_of("precision", self.precision, PrecisionPolicy.PRESETS)
        elif isinstance(self.precision, Mapping):
            refuse_unknown_keys(f"{BLOCK_KEY}.precision", self.precision, self.PRECISION_FIELDS, "; or a preset name")
            for key, value in self.precision.items():
                if value is not None:
                    _dtype(f"precision.{key}", value)
        else:
            raise ValueError(f"{BLOCK_KEY}.precision={self.precision!r}: use a preset name or a mapping of dtypes")
        if not isinstance(self.fp8, FP8Config):
            raise ValueError(f"{BLOCK_KEY}.fp8 must be a mapping, got {self.fp8!r}")
        if isinstance(self.tp_plan, str):
            if self.tp_plan != "auto":
                raise ValueError(f"{BLOCK_KEY}.tp_plan={self.tp_plan!r}: use 'auto' or a mapping of module patterns")
        elif not isinstance(self.tp_plan, Mapping):
            raise ValueError(f"{BLOCK_KEY}.tp_plan must be 'auto' or a mapping, got {self.tp_plan!r}")
        else:
            _check_tp_plan(self.tp_plan)
        _int("ep_size", self.ep_size, minimum=1)
        if isinstance(self.ep_plan, str):
            if self.ep_plan != "auto":
                raise ValueError(f"{BLOCK_KEY}.ep_plan={self.ep_plan!r}: use 'auto' or a mapping of patterns")
        elif not isinstance(self.ep_plan, Mapping) or not all(
            isinstance(k, str) and v in EP_STYLES for k, v in self.ep_plan.items()
        ):
            raise ValueError(
                f"{BLOCK_KEY}.ep_plan={self.ep_plan!r}: use 'auto' or a mapping of module / parameter patterns to "
                f"{list(EP_STYLES)}"
            )
        _one_of("ep_implementation", self.ep_implementation, EP_IMPLEMENTATIONS)
        if self.dims is not None:
            self.parallel_dims(self.dims)  # ep_size must fit the degrees
        if self.reshard_after_forward != "default" and not isinstance(self.reshard_after_forward, bool):
            raise ValueError(
                f"{BLOCK_KEY}.reshard_after_forward={self.reshard_after_forward!r}: use true, false or 'default'"
            )
        _bool("sync_module_states", self.sync_module_states)
        _bool("activation_checkpointing", self.activation_checkpointing)
        _bool("cpu_offload", self.cpu_offload)
        if self.dims is not None and not isinstance(self.dims, ParallelDims):
            raise ValueError(f"dims must be a shardbridge.ParallelDims, got {self.dims!r}")
        # Building the policy validates the dtype combination (FSDP2 rules included).
        self.policy()

    def parallel_dims(self, dims: ParallelDims) -> ParallelDims:
        """``dims`` with ``ep`` = :attr:`ep_size` (``dims.ep`` kept when ``ep_size`` is 1).

        Raises:
            ValueError: ``dims.ep`` and ``ep_size`` disagree, or ``ep_size`` does not divide
                ``dp_shard * cp * tp`` (naming the yaml key).
        """
        if self.ep_size == 1 or dims.ep == self.ep_size:
            return dims
        if dims.ep != 1:
            raise ValueError(
                f"{BLOCK_KEY}.ep_size={self.ep_size} disagrees with the parallel dims' ep={dims.ep}; set one of them"
            )
        out = dataclasses.replace(dims, ep=self.ep_size)
        if out.is_resolved:
            try:
                out.resolve(out.world_size)
            except ValueError as e:
                raise ValueError(f"{BLOCK_KEY}.ep_size={self.ep_size}: {e}") from None
        return out

    @property
    def ep_dispatch(self) -> str:
        """:attr:`ep_implementation` as ``shardbridge.ep.run_experts``' dispatch ("all_reduce" -> "all_gather")."""
        return "all_gather" if self.ep_implementation == "all_reduce" else self.ep_implementation

    def policy(self) -> PrecisionPolicy:
        """The core :class:`~shardbridge.PrecisionPolicy` this config asks for (FP8 is :attr:`fp8`'s recipe).

        Raises:
            ValueError: a dtype combination torch FSDP2 cannot run; the message says which key.
        """
        if isinstance(self.precision, str):
            policy = PrecisionPolicy.from_name(self.precision)
        else:
            kwargs = {k: _dtype(f"precision.{k}", v) for k, v in self.precision.items() if v is not None}
            try:
                policy = PrecisionPolicy(**kwargs)
            except ValueError as e:
                raise ValueError(f"{BLOCK_KEY}.precision: {e}") from None
        try:
            policy.check_grads_match_params()  # the core's FSDP2 rule, named by its yaml key here
        except NotImplementedError as e:
            raise ValueError(f"{BLOCK_KEY}.precision: {e}") from None
        return policy

    # -- yaml block <-> config <-> JSON --------------------------------------------------------

    @classmethod
    def from_block(cls, block: Mapping[str, Any] | None, **overrides: Any) -> HFConfig:
        """Validate the yaml block (a mapping, as ``yaml.safe_load`` gives it).

        Raises:
            ValueError: unknown keys or bad values, naming the yaml key and the fix.
        """
        block = dict(block or {})
        refuse_unknown_keys(BLOCK_KEY, block, {f.name for f in dataclasses.fields(cls)} - {"dims", "use_cpu"})
        for name, sub in (("fp8", FP8Config), ("checkpoint", CheckpointConfig)):
            value = block.get(name)
            if value is None:
                block.pop(name, None)
                continue
            if not isinstance(value, Mapping):
                raise ValueError(f"{BLOCK_KEY}.{name} must be a mapping, got {value!r}")
            sub_known = {f.name for f in dataclasses.fields(sub)}
            sub_unknown = sorted((k for k in value if k not in sub_known), key=str)
            refuse_unknown_keys(
                f"{BLOCK_KEY}.{name}", value, sub_known, _fp8_key_hint(sub_unknown) if sub is FP8Config else ""
            )
            _refuse_containers_for_scalars(f"{name}.", sub, value)
            block[name] = sub(**value)
        _refuse_containers_for_scalars("", cls, {k: v for k, v in block.items() if k not in ("fp8", "checkpoint")})
        return cls(**block, **overrides)

    def to_json(self) -> str:
        """JSON for :data:`ENV_VAR` (round-trips through :meth:`from_json`)."""
        data = dataclasses.asdict(self)
        data["dims"] = None if self.dims is None else dataclasses.asdict(self.dims)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HFConfig:
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        dims = data.pop("dims", None)
        use_cpu = data.pop("use_cpu", None)
        return cls.from_block(data, dims=None if dims is None else ParallelDims(**dims), use_cpu=use_cpu)

    @classmethod
    def from_env(cls) -> HFConfig | None:
        """The config the launcher put in :data:`ENV_VAR`, or None. (The worker-side edge.)"""
        text = os.environ.get(ENV_VAR)
        return None if not text else cls.from_json(text)


def _check_tp_plan(plan: Mapping[Any, Any]) -> None:
    """Each entry a module pattern (str) and a style this adapter lowers (or a torch ParallelStyle)."""
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(
                f"{BLOCK_KEY}.tp_plan has the key {pattern!r}; keys are module patterns such as "
                "'model.layers.*.mlp.up_proj'"
            )
        if isinstance(style, ParallelStyle):
            continue
        if not isinstance(style, str) or style not in SUPPORTED_STYLES:
            raise ValueError(
                f"{BLOCK_KEY}.tp_plan[{pattern!r}]={style!r} is not a TP style shardbridge_hf supports; choose one "
                f"of {list(SUPPORTED_STYLES)}"
            )


def refuse_unknown_keys(where: str, given: Mapping[Any, Any], known: Iterable[str], hint: str = "") -> None:
    """ValueError naming each key of ``given`` that is not in ``known``, with the closest known key.

    A misspelled key would otherwise be dropped or refused without saying which key was meant
    (``precison`` -> ``precision``). ``hint`` is appended (where an unknown key may belong instead).

    Example:
        >>> refuse_unknown_keys("fsdp_config.shardbridge", {"precison": "bf16"}, ["precision", "fp8"])
        Traceback (most recent call last):
        ...
        ValueError: fsdp_config.shardbridge.precison: unknown key; did you mean 'precision'? (known keys: ['fp8', 'precision'])
    """
    known = sorted(known)
    unknown = [k for k in given if k not in known]
    if not unknown:
        return
    named = "; ".join(f"{where}.{k}: unknown key{did_you_mean(k, known)}" for k in sorted(unknown, key=str))
    raise ValueError(f"{named} (known keys: {known}){hint}")


def _dtype(key: str, value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str) or value.lower() not in _DTYPES:
        raise ValueError(f"{BLOCK_KEY}.{key}={value!r} is not a dtype; use one of {sorted(_DTYPES)}")
    return _DTYPES[value.lower()]


def _fp8_key_hint(unknown: list[str]) -> str:
    """Where an unknown fp8 key belongs: its yaml spelling, or ``fp8.params`` (backend parameters)."""
    yaml_key = {ours: key for key, ours in FP8Config.PARAM_KEYS.items() if ours != key}
    hints = [f"write {yaml_key[k]}: instead of {k}:" for k in unknown if k in yaml_key]
    # a key close to a known one is a typo (did-you-mean says which); the rest may be backend parameters
    known = [f.name for f in dataclasses.fields(FP8Config)]
    rest = [k for k in unknown if k not in yaml_key and not did_you_mean(k, known)]
    if rest:
        hints.append(f"if {rest} are parameters of the backend's recipe, put them under fp8.params: {{{rest[0]}: ...}}")
    return "".join(f"; {h}" for h in hints)


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{BLOCK_KEY}.{key}={value!r} is not allowed; choose one of {list(allowed)}")


def _bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{BLOCK_KEY}.{key}={value!r} must be true or false")


def _int(key: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{BLOCK_KEY}.{key}={value!r} must be an int >= {minimum}")


_SCALARS = (str, int, float, bool, type(None))


def _refuse_containers_for_scalars(prefix: str, cls: type, values: Mapping[str, Any]) -> None:
    """A list or mapping where a field takes one value is refused by its yaml key.

    The fields' own checks compare names and numbers; a yaml list or mapping (even a recursive
    one: ``&r [*r]``) reaching them fails with "unhashable type" instead of an error naming the key.
    """
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if not isinstance(value, (list, tuple, set, Mapping)):
            continue
        hint = hints.get(key)
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if allowed and all(t in _SCALARS for t in allowed):
            kinds = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(
                f"{BLOCK_KEY}.{prefix}{key} takes a single value ({kinds}), got a {type(value).__name__}: "
                f"{key}: <one {kinds} value>"
            )
