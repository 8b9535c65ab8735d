"""The reference mixture-of-experts model: the Llama blocks with a routed MLP.

Public (via ``shardbridge.models``): :class:`MoEConfig`, :class:`MoELlama`. The layer classes
(``MoEFeedForward``, ``GroupedExperts``) are implementation details.

Each block's MLP is a router (``Linear(dim, num_experts)``, softmax over all experts in fp32,
top-k, optionally renormalised over the k), ``num_experts`` SwiGLU experts held as two fused
3-D parameters, and optionally one shared SwiGLU expert scaled by a sigmoid gate (Qwen2-MoE's)::

    feed_forward.router.weight            [E, D]       replicated (dense region)
    feed_forward.experts.gate_up_proj     [E, 2I, D]   [gate; up] of each expert, dim 0 = expert
    feed_forward.experts.down_proj        [E, D, I]
    feed_forward.shared_expert.gate_up    [2S, D]      fused like the Llama MLP (TP column)
    feed_forward.shared_expert.down       [D, S]       (TP row)
    feed_forward.shared_expert_gate       [1, D]       replicated

The expert tensors are transformers' own layout (``MixtralExperts`` / ``Qwen2MoeExperts`` in
5.x), so a checkpoint exports under their names one to one (``_hf_moe.py``). Dim 0 is the
GLOBAL expert index in every layout ([Note: expert checkpoints] in ``_parallelize_moe.py``).

The forward computes what transformers' ``MixtralSparseMoeBlock`` (no shared expert,
``norm_topk_prob=True``) and ``Qwen2MoeSparseMoeBlock`` (shared expert) compute. After each
forward ``model.aux_loss`` holds the load-balancing loss of the GLOBAL batch and
``model.tokens_per_expert`` the global ``[layers, E]`` counts (``shardbridge.ep.load_balancing_loss``,
[Note: router statistics over dp_cp] in ``shardbridge/_ep.py``); train on
``cross_entropy + config.router_aux_loss_coef * model.aux_loss``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shardbridge._ep import EPDispatch, choose_dispatch, load_balancing_loss, router_statistics, run_experts
from shardbridge._tp import local_view
from shardbridge.models._llama import FeedForward, Llama, LlamaConfig, ParamTP

if TYPE_CHECKING:
    from shardbridge._mesh import ParallelMesh

__all__ = ["MoEConfig", "MoELlama"]


@dataclass(frozen=True, kw_only=True)
class MoEConfig(LlamaConfig):
    """A :class:`LlamaConfig` whose MLPs are routed mixtures of experts.

    ``intermediate_size`` is the width of each routed expert (as Mixtral's).

    Example:
        >>> cfg = MoEConfig.tiny()
        >>> cfg.num_experts, cfg.top_k, cfg.intermediate_size
        (8, 2, 32)
    """

    num_experts: int = 8
    """Routed experts per layer (E); divisible by the run's ep."""
    top_k: int = 2
    """Experts each token is routed to; 1 <= top_k <= num_experts."""
    norm_topk_prob: bool = True
    """Renormalise the k router probabilities of a token to sum to 1 (Mixtral always does)."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared SwiGLU expert every token also runs (Qwen2-MoE's, with its sigmoid
    gate). 0 = none."""
    router_aux_loss_coef: float = 0.01
    """Weight of ``model.aux_loss`` in the training loss (transformers' name); the model does
    not add it itself."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name}={value!r} must be a positive int")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k({self.top_k}) > num_experts({self.num_experts}); a token is routed to at "
                "most every expert: lower top_k"
            )
        value = self.shared_expert_intermediate_size
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"MoEConfig.shared_expert_intermediate_size={value!r} must be an int >= 0 (0 = no shared expert)"
            )
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"MoEConfig.router_aux_loss_coef={self.router_aux_loss_coef!r} must be >= 0")

    @classmethod
    def tiny(cls, **overrides: object) -> MoEConfig:
        """A model that trains in milliseconds on CPU (tests). ``overrides`` replace fields.

        Example:
            >>> MoEConfig.tiny(shared_expert_intermediate_size=48).shared_expert_intermediate_size
            48
        """
        base = cls(
            vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=32, max_seq_len=64
        )
        return dataclasses.replace(base, **overrides)

    @classmethod
    def small(cls, **overrides: object) -> MoEConfig:
        """A ~100M-parameter (~30M active) model for benchmarks. ``overrides`` replace fields.

        Example:
            >>> MoEConfig.small().num_experts
            16
        """
        base = cls(
            vocab_size=32000,
            dim=512,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=512,
            num_experts=16,
            max_seq_len=1024,
        )
        return dataclasses.replace(base, **overrides)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as two 3-D parameters (dim 0 = expert).

    Under expert parallelism the parameters are ``Shard(0)`` DTensors on ``pm["ep"]`` (then
    FSDP-sharded over ``efsdp``) and this module holds ``E / ep`` of them locally.
    ``forward(tokens, counts)`` runs local expert i on the next ``counts[i]`` rows (the contract
    of ``shardbridge.ep.run_experts``); it is a module call so FSDP2's hooks gather its weights.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        size, dim = config.intermediate_size, config.dim
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * size, dim))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, dim, size))

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Outputs ``[R, D]`` of the rows ``tokens`` ``[R, D]``, grouped by local expert."""
        gate_up, down = local_view(self.gate_up_proj), local_view(self.down_proj)
        if len(counts) != gate_up.shape[0]:
            raise ValueError(f"got counts for {len(counts)} experts, this rank holds {gate_up.shape[0]}")
        outputs = []
        # Every local expert runs, with zero rows too: each parameter gets a gradient on every
        # rank, so FSDP2's reduce-scatter sees the same parameters everywhere.
        for index, rows in enumerate(tokens.split(counts)):
            gate, up = F.linear(rows, gate_up[index]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, down[index]))
        return torch.cat(outputs)


