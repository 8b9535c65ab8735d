"""Shared pieces of the hf-adapter tests (not a test module): tiny models, batches, accelerators.

Models come from configs in code (no hub). Every gloo-pool test builds a FRESH Accelerate state:
Accelerate keeps process-wide singletons (``AcceleratorState``), and pool workers live on.
"""

from __future__ import annotations

import os
import textwrap

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH_PER_DP = 256, 16, 2


def tiny_config(arch: str = "llama", **overrides):
    """hidden 64, 2 layers, 8 heads / 4 kv heads (tp up to 4), intermediate 128."""
    from transformers import AutoConfig

    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))


def global_batch(step: int, dp_size: int) -> torch.Tensor:
    """Learnable tokens (next = f(this)), different every step; rows split over dp ranks."""
    g = torch.Generator().manual_seed(100 + step)
    start = torch.randint(0, VOCAB, (BATCH_PER_DP * dp_size, 1), generator=g)
    return (start * 5 + torch.arange(SEQ) * 3) % VOCAB


def local_batch(step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    full = global_batch(step, dp_size)
    return full[dp_rank * BATCH_PER_DP : (dp_rank + 1) * BATCH_PER_DP]


def accelerate_env() -> None:
    """The env Accelerate's state reads in a torchrun worker, and a fresh Accelerate state."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG", "SHARDBRIDGE_HF_CONFIG"):
        os.environ.pop(name, None)
    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    GradientState._reset_state()


def sb_accelerator(dims, config=None, **kwargs):
    from shardbridge_hf import HFConfig, ShardbridgeAccelerator

    accelerate_env()
    return ShardbridgeAccelerator(config=config or HFConfig(), parallel_dims=dims, cpu=True, **kwargs)


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter as a full plain tensor (DTensor.full_tensor(): the oracle of the layout)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def train_steps(accelerator, model, optimizer, steps, *, start: int = 0, scheduler=None) -> list[float]:
    """Steps ``start+1 .. start+steps`` on this rank's dp share; returns the dp-mean losses."""
    pm = accelerator.parallel_mesh
    dp_rank, dp_size = pm["dp"].get_local_rank(), pm.dims.degree("dp")
    losses = []
    for step in range(start + 1, start + steps + 1):
        ids = local_batch(step, dp_rank, dp_size)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce_loss(loss).item())
    return losses


# -- accelerate config files -------------------------------------------------------------------

# An Accelerate yaml with a shardbridge block: FSDP2, dp_shard 2 x tp 2 on 4 CPU processes.
ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
use_cpu: true
num_processes: 4
mixed_precision: "no"
fsdp_config:
  fsdp_version: 2
  shardbridge:
    precision: bf16
    fp8: {backend: torchao, recipe: tensorwise}
    checkpoint: {export_dtype: bfloat16}
parallelism_config:
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 2
"""


def write_config(tmp_path, text: str):
    """Write ``text`` (dedented) to ``tmp_path/cfg.yaml``; returns the path."""
    path = tmp_path / "cfg.yaml"
    path.write_text(textwrap.dedent(text))
    return path
