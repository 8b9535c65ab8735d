"""``transformers.Trainer`` (and TRL's trainers, its subclasses) under a ``ShardbridgeAccelerator``.

[Note: Trainer under shardbridge]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With the plugin installed ([Note: the Accelerate plugin] in ``_plugin.py``) the Trainer builds a
``ShardbridgeAccelerator`` and takes its FSDP2 path (``is_fsdp_enabled``: the accelerator's state
carries an FSDP2 plugin). Most of that path is right as it stands, and the tests check it against
one process: the data loader shards by dp and repeats over tp (Accelerate's loader on the core
mesh), ``num_items_in_batch`` divides the gathered token count by tp (and cp) and the loss is
scaled by ``num_processes // tp``, the logged loss is the mean over processes (tp ranks hold equal
losses), the LR scheduler is the Trainer's own (not prepared by the accelerator: stepped once per
optimizer step, sized from the dp-sharded loader, so [Note: LR schedule under TP] does not arise),
gradient clipping spans the meshes (the Trainer's own per-mesh norm or the accelerator's
``clip_grad_norm_``), ``trainer_state.json`` and the per-rank RNG files. What the Trainer does
through Accelerate's FSDP helpers, or not at all, is adapted here, one method each (transformers
5.0 .. 5.24 have them all under these names)::

    Trainer method                     upstream (FSDP2)                      under shardbridge
    train                              --                                    TrainingArguments the
                                                                               accelerator never sees are
                                                                               checked first (_arguments)
    _save_optimizer_and_scheduler      Accelerate's DCP dirs                 checkpoint-N/shardbridge: one
                                         (pytorch_model_fsdp_0/,               shardbridge checkpoint (model,
                                         optimizer_0/) + scheduler.pt          optimizer, step, config.json for
                                                                               `ckpt export`) + scheduler.pt
    _load_from_checkpoint              load_fsdp_model (same layout only)    model + optimizer from
                                                                               checkpoint-N/shardbridge, any layout
    _load_optimizer_and_scheduler      load_fsdp_optimizer + scheduler.pt    scheduler.pt (the optimizer came
                                                                               with the model)
    _load_best_model                   load_fsdp_model                       the model from the best
                                                                               checkpoint's shardbridge/
    save_model                         nothing (SHARDED_STATE_DICT)          the full state dict on rank 0
                                                                               through the Trainer's own _save
                                                                               (save_pretrained): a folder
                                                                               from_pretrained loads
    _prepare_context_parallel_inputs   torch's CP (SDPA only) through        shardbridge_hf.cp_batch (cp > 1)
                                         Accelerate's maybe_context_parallel

Each adapted method calls the original unless the trainer's accelerator is a
``ShardbridgeAccelerator``, so other Trainers in the process are unaffected. They are installed
when the first ``ShardbridgeAccelerator`` is built in a process that imported transformers'
trainer module (the Trainer builds it in ``__init__``, before any of them runs); the accelerator
keeps the undo (``unpatch()``). Every patch is gated on the transformers versions it was checked
against (``_patches.TRAINER_PATCHES``, 5.13 .. 5.24), asked when such a Trainer calls the method:
outside them a RuntimeError, because an unadapted Trainer would silently write Accelerate's
checkpoints and no model, and before 5.13 the Trainer scales its loss by ``num_processes``
(tp times too large under TP).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from shardbridge import checkpoint

from shardbridge_hf import _patches
from shardbridge_hf._compat import trainer_save

__all__ = ["CHECKPOINT_SUBDIR", "adapt_trainer", "is_adapted"]

CHECKPOINT_SUBDIR = "shardbridge"
"""The shardbridge checkpoint inside a Trainer's ``checkpoint-N/`` folder."""

_SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME (5.0 .. 5.24)
_ADAPTED = "__shardbridge_original__"


def _ours(trainer: Any, accelerator: type) -> bool:
    return isinstance(getattr(trainer, "accelerator", None), accelerator)


def _train(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    from shardbridge_hf._arguments import check_training_args

    check_training_args(self.args, self.accelerator)
    return original(self, *args, **kwargs)


def _save_optimizer_and_scheduler(original: Callable[..., Any], self: Any, output_dir: str) -> None:
    # Model and optimizer in one shardbridge checkpoint (it replaces the same files, as the Trainer does).
    self.accelerator.save_state(os.path.join(output_dir, CHECKPOINT_SUBDIR), overwrite=True)
    if self.args.should_save:
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))


def _load_from_checkpoint(original: Callable[..., Any], self: Any, resume_from_checkpoint: str, model: Any = None) -> None:
    path = _checkpoint_in(resume_from_checkpoint, "resume_from_checkpoint")
    self.accelerator.load_state(path)  # model + optimizer (prepared before this is called), any layout


