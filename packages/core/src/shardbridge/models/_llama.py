"""A plain-torch Llama: the reference model every shardbridge layout is checked against.

Public (via ``shardbridge.models``): :class:`LlamaConfig`, :class:`Llama`, :class:`ParamTP`,
:func:`synthetic_batch`. The block classes are implementation details.

The model is written once for every layout: attention and the MLP read the number of heads
and the hidden width from the TP-LOCAL output of their fused projections, so the same
forward runs unsharded (tp=1) and on one TP rank's shard (see [Note: TP-local forward]).

[Note: TP-local forward]
~~~~~~~~~~~~~~~~~~~~~~~~
``qkv`` is ONE Linear whose weight is ``[q; k; v]`` (registered as fused, so checkpoints
store q/k/v). Column TP gives TP rank j the q heads of its KV groups, then its k heads, then
its v heads (``FusedSpec.qkv``), so rank j's local output is ``[q_j | k_j | v_j]`` with
``num_heads/tp`` q heads and ``num_kv_heads/tp`` kv heads::

    local width = (num_heads/num_kv_heads + 2) * local_kv_heads * head_dim

which gives ``local_kv_heads`` without knowing tp. Likewise ``gate_up`` is ``[gate; up]``
and rank j's output is ``[gate_j | up_j]``: halving it is right at every tp.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from shardbridge._checks import checked_args
from shardbridge._cp import cp_attention, cp_positions
from shardbridge._fused import FusedSpec, fused_params, register_fused
from shardbridge._tp import TPMode, tp_placements

__all__ = ["Llama", "LlamaConfig", "ParamTP", "synthetic_batch"]


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a Llama-style decoder (RMSNorm, rotary GQA attention, SwiGLU MLP).

    Example:
        >>> cfg = LlamaConfig.tiny(vocab_size=250)
        >>> cfg.head_dim, cfg.num_layers
        (16, 2)
    """

    vocab_size: int
    """Number of token ids (rows of the embedding and of the output layer)."""
    dim: int
    """Hidden size of the residual stream."""
    num_layers: int
    """Number of transformer blocks."""
    num_heads: int
    """Query heads; must divide ``dim``."""
    num_kv_heads: int
    """Key/value heads (grouped query attention); must divide ``num_heads``. = num_heads: MHA."""
    intermediate_size: int
    """SwiGLU hidden width (rows of gate and of up)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    max_seq_len: int = 128
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """Rotary base."""
    tie_word_embeddings: bool = False
    """Share the embedding table with the output layer. False = separate weights."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_seq_len")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name}={value!r} must be a positive int")
        if self.dim % self.num_heads:
            raise ValueError(
                f"LlamaConfig.dim({self.dim}) is not divisible by num_heads({self.num_heads}); "
                "choose num_heads dividing dim"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_heads({self.num_heads}) is not divisible by num_kv_heads({self.num_kv_heads}); "
                "grouped query attention needs num_heads % num_kv_heads == 0"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig.head_dim = dim({self.dim}) / num_heads({self.num_heads}) = {self.head_dim} is odd; "
                "rotary embeddings need an even head_dim"
            )
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"LlamaConfig.{name}={value!r} must be > 0")

    @property
    def head_dim(self) -> int:
        """``dim // num_heads``."""
        return self.dim // self.num_heads

    @classmethod
    def tiny(cls, **overrides: object) -> LlamaConfig:
        """A model that trains in milliseconds on CPU (tests). ``overrides`` replace fields.

        Example:
            >>> LlamaConfig.tiny().dim
            64
        """
        base = cls(
            vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_seq_len=64
        )
        return dataclasses.replace(base, **overrides)

    @classmethod
    def small(cls, **overrides: object) -> LlamaConfig:
        """A ~60M-parameter model for benchmarks. ``overrides`` replace fields.

        Example:
            >>> LlamaConfig.small().num_layers
            8
        """
        base = cls(
            vocab_size=32000,
            dim=512,
            num_layers=8,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=1536,
            max_seq_len=1024,
        )
        return dataclasses.replace(base, **overrides)


