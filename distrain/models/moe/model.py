"""A Llama-style decoder whose MLP is a mixture of top-k routed SwiGLU experts (Mixtral's layout).

Attention and norms are the Llama family's own. Each MoE layer keeps its routing statistics of the last forward as
plain attributes (``last_aux_loss`` and friends), which the family's spec reads to add the auxiliary loss to the
objective and to log the experts' load. The model holds no buffers, so it can be built on the meta device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distrain.models.common.attention import Attention
from distrain.models.common.decoder import Decoder, DecoderArgs, RMSNorm, decoder_args
from distrain.models.moe.spec import MOE_SPEC

if TYPE_CHECKING:
    from typing import Unpack

    from distrain.models.moe.expert_parallel import ExpertParallel


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts, every token to exactly ``top_k`` experts (no capacity, nothing dropped).

    The experts' weights are 3-D parameters with the expert as dim 0 (``w1`` gate and ``w3`` up: (n_experts,
    expert_hidden, d_model); ``w2`` down: (n_experts, d_model, expert_hidden)), so expert parallelism can shard dim 0.
    ``expert_parallel`` is None unless ``expert_parallel.parallelize_experts`` set it: then the experts' weights are
    DTensor shards and the forward sends each token-slot to the rank holding its expert (the routing, its statistics
    and the auxiliary loss stay this rank's own).

    Args:
        d_model: width of the input and output.
        expert_hidden: SwiGLU hidden units of one expert.
        n_experts: number of experts.
        top_k: experts per token; their gates are renormalised to sum to 1.
        load_balance_coef: weight of the Switch Transformer load-balancing loss.
        z_loss_coef: weight of the ST-MoE router z-loss.
    """

    def __init__(
        self,
        d_model: int,
        expert_hidden: int,
        n_experts: int,
        top_k: int,
        load_balance_coef: float = 0.01,
        z_loss_coef: float = 0.001,
    ) -> None:
        super().__init__()
        for name, value in (("expert_hidden", expert_hidden), ("n_experts", n_experts)):
            if value < 1:
                raise ValueError(f"{name} is {value}: it must be an integer >= 1")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k is {top_k}: it must be in 1..n_experts ({n_experts})")
        for name, value in (("load_balance_coef", load_balance_coef), ("z_loss_coef", z_loss_coef)):
            if value < 0:
                raise ValueError(f"{name} is {value}: it must be a number >= 0")
        self.n_experts, self.top_k = n_experts, top_k
        self.load_balance_coef, self.z_loss_coef = load_balance_coef, z_loss_coef
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, expert_hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, expert_hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, expert_hidden))
        # The last forward's routing, overwritten by every forward (read by the spec, never by this module).
        self.last_aux_loss: Tensor | None = None
        self.last_load_balance: Tensor | None = None
        self.last_z_loss: Tensor | None = None
        self.last_tokens_per_expert: Tensor | None = None
        self.expert_parallel: ExpertParallel | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        """Normal init in place on the parameters' device (meta included): router, ``w1`` and ``w3`` with ``std``,
        the down projection ``w2`` with ``out_std`` (default ``std``)."""
        for param in (self.router.weight, self.w1, self.w3):
            nn.init.normal_(param, mean=0.0, std=std)
        nn.init.normal_(self.w2, mean=0.0, std=std if out_std is None else out_std)

    def route(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Route ``tokens`` (n, d_model): router logits and probabilities (n, n_experts), the chosen experts
        (n, top_k) and their gates renormalised to sum to 1 (n, top_k); fp32 whatever the autocast dtype, on the
        tokens' device."""
        logits = self.router(tokens).float()
        probs = logits.softmax(dim=-1)
        top_probs, experts = probs.topk(self.top_k, dim=-1)
        gates = top_probs / top_probs.sum(dim=-1, keepdim=True)
        return logits, probs, experts, gates

    def forward(self, x: Tensor) -> Tensor:
        """Apply the experts to ``x`` (..., d_model) on its device; returns the same shape and dtype."""
        tokens = x.reshape(-1, x.shape[-1])
        logits, probs, experts, gates = self.route(tokens)
        slots = experts.flatten()  # slot j is token j // top_k's choice j % top_k
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, slots, torch.ones_like(slots))
        # Group the slots by expert: a stable sort keeps each expert's tokens in order, so results are reproducible.
        order = slots.argsort(stable=True)
        token_of_slot = order // self.top_k
        grouped = tokens.index_select(0, token_of_slot)
        if self.expert_parallel is None:
            expert_out = self._experts(grouped, self._group_sizes(counts, slots.numel()))
        else:  # sorted by global expert, the slots are already grouped by the rank that holds their expert
            expert_out = self.expert_parallel.dispatch_and_combine(self, grouped, counts)
        weighted = expert_out * gates.flatten().index_select(0, order)[:, None]
        out = torch.zeros_like(tokens).index_add_(0, token_of_slot, weighted.to(tokens.dtype))
        self._record(logits, probs, counts)
        return out.view_as(x)

    def _group_sizes(self, counts: Tensor, num_slots: int) -> list[int]:
        """Token-slots per expert as Python ints (one host sync). On the meta device, where there are no values, a
        balanced routing: what the dry-run planner's activation estimate assumes."""
        if counts.device.type != "meta":
            return counts.tolist()
        base, extra = divmod(num_slots, self.n_experts)
        return [base + (expert < extra) for expert in range(self.n_experts)]

    def _experts(
        self, grouped: Tensor, sizes: list[int], weights: tuple[Tensor, Tensor, Tensor] | None = None
    ) -> Tensor:
        """SwiGLU of each expert on its contiguous group of ``grouped`` (slots, d_model) rows, on their device.
        ``weights``: (w1, w3, w2) with the experts of ``sizes`` as dim 0; default this module's own."""
        # unbind, not w1[e]: its backward stacks the experts' gradients once instead of one full-size zero each.
        w1, w3, w2 = (w.unbind(0) for w in (weights or (self.w1, self.w3, self.w2)))
        outputs = []
        for expert, rows in enumerate(grouped.split(sizes)):
            # With no rows at all (an expert-parallel rank that received none) the empty matmuls still run: the
            # output keeps the autocast dtype its peers send and the backward still reaches the all-to-all.
            if rows.shape[0] == 0 and grouped.shape[0] > 0:
                continue
            hidden = F.silu(rows @ w1[expert].t()) * (rows @ w3[expert].t())
            outputs.append(hidden @ w2[expert].t())
        return torch.cat(outputs)

    def _record(self, logits: Tensor, probs: Tensor, counts: Tensor) -> None:
        """Store the auxiliary loss (with grad) and the detached routing statistics of this forward."""
        slot_fraction = counts.float() / counts.sum().clamp_min(1)  # f_i: no gradient, as in Switch
        mean_prob = probs.mean(dim=0)  # P_i: the load-balancing term's only gradient path
        load_balance = self.n_experts * (slot_fraction * mean_prob).sum()
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        self.last_aux_loss = self.load_balance_coef * load_balance + self.z_loss_coef * z_loss
        self.last_load_balance = load_balance.detach()
        self.last_z_loss = z_loss.detach()
        self.last_tokens_per_expert = counts.detach()


