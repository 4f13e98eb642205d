"""MoE against transformers' own blocks, family by family: the same weights give the same
output, the same experts (ties included) and the same weights; the record is what the layer
used; a bad Routing is refused by name."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    GptOssConfig,
    Llama4TextConfig,
    MixtralConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.gemma4 import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from qkv.nn.experts import ExpertRecord, MoE
from qkv.nn.routing import Routing

C, HIDDEN, E, K = 16, 8, 8, 2  # width, an expert's hidden size, experts, experts per token


@dataclass
class Pair:
    """A transformers MoE and qkv's, with the same weights. choose: transformers' router on
    (N, C) -> (N, E), its weight of each expert, 0 where not chosen. run: its output (N, C)
    on x and route_by (B, T, C) where the block is not one module (Gemma 4's router reads
    route_by, its experts x)."""

    hf: torch.nn.Module
    moe: MoE
    choose: Callable
    run: Callable | None = None

    def output(self, x, route_by):
        if self.run is not None:
            return self.run(x, route_by)
        out = self.hf(x)
        return (out[0] if isinstance(out, tuple) else out).reshape(-1, C)

    def chosen(self, x, route_by):
        return self.choose((x if self.run is None else route_by).reshape(-1, C))

    def route_by(self, route_by):
        """What qkv's MoE is given as route_by: None where the router reads x."""
        return None if self.run is None else route_by


def dense(experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, k) experts and weights -> (N, E), the weight of every expert, 0 where not chosen."""
    return torch.zeros(len(experts), E, dtype=weights.dtype).scatter(1, experts, weights)


def dense_of(routed) -> torch.Tensor:
    *_, weights, experts = routed  # transformers' routers return (..., weights, experts)
    return dense(experts, weights)


def noise(module: torch.nn.Module):
    """Every parameter and float buffer random, so biases and correction biases are not 0;
    a matrix's entries about 1/sqrt(its rows' length), so outputs are about 1."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                scale = tensor.shape[-1] ** -0.5 if tensor.dim() > 1 else 0.5
                tensor.copy_(torch.randn_like(tensor) * scale)


def load(moe: MoE, tensors: dict):
    """Copy transformers' tensors into qkv's names; every one of qkv's is filled."""
    own = {**dict(moe.named_parameters()), **dict(moe.named_buffers())}
    assert set(tensors) == set(own), set(own) ^ set(tensors)
    with torch.no_grad():
        for name, tensor in tensors.items():
            assert own[name].shape == tensor.shape, (name, own[name].shape, tensor.shape)
            own[name].copy_(tensor)


def stacked(experts: torch.nn.Module) -> dict:
    """transformers' (E, 2I, C) and (E, C, I) experts: qkv's layout as it is."""
    return {"gate_up": experts.gate_up_proj, "down": experts.down_proj}


def shared(mlp: torch.nn.Module) -> dict:
    return {f"shared.{name}.weight": getattr(mlp, f"{name}_proj").weight for name in SHARED}


SHARED = ("gate", "up", "down")


def mixtral() -> Pair:
    config = MixtralConfig(
        hidden_size=C, intermediate_size=HIDDEN, num_local_experts=E, num_experts_per_tok=K
    )
    hf = MixtralSparseMoeBlock(eager(config))
    noise(hf)
    moe = MoE(C, HIDDEN, Routing(E, K))
    load(moe, {"router.weight": hf.gate.weight, **stacked(hf.experts)})
    return Pair(hf, moe, lambda x: dense_of(hf.gate(x)))


def qwen3_moe(normalize: bool = True) -> Pair:
    config = Qwen3MoeConfig(
        hidden_size=C, moe_intermediate_size=HIDDEN, num_experts=E, num_experts_per_tok=K,
        norm_topk_prob=normalize,
    )  # fmt: skip
    hf = Qwen3MoeSparseMoeBlock(eager(config))
    noise(hf)
    moe = MoE(C, HIDDEN, Routing(E, K, normalize=normalize, weights_dtype="input"))
    load(moe, {"router.weight": hf.gate.weight, **stacked(hf.experts)})
    return Pair(hf, moe, lambda x: dense_of(hf.gate(x)))