@dataclass(frozen=True, kw_only=True)
class ParamTP:
    """How one parameter is tensor-parallel, as data (printed by the demo, compared by adapters).

    ``mode`` is a :class:`~shardbridge.tp.TPMode` about the WEIGHT's dims: column = Shard(0)
    (output features of a Linear; vocab rows of an embedding, which torch's
    ``RowwiseParallel`` for ``nn.Embedding`` also shards on dim 0), row = Shard(1) (input
    features), none = Replicate. A fused column weight is TP-interleaved (``shardbridge._fused``).

    Example:
        >>> ParamTP(mode="row").placement
        Shard(dim=1)
    """

    mode: TPMode
    """Which weight dim TP shards; strings ("column", "row", "none") are accepted."""
    fused: FusedSpec | None = None
    """The fused layout of a column weight, or None."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", TPMode(self.mode))

    @property
    def placement(self) -> Placement:
        """The TP placement of the parameter on a 1-D TP mesh."""
        return tp_placements(self.mode)[0]


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.q_per_kv = config.num_heads // config.num_kv_heads
        spec = FusedSpec.qkv(num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
        self.qkv = nn.Linear(config.dim, spec.total, bias=False)
        register_fused(self.qkv, "weight", spec)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.dim, bias=False)
        self.cp_mesh: DeviceMesh | None = None  # set by Llama.set_context_parallel
        self.cp_comm = "all_gather"

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv(x)  # TP-local [q_j | k_j | v_j]; see [Note: TP-local forward]
        num_kv = qkv.shape[-1] // ((self.q_per_kv + 2) * self.head_dim)
        kv_width = num_kv * self.head_dim
        q, k, v = qkv.split([self.q_per_kv * kv_width, kv_width, kv_width], dim=-1)
        q = q.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        # q head i attends with kv head i // q_per_kv, locally as globally.
        if positions is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.q_per_kv > 1)
        else:  # context parallel: keys of the whole cp group, causal on global positions
            out = cp_attention(q, k, v, positions, self.cp_mesh, enable_gqa=self.q_per_kv > 1, comm=self.cp_comm)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        spec = FusedSpec.swiglu(config.intermediate_size)
        self.gate_up = nn.Linear(config.dim, spec.total, bias=False)
        register_fused(self.gate_up, "weight", spec)
        self.down = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # TP-local [gate_j | up_j]
        return self.down(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig, feed_forward: nn.Module | None = None) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config) if feed_forward is None else feed_forward

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, positions)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only Llama in plain torch, TP- and FSDP-ready.

    Forward takes token ids ``[batch, seq]`` and returns full-vocab logits
    ``[batch, seq, vocab]`` in every layout. Build on the meta device for large models::

        with torch.device("meta"):
            model = Llama(config)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)

    Example:
        >>> model = Llama(LlamaConfig.tiny())
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 256])
    """

    _RESIDUAL_OUTPUTS: tuple[str, ...] = ("o_proj.weight", "down.weight")
    """Parameter names ending so are residual output projections: init std / sqrt(2 * layers)."""

    def __init__(self, config: LlamaConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, self._feed_forward(config)) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(config.max_seq_len, config.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_seq_len, config.head_dim), persistent=False)
        if self.rope_cos.device.type != "meta":
            self.init_weights(seed)

    def _feed_forward(self, config: LlamaConfig) -> nn.Module:
        """The MLP of one block (the MoE model returns its routed MLP here)."""
        return FeedForward(config)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` of ``tokens`` ``[batch, seq]``.

        Under context parallelism (:meth:`set_context_parallel`) ``tokens`` is this cp rank's
        part of the batch (``shardbridge.cp.cp_split``) and the logits are that part's; RoPE and
        the causal mask use the global ``positions`` (default: :func:`~shardbridge.cp.cp_positions`
        of this rank, i.e. the head-tail split of ``seq * cp`` tokens).
        """
        seq = tokens.shape[1]
        cp_mesh = self.layers[0].attention.cp_mesh if len(self.layers) else None
        if positions is None and cp_mesh is not None and cp_mesh.size() > 1:
            positions = cp_positions(
                seq * cp_mesh.size(), cp_mesh.size(), cp_mesh.get_local_rank(), device=tokens.device
            )
        global_seq = seq if positions is None else int(positions.max()) + 1
        if global_seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {global_seq} > max_seq_len({self.config.max_seq_len}); raise max_seq_len"
            )
        if positions is None:
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # global positions
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, positions)
        return self.output(self.norm(h))

    def set_context_parallel(self, cp_mesh: DeviceMesh | None, *, comm: str = "all_gather") -> None:
        """Run attention context-parallel over the 1-D ``cp_mesh`` (None = off).

        ``comm`` is :func:`~shardbridge.cp.cp_attention`'s: "all_gather" or "ring".

        Called by :func:`~shardbridge.models.parallelize_llama` when cp > 1. Parameters are
        untouched (replicated over cp; FSDP shards them over ``dp_shard_cp``), so
        checkpoints do not depend on cp.
        """
        for layer in self.layers:
            layer.attention.cp_mesh, layer.attention.cp_comm = cp_mesh, comm

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init from ``seed``, independent of device and construction order.

        Each parameter draws from its own generator seeded by ``(seed, FQN)``: norms are ones,
        the rest normal(0, 0.02), residual output projections scaled by ``1/sqrt(2 * layers)``.
        Call it before :func:`~shardbridge.models.parallelize_llama` (on plain, unsharded
        parameters, e.g. right after ``to_empty``).

        Raises:
            ValueError: a parameter is already a DTensor (the model was parallelized).
        """
        self._init_rope()
        for name, param in self.named_parameters():
            if isinstance(param, DTensor):
                raise ValueError(
                    f"init_weights: parameter {name!r} is already a DTensor; call init_weights before "
                    "parallelize_llama (construct on meta, to_empty, init_weights, then parallelize)"
                )
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = 0.02
            if name.endswith(self._RESIDUAL_OUTPUTS):
                std /= math.sqrt(2 * self.config.num_layers)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            param.copy_(torch.normal(0.0, std, size=param.shape, generator=gen))

    def _init_rope(self) -> None:
        cfg = self.config
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout (as Hugging Face Llama)
        self.rope_cos.copy_(angles.cos())
        self.rope_sin.copy_(angles.sin())

    def fsdp_units(self) -> list[nn.Module | list[nn.Module]]:
        """FSDP units in forward order (see [Note: FSDP units] in ``shardbridge._wrap``)."""
        if self.config.tie_word_embeddings:
            return [*self.layers, [self.tok_embeddings, self.norm, self.output]]
        return [self.tok_embeddings, *self.layers, [self.norm, self.output]]

    def tp_plan(self) -> dict[str, ParamTP]:
        """How :func:`~shardbridge.models.parallelize_llama` shards each parameter, by FQN.

        Example:
            >>> plan = Llama(LlamaConfig.tiny()).tp_plan()
            >>> plan["layers.0.feed_forward.down.weight"].mode.value, plan["output.weight"].placement
            ('row', Shard(dim=0))
        """
        fused = fused_params(self)
        plan: dict[str, ParamTP] = {}
        for fqn, _ in self.named_parameters():
            module_name = fqn.rpartition(".")[0]
            if fqn in fused or module_name in ("tok_embeddings", "output"):
                plan[fqn] = ParamTP(mode="column", fused=fused.get(fqn))
            elif module_name.endswith(("o_proj", "down")):
                plan[fqn] = ParamTP(mode="row")
            else:
                plan[fqn] = ParamTP(mode="none")
        return plan


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [batch, heads, seq, head_dim]; rotate-half rotary embedding.
    if cos.ndim == 3:  # per-sample positions: [batch, seq, head_dim] -> [batch, 1, seq, head_dim]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


@checked_args(config=LlamaConfig)
def synthetic_batch(
    config: LlamaConfig,
    batch_size: int,
    seq_len: int,
    *,
    seed: int = 0,
    step: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels of a learnable synthetic language, identical on every rank.

    The global batch depends only on ``(config.vocab_size, batch_size, seq_len, seed,
    step)``; data-parallel rank ``dp_rank`` of ``dp_size`` gets rows
    ``[dp_rank * b, (dp_rank + 1) * b)`` with ``b = batch_size // dp_size``. All ranks of a TP
    group must pass the same ``dp_rank`` (their coordinate on the ``dp`` axis).

    Args:
        config: the model config (for the vocab size).
        batch_size: the GLOBAL batch size; divisible by ``dp_size``.
        seq_len: tokens per sample.
        seed: data seed.
        step: training step (each step draws a new batch).
        dp_rank: this rank's coordinate on the ``dp`` axis.
        dp_size: size of the ``dp`` axis.

    Returns:
        ``(tokens, labels)``, both ``[batch_size // dp_size, seq_len]`` int64.

    Example:
        >>> tokens, labels = synthetic_batch(LlamaConfig.tiny(), 4, 8, step=1, dp_rank=1, dp_size=2)
        >>> tokens.shape
        torch.Size([2, 8])
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank({dp_rank}) must be in [0, dp_size({dp_size})) and dp_size >= 1")
    if batch_size % dp_size:
        raise ValueError(
            f"batch_size({batch_size}) is not divisible by dp_size({dp_size}); the global batch must split "
            "evenly over data-parallel ranks"
        )
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq_len({seq_len}) > max_seq_len({config.max_seq_len})")
    # A learnable "language": every token has one fixed successor (a random permutation drawn
    # from ``seed``), so the loss can fall far below log(vocab_size) within a few dozen steps.
    successor = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    columns = [torch.randint(0, config.vocab_size, (batch_size,), generator=gen)]
    for _ in range(seq_len):
        columns.append(successor[columns[-1]])
    data = torch.stack(columns, dim=1)
    local = batch_size // dp_size
    data = data[dp_rank * local : (dp_rank + 1) * local]
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
