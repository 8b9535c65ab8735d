"""``ShardbridgeAccelerator``: Accelerate's API, shardbridge's FSDP2 x TP underneath.

[Note: what the subclass replaces]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
::

    Accelerate 1.15                              ShardbridgeAccelerator
    -------------------------------------------  ----------------------------------------------
    state: FSDP only on GPU-like devices;        FSDP2 on CPU/gloo too (state set to FSDP after
      CPU silently runs DDP (bug 4)                init, with our plugin, config and mesh)
    ParallelismConfig mesh of the axes > 1       the core 4-D mesh (dp_replicate, dp_shard, cp,
                                                   tp) handed to Accelerate as its device mesh:
                                                   data loading by dp, same batch on tp ranks
    _prepare_tp: imports ReplicateParallel,      _prepare_tp: no-op; TP from model.tp_plan on
      removed in transformers >= 5.1 (bug 1)       pm["tp"] (bug 2: transformers ignores it)
    fsdp2_prepare_model + load_full_state_dict   shardbridge_hf.parallelize: core apply_fsdp
      (TP shards broadcast as full, bug 3)         units + PrecisionPolicy, rank-0 weights
    _prepare_te: no fp8_autocast (bug 5)         the fp8 block through shardbridge.fp8: the te backend
                                                   converts with TE's own TP and autocasts (5, 7)
    _prepare_ao: hook on AcceleratedOptimizer    fp8.install_step_hook on the inner optimizer (6)
    AcceleratedScheduler: num_processes steps    dp steps per optimizer step (tp ranks share a
      per optimizer step (tp x too fast)           batch): [Note: LR schedule under TP]
    save_state: pickles, layout-bound            shardbridge.checkpoint: portable, reshardable
    clip_grad_norm_: torch's, which refuses      shardbridge.clip_grad_norm_: local norms, one
      params on two meshes (accelerate < 1.11)     all-reduce (any accelerate)
    gather_for_metrics: keeps the first          each process keeps the rows of its dp coordinate
      `remainder` rows (tp ranks repeat)           ([Note: metrics over dp])
    get_state_dict (FSDP2): torch's              full tensors on rank 0 (FP8 made plain), what
      get_model_state_dict                         Trainer.save_model hands save_pretrained
    fsdp_plugin, deepspeed_plugin,               honoured or refused by name ([Note: arguments
      mixed_precision, dynamo (Trainer args)       under shardbridge] in _arguments.py)

The model and its optimizer are prepared here; dataloaders and schedulers go through
Accelerate's own ``prepare`` (which then sees the core mesh).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from shardbridge import (
    ParallelDims,
    ParallelMesh,
    checkpoint,
    clip_grad_norm_,
    fp8,
    param_group_fqns,
    rebind_param_groups,
)
from torch import nn

from shardbridge_hf import _checkpoint, _patches, _trainer
from shardbridge_hf._arguments import check_accelerator_args, check_compile
from shardbridge_hf._compat import accelerator_models, accelerator_schedulers, require_accelerate
from shardbridge_hf._config import ENV_VAR, HFConfig
from shardbridge_hf._noise import quiet_sequential_all_gather, quiet_upstream_noise
from shardbridge_hf._parallelize import parallelize

require_accelerate()

from accelerate import Accelerator  # noqa: E402
from accelerate.scheduler import AcceleratedScheduler  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402

__all__ = ["ShardbridgeAccelerator"]

# Env that makes Accelerate's state pick FSDP / build its own ParallelismConfig; we set both up ourselves.
_ACCELERATE_ENV = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")


class ShardbridgeAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` that trains with shardbridge's FSDP2 x TP (and HSDP).

    Launch with ``shardbridge launch --config_file cfg.yaml train.py``: there the plugin makes
    ``accelerate.Accelerator`` this class, so a script (a ``transformers.Trainer``, a TRL trainer)
    needs no change; or import it by name. ``prepare(model, optimizer, dataloader, scheduler)``,
    ``backward``, ``save_state``/``load_state`` keep their meaning.

    Args:
        config: the shardbridge config; None = the one ``shardbridge-launch`` passed in the
            environment (or defaults; a ValueError in a process started by plain
            ``accelerate launch`` with FSDP, which drops the config file's block).
        parallel_dims: the degrees; None = ``config.dims``, else Accelerate's
            ``parallelism_config`` (argument or ``PARALLELISM_CONFIG_*`` env), else FSDP
            over all ranks. ``config.ep_size`` sets their ``ep``.
        tp_plan: overrides ``config.tp_plan`` ("auto" or ``{pattern: style}``).
        cpu: train on CPU with gloo; None = ``config.use_cpu``, else when no GPU.
        **kwargs: passed to ``accelerate.Accelerator`` (``gradient_accumulation_steps``,
            ``project_dir``, ...). The block owns wrapping and precision: ``fsdp_plugin``'s
            fields are honoured or refused, ``deepspeed_plugin``, ``mixed_precision`` other than
            "no" / the block's bf16, and torch.compile are refused ([Note: arguments under
            shardbridge] in ``_arguments.py``).

    Attributes:
        num_optimizer_steps: optimizer steps taken; ``save_state`` records it as the checkpoint's
            step, ``load_state`` restores and returns it (no script has to set a step).

    Example:
        >>> from shardbridge_hf import ShardbridgeAccelerator  # doctest: +SKIP
        >>> accelerator = ShardbridgeAccelerator()  # doctest: +SKIP
        >>> model, opt, dl = accelerator.prepare(model, opt, dl)  # doctest: +SKIP
        >>> accelerator.save_state("ckpt/step-10")  # doctest: +SKIP
    """

    def __init__(
        self,
        *args: Any,
        config: HFConfig | None = None,
        parallel_dims: ParallelDims | None = None,
        tp_plan: str | Mapping[str, Any] | None = None,
        cpu: bool | None = None,
        **kwargs: Any,
    ) -> None:
        # [Note: hf patch plan]: RuntimeError before any work on an accelerate this was not checked with.
        _patches.gate("partial_state_fsdp")
        quiet_upstream_noise()  # before transformers imports torchao: [Note: upstream noise in a launch]
        self._sb_undo: list[Callable[[], None]] = []
        if config is None:
            _refuse_plain_accelerate_launch()
        config = config or HFConfig.from_env() or HFConfig()
        if tp_plan is not None:
            import dataclasses

            config = dataclasses.replace(config, tp_plan=tp_plan)
        if kwargs.get("mixed_precision") == "fp8":
            raise ValueError(
                "mixed_precision='fp8': set fsdp_config.shardbridge.fp8.backend (torchao or te) instead and "
                "mixed_precision to 'no' or 'bf16'"
            )
        # See [Note: arguments under shardbridge]: honoured (fsdp_plugin fields), accepted, or refused by name.
        config = check_accelerator_args(kwargs, config)
        accelerate_pc = kwargs.pop("parallelism_config", None)
        if cpu is None:
            cpu = config.use_cpu if config.use_cpu is not None else not torch.cuda.is_available()
        # Accelerate's mixed precision would autocast forward; the FSDP2 policy casts instead.
        kwargs["mixed_precision"] = "no"
        with _without_env(_ACCELERATE_ENV):
            super().__init__(*args, cpu=cpu, **kwargs)
        check_compile(self.state)
        self.shardbridge_config = config
        self._sb_cpu = cpu
        dims = config.parallel_dims(parallel_dims or config.dims or _dims_from_accelerate(accelerate_pc))
        self.parallel_mesh: ParallelMesh = dims.build_mesh("cpu" if cpu else self.device.type)
        self._install_fsdp_state()
        self._sb_model: nn.Module | None = None
        self._sb_optimizer: Any = None
        self.num_optimizer_steps = 0
        """Optimizer steps taken (counted by a post-step hook; saved and restored by save/load_state).

        See [Note: the step a checkpoint records]."""
        self._sb_step_hook: Any = None
        # A Trainer builds this accelerator in its __init__: adapt what it does through Accelerate's FSDP helpers.
        self._sb_undo.extend(_trainer.adapt_trainer(ShardbridgeAccelerator))  # [Note: Trainer under shardbridge]; nothing without a Trainer

    # -- state: FSDP2 everywhere, one mesh ----------------------------------------------------

    def _install_fsdp_state(self) -> None:
        """Make Accelerate's state say FSDP2 with the core mesh. Fixes upstream bug 4 on CPU."""
        from accelerate.parallelism_config import ParallelismConfig

        dims = self.parallel_mesh.dims
        # Every size explicit: __post_init__ reads PARALLELISM_CONFIG_* env for the ones left None.
        pc = ParallelismConfig(dp_replicate_size=1, dp_shard_size=1, tp_size=dims.tp, cp_size=dims.cp)
        # Set after __post_init__: Accelerate refuses dp_replicate > 1 with dp_shard == 1 and
        # tp > 1, which the core runs as HSDP over a size-1 shard axis.
        pc.dp_replicate_size, pc.dp_shard_size = dims.dp_replicate, dims.dp_shard
        # The core mesh names every axis (degree-1 ones too) as Accelerate does, so its data
        # loader computes the same dp rank: rank // (cp * tp) over dp_replicate * dp_shard.
        pc.device_mesh = self.parallel_mesh.mesh
        # Built from this config alone: the FSDP_* env that `accelerate launch` exports says what the launcher
        # already merged into the block (and the Trainer reads activation_checkpointing off this plugin).
        with _without_env(tuple(name for name in os.environ if name.startswith("FSDP_"))):
            plugin = FullyShardedDataParallelPlugin(
                fsdp_version=2,
                state_dict_type="SHARDED_STATE_DICT",
                activation_checkpointing=self.shardbridge_config.activation_checkpointing,
            )
        self.state.distributed_type = DistributedType.FSDP
        # AcceleratorState() re-copies PartialState's dict on every construction (e.g. inside
        # AcceleratedOptimizer), which would silently turn FSDP back into MULTI_CPU / DDP.
        # Patch partial_state_fsdp: the process-wide dict outlives this accelerator, so its undo is kept.
        self._sb_undo.append(_patches.patch_item(PartialState._shared_state, "distributed_type", DistributedType.FSDP))
        self.state.fsdp_plugin = plugin
        self.state.parallelism_config = pc
        self.state.device_mesh = self.parallel_mesh.mesh

    # -- prepare ------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare the model (TP + FSDP2 via shardbridge) and its optimizer; the rest via Accelerate.

        Pass the model and the optimizer built over its unsharded parameters in the same call (the
        optimizer is rebound to the sharded ones, by name). The model may also come alone (for
        evaluation, or to build the optimizer from its sharded parameters, as the Trainer does
        after ``evaluate()``), and be passed again later with that optimizer. Objects may come in
        any order; the results come back in the same order.
        """
        models = [i for i, obj in enumerate(args) if isinstance(obj, nn.Module)]
        optimizers = [i for i, obj in enumerate(args) if isinstance(obj, torch.optim.Optimizer)]
        if len(models) > 1:
            raise ValueError("ShardbridgeAccelerator.prepare: pass one model (FSDP2 prepares one model per run)")
        if optimizers and not models and self._sb_model is None:
            raise ValueError(
                "ShardbridgeAccelerator.prepare(optimizer): prepare the model first, or with it, e.g. "
                "prepare(model, optimizer, dataloader); the optimizer is rebound to the sharded parameters"
            )
        placement = _check_device_placement(args, device_placement, models + optimizers)
        result = list(args)
        if models or optimizers:
            model = args[models[0]] if models else self._sb_model
            opts = [args[i] for i in optimizers]
            if model is self._sb_model:
                self._rebind_to_prepared(model, opts)
            else:
                self._sb_model = self._prepare_sb_model(model, opts)
            if models:
                result[models[0]] = self._sb_model
            for i in optimizers:
                result[i] = self.prepare_optimizer(args[i], device_placement=False)
                self._sb_optimizer = result[i]
            if optimizers:
                self._count_optimizer_steps(self._sb_optimizer)
            if fp8.recipe_of(self._sb_model) is not None:
                for i in optimizers:
                    # On the torch optimizer inside AcceleratedOptimizer (upstream bug 6).
                    fp8.install_step_hook(result[i], self._sb_model)
        rest = [i for i in range(len(args)) if i not in models and i not in optimizers]
        if rest:
            keep = None if placement is None else [placement[i] for i in rest]
            prepared = super().prepare(*(args[i] for i in rest), device_placement=keep)
            prepared = prepared if len(rest) > 1 else (prepared,)
            for i, obj in zip(rest, prepared):
                result[i] = obj
        return result[0] if len(result) == 1 else tuple(result)

    # [Note: the step a checkpoint records]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Accelerate's ``Accelerator.step`` counts micro-batches inside ``accumulate()`` (and is reset
    # at the end of a data loader); a loop without ``accumulate()`` leaves it at 0, so a checkpoint
    # that recorded it said step 0 every time and a resumed run started its data from the top. The
    # accelerator therefore counts the optimizer steps that really ran (a post-step hook on the
    # torch optimizer inside ``AcceleratedOptimizer``: a step skipped during gradient accumulation
    # or by a GradScaler never reaches it) in ``num_optimizer_steps``. ``save_state`` records that
    # count as the checkpoint's step (and names ``project_dir/checkpoints/step-N`` after it) plus
    # Accelerate's own ``step``; ``load_state`` restores both and returns the count, the number of
    # batches to skip with ``skip_first_batches`` (times the gradient accumulation steps).

    def _count_optimizer_steps(self, optimizer: Any) -> None:
        inner = optimizer
        while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
            inner = inner.optimizer
        if self._sb_step_hook is not None:  # a second prepare(): count the new optimizer only
            self._sb_step_hook.remove()
        self._sb_step_hook = inner.register_step_post_hook(lambda *_args, **_kwargs: self._one_step())

    def _one_step(self) -> None:
        self.num_optimizer_steps += 1

    def _prepare_sb_model(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> nn.Module:
        fqn_groups = [param_group_fqns(model, opt, when="prepare()") for opt in optimizers]
        device = torch.device("cpu") if self._sb_cpu else self.device
        if not self._sb_cpu and any(not p.is_meta for p in model.parameters()):
            model.to(device)
        parallelize(model, self.parallel_mesh, self.shardbridge_config, device=device)
        new = dict(model.named_parameters())
        # A tie restored in parallelize (init_empty_weights breaks it) leaves one parameter for two FQNs.
        fqn_groups = [_tied_groups(model, groups) for groups in fqn_groups]
        for opt, groups in zip(optimizers, fqn_groups):
            rebind_param_groups(opt, groups, new)  # See [Note: param groups by FQN] in the core
        accelerator_models(self).append(model)
        return model

    def _rebind_to_prepared(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """An already prepared model again (``free_memory`` forgot it), with optimizers over its sharded parameters."""
        for opt in optimizers:
            groups = _tied_groups(model, param_group_fqns(model, opt, when="prepare()"))
            rebind_param_groups(opt, groups, dict(model.named_parameters()))
        if not any(m is model for m in accelerator_models(self)):
            accelerator_models(self).append(model)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Accelerate's scheduler wrapper, stepping ``dp`` times per optimizer step (not ``num_processes``).

        See [Note: LR schedule under TP].
        """
        if getattr(scheduler, "_is_accelerate_prepared", False) or not _patches.gate("scheduler_dp_steps"):
            return super().prepare_scheduler(scheduler)
        optimizer = self._optimizers
        for opt in self._optimizers:
            if getattr(scheduler, "optimizer", None) == opt.optimizer:
                optimizer = opt
                break
        wrapped = _DataParallelScheduler(
            scheduler,
            optimizer,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
            num_steps=self.parallel_mesh.dims.degree("dp"),
        )
        self._schedulers.append(wrapped)
        return wrapped

    def _prepare_tp(self, *args: Any) -> Any:
        # Accelerate's version imports transformers' ReplicateParallel, removed in transformers
        # >= 5.1 (upstream bug 1). TP is applied by shardbridge in prepare(); nothing to do here.
        # Patch prepare_tp_noop: outside the checked accelerate, warn and run Accelerate's own.
        if not _patches.gate("prepare_tp_noop"):
            return super()._prepare_tp(*args)
        return args

    def unpatch(self) -> None:
        """Undo this accelerator's changes to Accelerate's process-wide state (call when done with it).

        Restores ``PartialState._shared_state["distributed_type"]`` to the identical value it had
        before this accelerator (patch ``partial_state_fsdp``, [Note: hf patch plan]); a later
        ``AcceleratorState()`` then sees Accelerate's own choice again. Idempotent.
        """
        while self._sb_undo:
            self._sb_undo.pop()()

    # -- data / loss helpers ------------------------------------------------------------------

    @property
    def dp_mesh(self) -> Any:
        """The mesh of ranks that see different batches (``dp_replicate x dp_shard``)."""
        return self.parallel_mesh["dp"]

    def cp_batch(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's part of a causal-LM batch under context parallelism (unchanged at cp=1).

        See :func:`shardbridge_hf.cp_batch`: splits ``input_ids``, global ``position_ids`` and
        shifted labels over ``cp``, and sets ``num_items_in_batch`` so the model's loss is the
        token-weighted mean over ``dp_cp``.
        """
        from shardbridge_hf._cp import cp_batch

        return cp_batch(batch, self.parallel_mesh)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean of ``loss`` over the ``dp_cp`` mesh (for logging; TP ranks hold equal losses)."""
        out = loss.detach().clone()
        dist.all_reduce(out, group=self.parallel_mesh["dp_cp"].get_group())
        return out / self.parallel_mesh.dims.degree("dp_cp")

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Accelerate's ``gather_for_metrics``, with the last batch trimmed per data-parallel rank.

        [Note: metrics over dp]: the ranks of a tp (and cp) group read the same batch, so the
        gathered rows hold each sample tp * cp times, one chunk per process in rank order, as
        under Accelerate's own TP (TRL divides its token counts by tp for that reason). At the end
        of a data loader whose dataset does not fill the last global batch, Accelerate keeps the
        first ``gradient_state.remainder`` rows -- a count of dp rows -- which cuts the wrong
        samples when chunks repeat. Here each process's chunk keeps the rows its dp coordinate
        contributes to the first ``remainder`` samples, so every sample is counted tp * cp times,
        the padding samples never.

        Raises:
            NotImplementedError: ``use_gather_object=True`` (or non-tensor data) with tp or cp > 1.
        """
        from accelerate.utils import recursively_apply

        dims = self.parallel_mesh.dims
        if dims.tp * dims.cp == 1:
            return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        if use_gather_object:
            raise NotImplementedError(
                "gather_for_metrics of Python objects (use_gather_object=True; TrainingArguments(eval_use_gather_object"
                "=True)) with tp or cp > 1 is not supported; gather tensors"
            )
        data = self.gather(input_data)
        state = self.gradient_state
        if not state.end_of_dataloader or state.remainder <= 0:
            return data
        world, per_dp_rank = self.num_processes, dims.tp * dims.cp
        remainder = state.remainder

        def trim(rows: torch.Tensor) -> torch.Tensor:
            chunks = rows.chunk(world)
            size = chunks[0].shape[0]
            kept = [c[: max(0, min(size, remainder - (rank // per_dp_rank) * size))] for rank, c in enumerate(chunks)]
            return torch.cat(kept)

        return recursively_apply(trim, data)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's full (unsharded, plain) state dict on the main process; ``{}`` on the others.

        Every rank must call it (each tensor is all-gathered over its mesh; the main process keeps
        it on CPU). What ``save_pretrained(dir, state_dict=...)`` takes, as under Accelerate's FSDP
        (``Trainer.save_model`` uses it). FP8 parameters come out as plain tensors.
        """
        if model is not self._sb_model:
            return super().get_state_dict(model, unwrap=unwrap)
        from torch.distributed.tensor import DTensor

        out = {}
        with quiet_sequential_all_gather():  # [Note: upstream noise in a launch]
            for name, value in model.state_dict().items():
                value = fp8.to_plain(value, key=name)
                full = value.full_tensor() if isinstance(value, DTensor) else value
                if self.is_main_process:
                    out[name] = full.detach().to("cpu", copy=True)
        return out

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Clip gradients to a total norm of ``max_norm``; returns the norm before clipping.

        Works on every supported accelerate: the parameters of an FSDP2 x TP model sit on two
        meshes, which ``torch.nn.utils.clip_grad_norm_`` (all accelerate < 1.11 calls) refuses;
        see [Note: clipping across meshes] in ``shardbridge._clip``.
        """
        self.unscale_gradients()
        return clip_grad_norm_(parameters, max_norm, norm_type)

    # -- checkpoints ----------------------------------------------------------------------------

    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        *,
        overwrite: bool = False,
        async_: bool = False,
        **save_model_func_kwargs: Any,
    ) -> str | checkpoint.AsyncSave:
        """Save model, optimizer, schedulers, RNG and the step as a shardbridge checkpoint.

        The step is :attr:`num_optimizer_steps`, the optimizer steps taken so far (see [Note: the
        step a checkpoint records]). ``output_dir`` None = ``checkpoint.step_dir(project_dir/checkpoints,
        step)``. The checkpoint loads into any layout (see [Note: what a save_state checkpoint holds]).

        Args:
            output_dir: the checkpoint directory.
            safe_serialization: must stay True: a shardbridge checkpoint holds plain tensors
                only (no pickled objects to opt into); False is refused.
            overwrite: replace an existing checkpoint at ``output_dir``.
            async_: return once the state is staged in host memory and write it in the
                background (``shardbridge.checkpoint.save``'s ``async_``); returns its
                handle (``.wait()`` before relying on the files) instead of the path.
            **save_model_func_kwargs: Accelerate passes these to its model-saving function,
                which shardbridge does not use: any is refused by name.

        Raises:
            ValueError: ``safe_serialization=False``, or keyword arguments it cannot honour.
        """
        if safe_serialization is not True:
            raise ValueError(
                "save_state(safe_serialization=False): shardbridge checkpoints are always safe (plain tensors, "
                "loaded with weights_only; see docs/checkpoints.md#threat-model); drop the argument"
            )
        _refuse_kwargs("save_state", save_model_func_kwargs, "output_dir, safe_serialization=True, overwrite, async_")
        if output_dir is None:
            if not self.project_dir:
                raise ValueError("save_state(output_dir=None) needs Accelerator(project_dir=...); pass output_dir")
            output_dir = checkpoint.step_dir(Path(self.project_dir) / "checkpoints", self.num_optimizer_steps)
        model, optimizer = self._require_prepared("save_state")
        cfg = self.shardbridge_config.checkpoint
        path = _checkpoint.save_state(
            output_dir,
            model=model,
            optimizer=optimizer,
            schedulers=list(accelerator_schedulers(self)),
            step=self.num_optimizer_steps,
            accelerate_step=self.step,
            on_bad_layout=cfg.on_bad_layout,
            parallel_dims=self.parallel_mesh.dims,
            overwrite=overwrite,
            async_=async_,
        )
        return path if async_ else str(path)

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        strict: bool = True,
        **load_model_func_kwargs: Any,
    ) -> int:
        """Load a ``save_state`` checkpoint (any layout); returns the step it recorded.

        Restores :attr:`num_optimizer_steps` (the returned step: the optimizer steps the saving
        run had taken, the batches to skip with ``skip_first_batches``) and Accelerate's own
        ``step`` (see [Note: the step a checkpoint records]).

        Args:
            input_dir: the checkpoint directory; None = the latest under ``project_dir/checkpoints``.
            load_kwargs: Accelerate hands these to ``torch.load`` for its pickled files; a
                shardbridge checkpoint has none, so any is refused by name.
            strict: the model's and optimizer's keys must equal the checkpoint's.
            **load_model_func_kwargs: refused by name (Accelerate's model-loading hook).

        Raises:
            ValueError: arguments it cannot honour, no checkpoint, or one that does not fit.
        """
        _refuse_kwargs("load_state", {**(load_kwargs or {}), **load_model_func_kwargs}, "input_dir, strict")
        if input_dir is None:
            if not self.project_dir:
                raise ValueError("load_state(input_dir=None) needs Accelerator(project_dir=...); pass input_dir")
            input_dir = checkpoint.latest(Path(self.project_dir) / "checkpoints")
            if input_dir is None:
                raise ValueError(f"no checkpoint under {self.project_dir}/checkpoints")
        model, optimizer = self._require_prepared("load_state")
        steps = _checkpoint.load_state(
            input_dir,
            model=model,
            optimizer=optimizer,
            schedulers=list(accelerator_schedulers(self)),
            strict=strict,
        )
        self.num_optimizer_steps, self.step = steps.optimizer_steps, steps.accelerate_step
        fp8.refresh(model)  # FP8 scales from the loaded weights (nothing without FP8)
        return self.num_optimizer_steps

    def load_pretrained(self, path: str | os.PathLike[str], *, cast_dtype: bool = False) -> Any:
        """Load a ``from_pretrained`` folder into the prepared model, each rank reading only its slices.

        Call after ``prepare``, on every rank. Build the model without weights for the memory
        win (see [Note: pretrained weights without materialising the model] in ``_parallelize``)::

            with accelerate.init_empty_weights():
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
            model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
            accelerator.load_pretrained(path)

        Args:
            path: a ``save_pretrained`` folder (safetensors; sharded with its index, or one file).
            cast_dtype: cast floating-point checkpoint values to the model's dtype (e.g. a
                bfloat16 checkpoint into float32 master weights); False = a mismatch is an error.

        Returns:
            The core's :class:`shardbridge.pretrained.PretrainedReport` for this rank.

        Raises:
            ValueError: missing / unexpected keys, shape or dtype mismatches (named, before
                anything is written).
        """
        model, _ = self._require_prepared("load_pretrained")
        report = _checkpoint.load_pretrained(model, path, cast_dtype=cast_dtype)
        fp8.refresh(model)  # FP8 scales from the loaded weights (nothing without FP8)
        return report

    def export_pretrained(
        self, checkpoint_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, overwrite: bool = False
    ) -> str:
        """Export a checkpoint to a ``from_pretrained`` folder (rank 0 writes; all ranks wait).

        ``overwrite=True`` replaces an earlier export in ``out_dir``; False = it must be new or empty.
        """
        model, _ = self._require_prepared("export_pretrained")
        if self.is_main_process:
            _checkpoint.export_pretrained(
                checkpoint_dir,
                out_dir,
                config=model.config,
                dtype=self.shardbridge_config.checkpoint.export_dtype,
                max_shard_size=self.shardbridge_config.checkpoint.max_shard_size,
                overwrite=overwrite,
            )
        self.wait_for_everyone()
        return str(out_dir)

    def _require_prepared(self, what: str) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        if self._sb_model is None:
            raise ValueError(f"{what}: call prepare(model, optimizer, ...) first")
        optimizer = self._sb_optimizer
        inner = getattr(optimizer, "optimizer", optimizer)
        return self._sb_model, inner


class _DataParallelScheduler(AcceleratedScheduler):
    """``AcceleratedScheduler`` that steps the schedule once per data-parallel rank.

    [Note: LR schedule under TP]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Accelerate sizes schedules in batches of the unsharded data loader: one optimizer step
    consumes one batch per process, so ``AcceleratedScheduler.step`` steps the schedule
    ``num_processes`` times. Under TP (and CP) the ranks of a tp group read the SAME batch:
    an optimizer step consumes ``dp = dp_replicate * dp_shard`` batches, and stepping
    ``num_processes`` times runs a schedule sized from ``len(dataloader)`` ``tp`` times too
    fast. This wrapper steps ``dp`` times; everything else (gradient accumulation, skipped
    optimizer steps, ``split_batches``, OneCycle's end) is Accelerate's logic, unchanged.
    """

    def __init__(self, *args: Any, num_steps: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_steps = num_steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer or not self.gradient_state.sync_gradients or self.split_batches:
            super().step(*args, **kwargs)  # one step (or none): Accelerate's own logic
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(self.num_steps):
            # OneCycleLR raises past total_steps (``drop_last=False`` leaves a partial last batch).
            if not hasattr(self.scheduler, "total_steps") or self.scheduler._step_count <= self.scheduler.total_steps:
                self.scheduler.step(*args, **kwargs)


def _tied_groups(model: nn.Module, fqn_groups: list[list[str]]) -> list[list[str]]:
    """Optimizer groups by FQN with tied aliases merged into one entry (the model's own name).

    An optimizer built under ``accelerate.init_empty_weights`` holds ``lm_head.weight`` and
    ``embed_tokens.weight`` as two tensors; after re-tying (see ``_parallelize``'s step 1)
    they are one parameter, which must appear once (twice would step it twice).
    """
    every = dict(model.named_parameters(remove_duplicate=False))
    canonical = {id(p): fqn for fqn, p in model.named_parameters()}
    seen: set[int] = set()
    out = []
    for group in fqn_groups:
        kept = []
        for fqn in group:
            p = every.get(fqn)
            if p is None:
                kept.append(fqn)  # rebind_param_groups names it
            elif id(p) not in seen:
                seen.add(id(p))
                kept.append(canonical[id(p)])
        out.append(kept)
    return out


def _refuse_plain_accelerate_launch() -> None:
    """ValueError in a worker started by plain ``accelerate launch`` with FSDP (no shardbridge config in the env).

    ``accelerate launch`` drops ``fsdp_config.shardbridge`` (it copies the block to an argument
    nothing reads) and exports its own ``fsdp_*`` keys, which this accelerator does not use:
    the run would silently train with default settings.
    """
    if ENV_VAR not in os.environ and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        raise ValueError(
            "ShardbridgeAccelerator was started by `accelerate launch`, which drops the config file's "
            "fsdp_config.shardbridge block and would leave its fsdp_* keys without effect; launch with "
            "`shardbridge launch --config_file cfg.yaml train.py ...` (the same arguments), or pass "
            "config=HFConfig(...) explicitly"
        )


def _dims_from_accelerate(pc: Any) -> ParallelDims:
    if pc is not None:
        return ParallelDims(dp_replicate=pc.dp_replicate_size, dp_shard=pc.dp_shard_size, cp=pc.cp_size, tp=pc.tp_size)
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        get = lambda key: int(os.environ.get(f"PARALLELISM_CONFIG_{key}_SIZE", "1"))  # noqa: E731
        return ParallelDims(dp_replicate=get("DP_REPLICATE"), dp_shard=get("DP_SHARD"), cp=get("CP"), tp=get("TP"))
    return ParallelDims()


@contextlib.contextmanager
def _without_env(names: tuple[str, ...]) -> Iterator[None]:
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _refuse_kwargs(method: str, kwargs: dict[str, Any], takes: str) -> None:
    if kwargs:
        raise ValueError(
            f"ShardbridgeAccelerator.{method} does not use {sorted(kwargs)} (Accelerate's pickle/model-function "
            f"options have no meaning for a shardbridge checkpoint); it takes {takes}"
        )


def _check_device_placement(
    args: tuple[Any, ...], device_placement: list[bool] | None, own: list[int]
) -> list[bool] | None:
    """Accelerate's per-object ``device_placement``, checked: shardbridge places the model itself."""
    if device_placement is None:
        return None
    if len(device_placement) != len(args):
        raise ValueError(
            f"prepare(device_placement=...) has {len(device_placement)} entries for {len(args)} objects; "
            "give one bool per object (or leave it out)"
        )
    for i in own:
        if device_placement[i] is False:
            raise ValueError(
                f"prepare(device_placement[{i}]=False) for the {type(args[i]).__name__}: shardbridge places the "
                "sharded model and its optimizer state on the mesh's device itself; pass True (or None) for them"
            )
    return list(device_placement)