def gpt_oss() -> Pair:
    config = GptOssConfig(
        hidden_size=C, intermediate_size=HIDDEN, num_local_experts=E, num_experts_per_tok=K
    )
    hf = GptOssMLP(eager(config))
    noise(hf)
    with torch.no_grad():  # past the clamp at 7 often, so its formula is tested; outputs ~1
        hf.experts.gate_up_proj *= 6
        hf.experts.down_proj /= 8
    routing = Routing(
        E, K, choose_by="logits", normalize=False, router_bias=True, scores_dtype="input",
        weights_dtype="input",
    )  # fmt: skip
    moe = MoE(
        C, HIDDEN, routing, "clamped_swiglu", bias=True, limit=config.swiglu_limit,
        alpha=config.swiglu_alpha,
    )  # fmt: skip
    w, b = hf.experts.gate_up_proj, hf.experts.gate_up_proj_bias  # (E, C, 2I): interleaved
    load(moe, {
        "router.weight": hf.router.weight,
        "router.bias": hf.router.bias,
        "gate_up": torch.cat([w[..., 0::2], w[..., 1::2]], -1).transpose(1, 2),
        "gate_up_bias": torch.cat([b[:, 0::2], b[:, 1::2]], -1),
        "down": hf.experts.down_proj.transpose(1, 2),
        "down_bias": hf.experts.down_proj_bias,
    })  # fmt: skip
    return Pair(hf, moe, lambda x: dense_of(hf.router(x)))


def deepseek_v3() -> Pair:
    config = DeepseekV3Config(
        hidden_size=C, moe_intermediate_size=HIDDEN, n_routed_experts=E, num_experts_per_tok=K,
        n_group=4, topk_group=2, n_shared_experts=2, norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )  # fmt: skip
    hf = DeepseekV3MoE(eager(config))
    noise(hf)
    with torch.no_grad():  # a nudge, as trained ones are, so tokens still spread over experts
        hf.gate.e_score_correction_bias *= 0.1
    routing = Routing(
        E, K, score="sigmoid", groups=4, groups_chosen=2, correction_bias=True, scaling=2.5,
        logits_dtype="float32",
    )  # fmt: skip
    moe = MoE(C, HIDDEN, routing, shared_hidden=2 * HIDDEN)
    load(moe, {
        "router.weight": hf.gate.weight,
        "router.correction_bias": hf.gate.e_score_correction_bias,
        **stacked(hf.experts),
        **shared(hf.shared_experts),
    })  # fmt: skip
    return Pair(hf, moe, lambda x: dense_of(hf.gate(x)))


def llama4() -> Pair:
    config = Llama4TextConfig(
        hidden_size=C, intermediate_size=HIDDEN, num_local_experts=E, num_experts_per_tok=K
    )
    hf = Llama4TextMoe(eager(config))
    noise(hf)
    routing = Routing(
        E, K, score="sigmoid", choose_by="logits", normalize=False, scale_input=True,
        weights_dtype="input",
    )  # fmt: skip
    moe = MoE(C, HIDDEN, routing, shared_hidden=HIDDEN)
    load(moe, {
        "router.weight": hf.router.weight,
        "gate_up": hf.experts.gate_up_proj.transpose(1, 2),  # (E, C, 2I)
        "down": hf.experts.down_proj.transpose(1, 2),  # (E, I, C)
        **shared(hf.shared_expert),
    })  # fmt: skip
    # its router's scores are already dense: the sigmoid of the chosen logits, 0 elsewhere
    return Pair(hf, moe, lambda x: hf.router(x)[0])