class MoEBlock(nn.Module):
    """Pre-norm decoder block with a mixture-of-experts MLP; ``forward`` takes the hidden states only."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        expert_hidden: int,
        n_experts: int,
        top_k: int,
        load_balance_coef: float,
        z_loss_coef: float,
        norm_eps: float,
        rope_theta: float,
    ) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(d_model, norm_eps)
        self.attention = Attention(d_model, n_heads, n_kv_heads, rope_theta, None)
        self.ffn_norm = RMSNorm(d_model, norm_eps)
        self.moe = MoEFeedForward(d_model, expert_hidden, n_experts, top_k, load_balance_coef, z_loss_coef)

    def forward(self, x: Tensor, documents: Tensor | None = None) -> Tensor:
        """Run the block on ``x`` (batch, seq, d_model) on its device (``documents``: ``Attention.forward``'s)."""
        h = x + self.attention(self.attention_norm(x), documents=documents)
        return h + self.moe(self.ffn_norm(h))


class MoE(Decoder):
    """Mixture-of-experts decoder: Llama's, with top-k routed experts as each block's MLP (the spec refuses
    pipelines, for the auxiliary loss)."""

    parallel_spec = MOE_SPEC

    def __init__(
        self,
        *,
        expert_hidden: int,
        n_experts: int,
        top_k: int,
        load_balance_coef: float = 0.01,
        z_loss_coef: float = 0.001,
        init_from: str | None = None,
        **sizes: Unpack[DecoderArgs],
    ) -> None:
        experts = (expert_hidden, n_experts, top_k, load_balance_coef, z_loss_coef)

        def block(decoder: Decoder) -> MoEBlock:
            heads = (decoder.d_model, decoder.n_heads, decoder.n_kv_heads)
            return MoEBlock(*heads, *experts, decoder.norm_eps, decoder.rope_theta)

        # the router and the experts' 3-D weights initialise themselves
        super().__init__(**decoder_args(sizes), block=block, self_initialising=(MoEFeedForward,))
        self.expert_hidden, self.n_experts, self.top_k = expert_hidden, n_experts, top_k
        self.load_balance_coef, self.z_loss_coef = load_balance_coef, z_loss_coef
        self.initialise(init_from)  # a Mixtral directory, renamed by the spec's from_hf (moe/hf.py)