class MoEFeedForward(nn.Module):
    """Router, routed experts and the optional shared expert of one block."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = config.num_experts, config.top_k, config.norm_topk_prob
        self.router = nn.Linear(config.dim, config.num_experts, bias=False)
        self.experts = GroupedExperts(config)
        if config.shared_expert_intermediate_size:
            shared = dataclasses.replace(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert = FeedForward(shared)
            self.shared_expert_gate = nn.Linear(config.dim, 1, bias=False)
        self.mesh: ParallelMesh | None = None  # set by MoELlama.set_expert_parallel
        self.dispatch: EPDispatch = "auto"
        self.router_stats: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = run_experts(
            tokens,
            expert_ids,
            weights.to(tokens.dtype),
            self.experts,
            num_experts=self.num_experts,
            mesh=self.mesh,
            dispatch=self.dispatch,
        )
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        self.router_stats = router_statistics(probs, expert_ids, self.num_experts)
        return out.view(shape)


class MoELlama(Llama):
    """The reference Llama with a routed mixture-of-experts MLP in every block.

    Same construction, init, context parallelism and FSDP units as :class:`Llama`; see the
    module docstring for the parameters. Forward returns the logits and leaves ``aux_loss``
    (the load-balancing loss of the global batch, with gradient) and ``tokens_per_expert``
    (``[layers, E]`` int64, global) on the model.

    Example:
        >>> model = MoELlama(MoEConfig.tiny())
        >>> logits = model(torch.zeros(2, 8, dtype=torch.long))
        >>> logits.shape, model.tokens_per_expert.sum().item()   # 2 layers * 16 tokens * top-2
        (torch.Size([2, 8, 256]), 64)
    """

    _RESIDUAL_OUTPUTS = ("o_proj.weight", "down.weight", "down_proj")
    config: MoEConfig

    def __init__(self, config: MoEConfig, *, seed: int = 0) -> None:
        if not isinstance(config, MoEConfig):
            raise ValueError(f"MoELlama needs a MoEConfig, got {type(config).__name__}; use Llama for a dense model")
        super().__init__(config, seed=seed)
        self.parallel_mesh: ParallelMesh | None = None
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    def _feed_forward(self, config: LlamaConfig) -> nn.Module:
        return MoEFeedForward(config)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``; sets ``aux_loss`` and ``tokens_per_expert`` (see the class)."""
        logits = super().forward(tokens, positions)
        stats = [layer.feed_forward.router_stats for layer in self.layers]
        counts = torch.stack([c for c, _, _ in stats])
        prob_sums = torch.stack([p for _, p, _ in stats])
        self.aux_loss, self.tokens_per_expert = load_balancing_loss(
            counts, prob_sums, sum(n for _, _, n in stats), mesh=self.parallel_mesh
        )
        return logits

    def set_expert_parallel(self, mesh: ParallelMesh | None, *, dispatch: EPDispatch = "auto") -> None:
        """Route tokens over ``mesh["ep"]`` (and split them over ``mesh["tp"]``); None = one process.

        Called by :func:`~shardbridge.models.parallelize_moe`; it does not touch the parameters.
        ``dispatch`` is ``shardbridge.ep.run_experts``'s ("auto", "all_to_all", "all_gather").
        """
        choose_dispatch(dispatch, top_k=self.config.top_k, ep=1)  # validates the name
        self.parallel_mesh = mesh
        for layer in self.layers:
            layer.feed_forward.mesh, layer.feed_forward.dispatch = mesh, dispatch

    def expert_modules(self) -> list[GroupedExperts]:
        """The routed experts of every block, in order (each becomes its own FSDP unit)."""
        return [layer.feed_forward.experts for layer in self.layers]

    def tp_plan(self) -> dict[str, ParamTP]:
        """As :meth:`Llama.tp_plan`; routed experts, router and shared gate are not tensor-parallel.

        Example:
            >>> plan = MoELlama(MoEConfig.tiny(shared_expert_intermediate_size=32)).tp_plan()
            >>> names = ("router.weight", "experts.down_proj", "shared_expert.down.weight")
            >>> [plan[f"layers.0.feed_forward.{n}"].mode.value for n in names]
            ['none', 'none', 'row']
        """
        plan = super().tp_plan()
        for fqn in plan:
            if ".feed_forward.experts." in fqn or fqn.endswith(("router.weight", "shared_expert_gate.weight")):
                plan[fqn] = ParamTP(mode="none")
        return plan