def gemma4() -> Pair:
    config = Gemma4TextConfig(
        hidden_size=C, moe_intermediate_size=HIDDEN, num_experts=E, top_k_experts=K,
        enable_moe_block=True,
    )  # fmt: skip
    router, experts = Gemma4TextRouter(config), Gemma4TextExperts(eager(config))
    hf = torch.nn.ModuleDict({"router": router, "experts": experts})
    noise(hf)
    routing = Routing(E, K, input_norm=True, norm_eps=config.rms_norm_eps, expert_scale=True)
    moe = MoE(C, HIDDEN, routing, activation="gelu_tanh")
    load(moe, {
        "router.weight": router.proj.weight,
        "router.input_scale": router.scale,
        "router.expert_scale": router.per_expert_scale,
        **stacked(experts),
    })  # fmt: skip

    def run(x, route_by):  # as Gemma4TextDecoderLayer: routed by route_by, experts on x
        _, weights, chosen = router(route_by.reshape(-1, C))
        return experts(x.reshape(-1, C), chosen, weights)

    return Pair(hf, moe, lambda x: dense_of(router(x)), run)


def qwen3_next() -> Pair:
    """Qwen3-Next (and Qwen3.5-MoE): Qwen3-MoE's router, a shared expert gated by a sigmoid."""
    config = Qwen3NextConfig(
        hidden_size=C, moe_intermediate_size=HIDDEN, num_experts=E, num_experts_per_tok=K,
        shared_expert_intermediate_size=12, norm_topk_prob=True,
    )  # fmt: skip
    hf = Qwen3NextSparseMoeBlock(eager(config))
    noise(hf)
    routing = Routing(E, K, weights_dtype="input")
    moe = MoE(C, HIDDEN, routing, shared_hidden=12, shared_gate=True)
    load(moe, {"router.weight": hf.gate.weight, "shared_gate.weight": hf.shared_expert_gate.weight,
               **stacked(hf.experts), **shared(hf.shared_expert)})  # fmt: skip
    return Pair(hf, moe, lambda x: dense_of(hf.gate(x)))


def eager(config):
    """transformers' own loop over the experts, the one a CPU runs."""
    config._experts_implementation = "eager"
    return config


FAMILIES = {
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "qwen3_moe_unnormalized": lambda: qwen3_moe(normalize=False),
    "gpt_oss": gpt_oss,
    "deepseek_v3": deepseek_v3,
    "llama4": llama4,
    "gemma4": gemma4,
    "qwen3_next": qwen3_next,
}


def build(family: str, dtype=torch.float32, seed: int = 0) -> Pair:
    torch.manual_seed(seed)
    pair = FAMILIES[family]()
    pair.hf.to(dtype), pair.moe.to(dtype)
    if family == "deepseek_v3":  # transformers keeps its router in float32; so would a loader
        pair.hf.gate.float(), pair.moe.router.float()
    return pair


def inputs(dtype, B=2, T=9, scale=1.0):
    """x and route_by (B, T, C)."""
    return torch.randn(B, T, C, dtype=dtype) * scale, torch.randn(B, T, C, dtype=dtype) * scale