def _load_optimizer_and_scheduler(original: Callable[..., Any], self: Any, checkpoint_dir: str | None) -> None:
    if checkpoint_dir is None:
        return
    path = os.path.join(checkpoint_dir, _SCHEDULER_NAME)
    if not os.path.isfile(path):
        raise ValueError(
            f"resume_from_checkpoint={checkpoint_dir!r} has a shardbridge checkpoint but no {_SCHEDULER_NAME} (the "
            "Trainer's LR scheduler state); resume from a complete checkpoint-N folder"
        )
    self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))


def _load_best_model(original: Callable[..., Any], self: Any) -> None:
    path = _checkpoint_in(self.state.best_model_checkpoint, "the best checkpoint")
    model, _ = self.accelerator._require_prepared("load_best_model_at_end")
    checkpoint.load(path, model=model, optimizer=None, rng=False)


def _save_model(original: Callable[..., Any], self: Any, output_dir: str | None = None, _internal_call: bool = False) -> None:
    if _internal_call:
        return  # checkpoint-N: _save_optimizer_and_scheduler writes the shardbridge checkpoint
    output_dir = output_dir if output_dir is not None else self.args.output_dir
    # Every rank joins the gather; the Trainer's _save writes on rank 0 (args.should_save).
    trainer_save(self, output_dir, self.accelerator.get_state_dict(self.model))
    if self.args.push_to_hub:
        self.push_to_hub(commit_message="Model save", revision=getattr(self.args, "hub_revision", None))


def _prepare_context_parallel_inputs(original: Callable[..., Any], self: Any, model: Any, inputs: dict[str, Any]) -> Any:
    if self.accelerator.parallel_mesh.dims.cp == 1:
        return contextlib.nullcontext, inputs
    # The Trainer's num_items_in_batch (the global token count) wins over cp_batch's in compute_loss, and
    # its loss scale num_processes // tp then makes FSDP2's average over dp_cp the global token mean.
    return contextlib.nullcontext, self.accelerator.cp_batch(inputs)


_ADAPTATIONS: dict[str, Callable[..., Any]] = {
    "train": _train,
    "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
    "_load_from_checkpoint": _load_from_checkpoint,
    "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
    "_load_best_model": _load_best_model,
    "save_model": _save_model,
    "_prepare_context_parallel_inputs": _prepare_context_parallel_inputs,
}
"""Trainer method -> its replacement under a ShardbridgeAccelerator. See [Note: Trainer under shardbridge]."""


def _checkpoint_in(folder: str | None, what: str) -> str:
    path = os.path.join(folder or "", CHECKPOINT_SUBDIR)
    if folder is None or not os.path.isdir(path):
        raise ValueError(
            f"{what}={folder!r} holds no shardbridge checkpoint ({CHECKPOINT_SUBDIR}/): only checkpoint-N folders a "
            "Trainer wrote under `shardbridge launch` resume here; start from a from_pretrained folder by loading it "
            "into the model before the Trainer (AutoModelForCausalLM.from_pretrained)"
        )
    return path


def _adapted(name: str, replacement: Callable[..., Any], original: Callable[..., Any], accelerator: type) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _ours(self, accelerator):
            _patches.trainer_gate(f"trainer.{name}")  # RuntimeError on a transformers this was not checked with
            return replacement(original, self, *args, **kwargs)
        return original(self, *args, **kwargs)

    setattr(method, _ADAPTED, original)
    return method


def is_adapted() -> bool:
    """Whether ``transformers.Trainer`` carries the adaptations (False when its module is not imported)."""
    module = sys.modules.get("transformers.trainer")
    trainer = getattr(module, "Trainer", None)
    return trainer is not None and all(hasattr(trainer.__dict__.get(name), _ADAPTED) for name in _ADAPTATIONS)


def adapt_trainer(accelerator: type) -> list[Callable[[], None]]:
    """Adapt ``transformers.Trainer``'s methods of [Note: Trainer under shardbridge]; returns their undos.

    Does nothing (returns ``[]``) when transformers' trainer module was never imported, or when the
    methods are adapted already. Each adapted method asks its patch's gate when a Trainer whose
    accelerator is an ``accelerator`` (``ShardbridgeAccelerator``, which passes itself) calls it: a
    RuntimeError on a transformers outside the checked range; other Trainers run the originals.
    """
    module = sys.modules.get("transformers.trainer")
    trainer = getattr(module, "Trainer", None)
    if trainer is None or is_adapted():
        return []
    undo = []
    for name, replacement in _ADAPTATIONS.items():
        original = trainer.__dict__.get(name)
        if original is None:  # a transformers without the method: the gate's range excludes it
            raise RuntimeError(f"transformers.Trainer has no method {name!r}; shardbridge_hf adapts it (see docs/hf.md)")
        undo.append(_patches.patch_attr(trainer, name, _adapted(name, replacement, original, accelerator)))
    return undo
