"""How a mixture-of-experts router picks experts: `Routing` says how, `Router` does it.

Every family's router is the same few steps, with a switch for each way they differ:
score every expert (a softmax or a sigmoid of the router's logits), choose the top k
(by the scores, or by the logits), and turn the chosen ones' scores into the weights their
outputs are multiplied by (renormalized, scaled). The steps are transformers' own, op for
op and in its dtypes, so that qkv chooses the experts transformers chooses, ties included:
torch.topk breaks a tie by its own sort, not by the lowest index, so qkv calls it on the
same numbers with the same arguments.

Each family's router, in these words (E experts, k per token; config keys from transformers):

    Mixtral      Routing(E, k)
    Qwen3-MoE    Routing(E, k, normalize=norm_topk_prob, weights_dtype="input")
    gpt-oss      Routing(E, k, choose_by="logits", normalize=False, router_bias=True,
                         scores_dtype="input", weights_dtype="input")
    DeepSeek-V3  Routing(E, k, score="sigmoid", normalize=norm_topk_prob, groups=n_group,
                         groups_chosen=topk_group, correction_bias=True,
                         scaling=routed_scaling_factor, logits_dtype="float32")
    Llama 4      Routing(E, k, score="sigmoid", choose_by="logits", normalize=False,
                         scale_input=True, weights_dtype="input")
    Gemma 4      Routing(E, k, input_norm=True, norm_eps=rms_norm_eps, expert_scale=True)

>>> routing = Routing(num_experts=8, top_k=2)  # Mixtral's
>>> logits, scores, experts, weights = Router(16, routing)(torch.randn(5, 16))
>>> experts.shape, bool(torch.allclose(weights.sum(-1), torch.ones(5)))
(torch.Size([5, 2]), True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Precision = Literal["input", "float32"]


@dataclass(frozen=True)
class Routing:
    """How a router picks experts for each token.

    num_experts: how many experts there are (E). top_k: how many each token goes to (k).
    score: what the router thinks of each expert, from its logits: "softmax" over all the
        experts (Mixtral, Qwen3-MoE, gpt-oss, Gemma 4) or "sigmoid" of each (DeepSeek-V3,
        Llama 4).
    choose_by: "scores" takes the top k of the scores, and their scores are the weights;
        "logits" takes the top k of the logits and scores only the k chosen: a softmax over
        the k (gpt-oss), or a sigmoid of each (Llama 4).
    normalize: divide the chosen weights by their sum (Mixtral; Qwen3-MoE's and DeepSeek-V3's
        norm_topk_prob; for sigmoid scores the sum gets DeepSeek-V3's 1e-20 guard).
    scaling: a factor on every weight (DeepSeek-V3's routed_scaling_factor).
    groups, groups_chosen: group-limited choice (DeepSeek-V3's n_group, topk_group): the
        experts are split into `groups` equal groups, a group scores the sum of its top two,
        and the experts are chosen from the best `groups_chosen` groups only.
    correction_bias: a per-expert bias added to the scores for choosing only, never to the
        weights (DeepSeek-V3's e_score_correction_bias, `Router.correction_bias`).
    router_bias: the router's Linear has a bias (gpt-oss).
    scale_input: the weight multiplies each chosen expert's input, not its output (Llama 4).
    input_norm: the router reads its input RMS-normalized with no gain (eps `norm_eps`, in
        float32), times a learned per-channel `Router.input_scale` and 1/sqrt(C) (Gemma 4).
    expert_scale: a learned per-expert factor `Router.expert_scale` on the weights after
        they are normalized (Gemma 4's per_expert_scale).
    logits_dtype: "float32" runs the router's product in float32 whatever the input
        (DeepSeek-V3); "input" runs it in the input's dtype.
    scores_dtype: the dtype the softmax or sigmoid runs in: "float32" (most), or the logits'
        own dtype, "input" (gpt-oss).
    weights_dtype: the weights are rounded to the input's dtype before they multiply,
        "input" (Qwen3-MoE, gpt-oss, Llama 4), or kept as computed, "float32" (Mixtral,
        DeepSeek-V3, Gemma 4). In float32 and float64 the two give the same numbers.
    """

    num_experts: int
    top_k: int
    score: Literal["softmax", "sigmoid"] = "softmax"
    choose_by: Literal["scores", "logits"] = "scores"
    normalize: bool = True
    scaling: float = 1.0
    groups: int = 1
    groups_chosen: int = 1
    correction_bias: bool = False
    router_bias: bool = False
    scale_input: bool = False
    input_norm: bool = False
    norm_eps: float = 1e-6
    expert_scale: bool = False
    logits_dtype: Precision = "input"
    scores_dtype: Precision = "float32"
    weights_dtype: Precision = "float32"

    def __post_init__(self):
        E, k = self.num_experts, self.top_k
        if not isinstance(E, int) or E < 1:
            raise ValueError(f"num_experts must be a whole number of at least 1, not {E!r}")
        if not isinstance(k, int) or not 1 <= k <= E:
            raise ValueError(
                f"top_k {k!r} must be between 1 and num_experts ({E}): a token goes to at "
                "least one expert and cannot go to more experts than there are"
            )
        for name, value, allowed in (
            ("score", self.score, ("softmax", "sigmoid")),
            ("choose_by", self.choose_by, ("scores", "logits")),
            ("logits_dtype", self.logits_dtype, ("input", "float32")),
            ("scores_dtype", self.scores_dtype, ("input", "float32")),
            ("weights_dtype", self.weights_dtype, ("input", "float32")),
        ):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; allowed: {list(allowed)}")
        if not (math.isfinite(self.scaling) and self.scaling > 0):
            raise ValueError(f"scaling must be a positive number, not {self.scaling!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, not {self.norm_eps!r}")
        self._check_groups()
        if (self.groups > 1 or self.correction_bias) and (
            self.score != "sigmoid" or self.choose_by != "scores"
        ):
            raise ValueError(
                "groups and correction_bias are DeepSeek-V3's choice by sigmoid scores: they "
                "need score='sigmoid' and choose_by='scores'"
            )
        if self.choose_by == "logits" and self.score == "softmax" and self.normalize:
            raise ValueError(
                "normalize with choose_by='logits' and a softmax: the softmax over the chosen k "
                "already sums to 1 (gpt-oss); set normalize=False"
            )

    def _check_groups(self):
        G, chosen, E = self.groups, self.groups_chosen, self.num_experts
        if not isinstance(G, int) or G < 1 or E % G:
            raise ValueError(f"groups {G!r} must be a whole number that divides num_experts {E}")
        if not isinstance(chosen, int) or not 1 <= chosen <= G:
            raise ValueError(f"groups_chosen {chosen!r} must be between 1 and groups ({G})")
        if G > 1 and E // G < 2:
            raise ValueError(
                f"groups of {E // G} expert: a group scores the sum of its top two experts, so "
                "each group needs at least two"
            )
        if self.top_k > chosen * (E // G):
            raise ValueError(
                f"top_k {self.top_k} is more than the {chosen * (E // G)} experts in the "
                f"{chosen} chosen group(s)"
            )

    @property
    def sums_to_one(self) -> bool:
        """Whether a token's weights sum to 1 (before `scaling` and `expert_scale`)."""
        return self.normalize or (self.choose_by == "logits" and self.score == "softmax")


class Router(nn.Module):
    """A router: x (N, C) -> logits (N, E), scores (N, E), experts (N, k), weights (N, k).

    Its tensors, as a loader fills them: weight (E, C) and, with `router_bias`, bias (E,),
    the router's Linear; correction_bias (E,), a float32 buffer (keep it float32, as
    transformers does); input_scale (C,) with `input_norm`; expert_scale (E,) with
    `expert_scale`. experts come in the order torch.topk gives them; `ExpertRecord` sorts.
    """

    def __init__(self, width: int, routing: Routing):
        super().__init__()
        self.routing = routing
        E = routing.num_experts
        bound = 1 / math.sqrt(width)  # nn.Linear's initialization
        self.weight = nn.Parameter(torch.empty(E, width).uniform_(-bound, bound))
        self.bias = None
        if routing.router_bias:
            self.bias = nn.Parameter(torch.empty(E).uniform_(-bound, bound))
        correction_bias = torch.zeros(E, dtype=torch.float32) if routing.correction_bias else None
        self.register_buffer("correction_bias", correction_bias)
        self.input_scale = nn.Parameter(torch.ones(width)) if routing.input_norm else None
        self.expert_scale = nn.Parameter(torch.ones(E)) if routing.expert_scale else None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        r, dtype = self.routing, x.dtype
        if r.input_norm:  # Gemma 4: a gainless RMS norm in float32, pow(-0.5) as it has it
            h = x.float()
            h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + r.norm_eps, -0.5)
            x = h.type_as(x) * self.input_scale * x.shape[-1] ** -0.5
        weight = self.weight
        if r.logits_dtype == "float32":
            x, weight = x.float(), weight.float()
        # torch's own product, not qkv's oneDNN one: a choice is discrete, so the logits must
        # be transformers' to the last bit for a near-tie to fall the same way
        logits = F.linear(x, weight, self.bias)  # (N, E)
        scores = self._score(logits)  # (N, E)
        if r.choose_by == "logits":
            top, experts = torch.topk(logits, r.top_k, dim=-1)  # (N, k)
            weights = self._score(top)  # (N, k): a softmax over the k, or a sigmoid each
        else:
            experts = self._choose(scores)  # (N, k)
            weights = scores.gather(-1, experts)  # (N, k)
        if r.normalize:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + 1e-20 if r.score == "sigmoid" else total)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[experts]
        if r.scaling != 1.0:
            weights = weights * r.scaling
        if r.weights_dtype == "input":
            weights = weights.to(dtype)
        return logits, scores, experts, weights

    def _score(self, logits: Tensor) -> Tensor:
        """Softmax over the last dimension, or sigmoid of each, in `scores_dtype`."""
        if self.routing.scores_dtype == "float32":
            logits = logits.float()
        if self.routing.score == "softmax":
            return F.softmax(logits, dim=-1)
        return torch.sigmoid(logits)

    def _choose(self, scores: Tensor) -> Tensor:
        """The top k experts (N, k) by their scores, plus the correction bias, among the best
        groups: DeepSeek-V3's steps, unsorted top-k included, where it has them."""
        r = self.routing
        E, G = r.num_experts, r.groups
        if r.score == "softmax":  # Mixtral, Qwen3-MoE, Gemma 4: a plain, sorted top-k
            return torch.topk(scores, r.top_k, dim=-1)[1]
        choice = scores if self.correction_bias is None else scores + self.correction_bias
        if G > 1:
            group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # (N, G)
            best = torch.topk(group_scores, k=r.groups_chosen, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores).scatter_(1, best, 1)  # (N, G)
            mask = mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)  # (N, E)
            choice = choice.masked_fill(~mask.bool(), float("-inf"))
        return torch.topk(choice, k=r.top_k, dim=-1, sorted=False)[1]