def compare(pair: Pair, x, route_by, atol, weights_atol=0.0):
    """qkv's output, chosen experts and weights against transformers'; returns the record."""
    with torch.no_grad():
        want, want_weights = pair.output(x, route_by), pair.chosen(x, route_by)
        out, record = pair.moe(x, record=True, route_by=pair.route_by(route_by))
    got_weights = dense(record.experts.flatten(0, 1), record.weights.flatten(0, 1))
    assert torch.equal(got_weights != 0, want_weights != 0), "the same experts for every token"
    torch.testing.assert_close(got_weights, want_weights.to(got_weights.dtype), rtol=0,
                               atol=weights_atol)  # fmt: skip
    torch.testing.assert_close(out.flatten(0, 1), want, rtol=0, atol=atol)
    return record


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_moe_is_transformers_exactly(family, dtype):
    pair = build(family, dtype)
    x, route_by = inputs(dtype)
    # the routing weights to one float32 step (2^-23 of 1): Llama 4's router takes its
    # sigmoid in float32 on both sides, and on an AVX2 EPYC the two came out one step apart
    # (torch's vectorized and scalar paths), 3e-8 of the float64 output
    float32_router = family == "llama4"
    atol = 1e-6 if dtype == torch.float32 else 1e-7 if float32_router else 1e-12
    record = compare(pair, x, route_by, atol=atol, weights_atol=2**-23)
    assert len(torch.unique(record.experts)) > K, "the tokens went to several experts"
    if family == "gpt_oss":  # the clamp is reached, so its formula is tested
        gate_up = torch.einsum("btc,eic->btei", x, pair.moe.gate_up)
        assert (gate_up.abs() > pair.moe.limit).float().mean() > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_is_transformers_bit_for_bit_in_bfloat16(family):
    """In bfloat16 both run torch's products, so the dtype of every step shows: a weight
    rounded to bfloat16 where transformers keeps it in float32 would change the output."""
    pair = build(family, torch.bfloat16)
    x, route_by = inputs(torch.bfloat16)
    compare(pair, x, route_by, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_ties_choose_the_experts_transformers_chooses(family):
    """Router rows that are multiples of one vector score experts exactly equally, and a
    zero token ties every expert: torch.topk's sort breaks those ties, not the index."""
    pair = build(family)
    levels = torch.tensor([1, 1, 0.5, 0.5, 1, 1, 0.25, 1])  # DeepSeek's groups: 2 experts each
    with torch.no_grad():
        for module in (pair.hf, pair.moe):
            tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
            for name, tensor in tensors.items():
                if name in ("gate.weight", "router.weight", "router.proj.weight"):
                    tensor.copy_(levels[:, None] * tensor[0])
                if name in ("router.bias", "router.correction_bias") or "score_correction" in name:
                    tensor.fill_(0.1)  # the same for every expert: the ties stay
    x, route_by = inputs(torch.float32)
    x[0, 0], route_by[0, 0] = 0, 0  # a zero token: every expert scores the same
    with torch.no_grad():
        _, record = pair.moe(x, record=True, route_by=pair.route_by(route_by))
    logits = record.logits.flatten(0, 1).sort(dim=-1, descending=True).values
    assert (logits[:, K - 1] == logits[:, K]).sum() > 3, "ties where the choice is made"
    compare(pair, x, route_by, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_record_is_what_the_layer_used(family):
    pair = build(family, seed=1)
    x, route_by = inputs(torch.float32)
    route_by = pair.route_by(route_by)
    moe = pair.moe
    with torch.no_grad():
        out, record = moe(x, record=True, route_by=route_by)
        rebuilt = torch.zeros_like(x)
        for j in range(K):  # the record's weights times the experts' outputs, summed
            for b, t in itertools.product(range(2), range(9)):
                e, w = record.experts[b, t, j].item(), record.weights[b, t, j]
                if moe.routing.scale_input:
                    rebuilt[b, t] += moe.expert(e, x[b, t, None] * w)[0]
                else:
                    rebuilt[b, t] += moe.expert(e, x[b, t, None])[0] * w
        if moe.shared is not None:
            gate = 1.0 if moe.shared_gate is None else torch.sigmoid(moe.shared_gate(x))
            rebuilt += gate * moe.shared(x)
    torch.testing.assert_close(rebuilt, out, rtol=1e-6, atol=1e-6)  # summed in another order
    assert (record.weights[..., :-1] >= record.weights[..., 1:]).all(), "largest first"
    assert record.scores.shape == record.logits.shape == (2, 9, E)
    if moe.routing.score == "softmax":
        torch.testing.assert_close(record.scores.sum(-1).float(), torch.ones(2, 9))


def test_only_the_chosen_experts_run(monkeypatch):
    pair = build("mixtral")
    ran = []
    expert = pair.moe.expert
    monkeypatch.setattr(pair.moe, "expert", lambda i, h: ran.append((i, len(h))) or expert(i, h))
    _, record = pair.moe(torch.randn(1, 3, C), record=True)
    counts = torch.bincount(record.experts.flatten(), minlength=E)
    assert ran == [(i, n) for i, n in enumerate(counts.tolist()) if n], "once each, on its own"


def record(routing: Routing, experts, weights) -> ExpertRecord:
    experts, weights = torch.tensor([[experts]]), torch.tensor([[weights]])
    scores = torch.zeros(1, 1, routing.num_experts)
    return ExpertRecord(experts, weights, scores, scores, routing)


def test_describe_says_the_shares_or_the_raw_scores():
    assert record(Routing(8, 2), [3, 7], [0.62, 0.38]).describe(0, 0) == (
        "went to experts 3 and 7 (62% / 38%)"
    )
    sigmoid = Routing(8, 2, score="sigmoid", choose_by="logits", normalize=False,
                      scale_input=True)  # fmt: skip
    assert record(sigmoid, [3, 7], [0.41, 0.22]).describe() == (
        "went to experts 3 and 7 (weights 0.41 and 0.22: sigmoid scores; they need not sum "
        "to 1; each weight multiplies its expert's input, not its output)"
    )
    deepseek = Routing(8, 3, score="sigmoid", scaling=2.5)
    assert record(deepseek, [1, 4, 0], [1.5, 0.75, 0.25]).describe() == (
        "went to experts 1, 4 and 0 (60% / 30% / 10%: weights 1.5, 0.75 and 0.25, which sum to 2.5)"
    )
    unnormalized = Routing(8, 1, normalize=False)
    assert record(unnormalized, [5], [0.3]).describe() == (
        "went to expert 5 (weights 0.3: softmax probabilities over all 8 experts, not "
        "renormalized; they need not sum to 1)"
    )
    gemma = Routing(8, 2, input_norm=True, expert_scale=True)
    assert record(gemma, [3, 7], [0.9, 0.3]).describe() == (
        "went to experts 3 and 7 (75% / 25%: weights 0.9 and 0.3, each times its expert's "
        "learned scale)"
    )
    unnormalized_sigmoid = Routing(8, 2, score="sigmoid", normalize=False, scaling=2.0)
    assert record(unnormalized_sigmoid, [2, 0], [1.2, 0.5]).describe() == (
        "went to experts 2 and 0 (weights 1.2 and 0.5: sigmoid scores, times 2; they need not "
        "sum to 1)"
    )
    with pytest.raises(ValueError, match="token 1 is out of range"):
        record(Routing(8, 2), [3, 7], [0.62, 0.38]).describe(0, 1)


def test_describe_reads_a_real_record():
    pair = build("mixtral")
    _, kept = pair.moe(torch.randn(1, 4, C), record=True)
    first, second = kept.experts[0, 3].tolist()
    share = round(100 * kept.weights[0, 3, 0].item())
    words = f"went to experts {first} and {second} ({share}% / {100 - share}%)"
    assert kept.describe(0, 3) == words


@pytest.mark.parametrize(
    "fields, fault",
    [
        (dict(num_experts=8, top_k=9), "top_k 9 must be between 1 and num_experts"),
        (dict(num_experts=8, top_k=0), "top_k 0 must be between 1"),
        (dict(num_experts=8, top_k=2, score="relu"), "unknown score 'relu'"),
        (dict(num_experts=8, top_k=2, score="sigmoid", groups=3), "groups 3 must be a whole"),
        (
            dict(num_experts=8, top_k=2, score="sigmoid", groups=4, groups_chosen=5),
            "groups_chosen 5",
        ),
        (dict(num_experts=8, top_k=2, score="sigmoid", groups=8), "groups of 1 expert"),
        (
            dict(num_experts=8, top_k=5, score="sigmoid", groups=4, groups_chosen=2),
            "more than the 4",
        ),
        (dict(num_experts=8, top_k=2, correction_bias=True), "need score='sigmoid'"),
        (dict(num_experts=8, top_k=2, choose_by="logits"), "already sums to 1"),
        (dict(num_experts=8, top_k=2, scaling=0.0), "scaling must be a positive number"),
    ],
)
def test_a_bad_routing_is_refused_by_name(fields, fault):
    with pytest.raises(ValueError, match=fault):
        Routing(**fields)


def test_a_bad_moe_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        MoE(C, HIDDEN, Routing(E, K), activation="swish")
    with pytest.raises(ValueError, match="route_by has shape"):
        MoE(C, HIDDEN, Routing(E, K))(torch.randn(1, 3, C), route_by=torch.randn(1, 4, C))
