"""The census of heads, rollout and flow: planted heads found, hand computations matched."""

from __future__ import annotations

import math
import types

import pytest
import torch

from qkv.inspect.census import (
    FLOW_MAX_TOKENS,
    census_of,
    flow,
    heads,
    induction_ids,
    rollout,
    text_rollout,
)
from qkv.models import Decoder, DecoderConfig, EncoderDecoder, EncoderDecoderConfig
from qkv.nn import BlockConfig

V, P = 20, 40  # tokens, positions
PREV = V + P  # where layer 0's previous-token head writes the token before (V dims)
C, D = V + P + V, P  # width; head size (holds a position one-hot or a token one-hot)


def planted_decoder() -> Decoder:
    """A 2-layer, 2-head decoder with no norms and no MLP, each head set by hand.

    The residual stream holds one-hots: the token (dims 0..V), the position (V..V+P), and
    after layer 0 the previous token (PREV..PREV+V).
    - layer 0 head 0, previous token: query e_i and key e_{j+1} from the positions, so the
      score is 20 where j = i - 1; its value is the key's token, written to the PREV dims;
    - layer 0 head 1, sink: every query is ln(3) e_0, only position 0's key is e_0, so key 0
      scores ln 3 and the others 0: key 0 gets 3 / (3 + i) of query i; its value is 0;
    - layer 1 head 0, induction by K-composition: query = 20 x the token, key = the PREV
      dims, so query i attends to the keys whose previous token is its own token;
    - layer 1 head 1: all zeros, uniform attention.
    """
    block = BlockConfig(width=C, num_heads=2, head_dim=D, norm_position="none", bias=False,
                        attn_scale=1.0, backend="eager")  # fmt: skip
    model = Decoder(DecoderConfig(vocab_size=V, num_layers=2, block=block, max_positions=P))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.embed.tokens.weight[:, :V] = torch.eye(V)
        model.embed.positions.embedding.weight[:, V : V + P] = torch.eye(P)
        first, second = model.blocks[0].attn, model.blocks[1].attn
        for d in range(P):  # layer 0 head 0: previous token
            first.q.weight[d, V + d] = 20.0
            if d + 1 < D:
                first.k.weight[d + 1, V + d] = 1.0
        for t in range(V):
            first.v.weight[t, t] = 1.0  # the key's token ...
            first.out.weight[PREV + t, t] = 1.0  # ... written where the previous token goes
        first.q.weight[D, V : V + P] = math.log(3.0)  # layer 0 head 1: sink on key 0
        first.k.weight[D, V] = 1.0
        for t in range(V):  # layer 1 head 0: induction
            second.q.weight[t, t] = 20.0
            second.k.weight[t, PREV + t] = 1.0
    return model.eval()


def prompts_without_repeats(n: int = 3, length: int = 12) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randperm(V, generator=generator)[:length].tolist() for _ in range(n)]


def test_planted_previous_token_and_induction_heads_rank_first():
    census = census_of(planted_decoder(), prompts_without_repeats(),
                       induction_ids(range(V), rows=4, length=12, seed=0))  # fmt: skip
    (layer, head, score), second = census.top("previous_token", 2)
    assert (layer, head) == (0, 0) and score > 0.99 and second[2] < 0.8
    (layer, head, score), second = census.top("induction", 2)
    assert (layer, head) == (1, 0) and score > 0.5 and second[2] < 0.2
    assert census.induction[0, 0] < 0.05, "the previous-token head is no induction head"


def test_planted_sink_gets_the_mass_computed_by_hand():
    prompts = [*prompts_without_repeats(n=2, length=10), [3, 1, 4, 1, 5]]
    census = census_of(planted_decoder(), prompts, induction_ids(range(V), 1, 4, seed=0))
    # key 0 gets 3 / (3 + i) of query i >= 1 (ln 3 against i zeros): each prompt's mean over
    # its queries, then the mean over the prompts (each prompt weighs the same)

    def mean_over_prompts(value) -> float:
        means = [sum(value(i) for i in range(1, len(ids))) / (len(ids) - 1) for ids in prompts]
        return sum(means) / len(means)

    expected = mean_over_prompts(lambda i: 3 / (3 + i))
    assert census.first_token[0, 1].item() == pytest.approx(expected, abs=1e-6)
    assert census.spreads["first_token"].values[2, 0, 1].item() == pytest.approx(
        sum(3 / (3 + i) for i in range(1, 5)) / 4, abs=1e-6
    )  # the short prompt's own
    assert census.top("first_token", 1)[0][:2] == (0, 1)
    # the uniform head (layer 1 head 1) puts 1 / (i + 1) on each key, itself included
    uniform = mean_over_prompts(lambda i: 1 / (i + 1))
    assert census.self_attention[1, 1].item() == pytest.approx(uniform, 1e-6)
    entropy = mean_over_prompts(lambda i: math.log(i + 1))
    assert census.entropy[1, 1].item() == pytest.approx(entropy, 1e-5)
    assert census.sink_per_layer[0] == pytest.approx(census.first_token[0].mean().item())
    assert census.windows == [None, None] and census.window_use == [None, None]


def test_window_use_of_uniform_heads_is_one_half():
    """With a window of 3, a uniform query i >= 2 sees keys i-2, i-1, i: mean distance 1 of
    at most 2; query 1 sees keys 0, 1: 1/2 of 1. The full layer has no window use."""
    block = BlockConfig(width=8, num_heads=2, window=3, backend="eager")
    model = Decoder(DecoderConfig(vocab_size=V, num_layers=2, block=block, position="none",
                                  layer_types=("sliding", "full")))  # fmt: skip
    with torch.no_grad():
        for layer in model.blocks:
            layer.attn.q.weight.zero_()
            layer.attn.q.bias.zero_()
    census = census_of(model, prompts_without_repeats(2, 9), induction_ids(range(V), 1, 4, 0))
    assert census.windows == [3, None] and census.window_use[1] is None
    assert census.window_use[0].tolist() == pytest.approx([0.5, 0.5], abs=1e-6)
    assert census.to_dict()["scores"]["window_use"][1] is None
    assert [h[:2] for h in census.top("window_use", 5)] == [(0, 0), (0, 1)]


@pytest.mark.parametrize("backend", ["sdpa", "loop"])
def test_every_backend_gives_the_same_census(backend):
    """Weights come from records, so the backend that ran does not matter (GQA included)."""
    censuses = []
    for name in ("eager", backend):
        torch.manual_seed(0)
        block = BlockConfig(width=16, num_heads=4, num_kv_heads=2, backend=name)
        model = Decoder(DecoderConfig(vocab_size=V, num_layers=2, block=block, position="rotary"))
        censuses.append(
            census_of(model.eval(), [[1, 5, 2, 7, 3]], induction_ids(range(V), 2, 5, 0))
        )
    for name in ("previous_token", "induction", "first_token", "self", "entropy"):
        torch.testing.assert_close(censuses[1].scores(name), censuses[0].scores(name))


def test_an_encoder_decoder_counts_its_encoder():
    config = EncoderDecoderConfig(vocab_size=V, encoder_layers=2, decoder_layers=3,
                                  block=BlockConfig(width=16, num_heads=4))  # fmt: skip
    model = EncoderDecoder(config).eval()
    census = census_of(model, [[1, 2, 3, 4]], induction_ids(range(V), 2, 5, 0))
    assert census.previous_token.shape == (2, 4)
    direct = census_of(model.encoder, [[1, 2, 3, 4]], induction_ids(range(V), 2, 5, 0))
    assert torch.equal(census.entropy, direct.entropy)


def test_the_model_is_unchanged(minilm):
    model = planted_decoder()
    ids = torch.tensor([[1, 2, 3, 4]])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = model(ids).logits
    census_of(model, [[1, 2, 3]], induction_ids(range(V), 2, 5, 0))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model(ids).logits, out)
    before = {k: v.clone() for k, v in minilm.model.state_dict().items()}
    vectors = minilm.embed(["The bank of the river"])
    census = heads(minilm, prompts=["The bank of the river."], rows=1, length=8)
    assert all(torch.equal(before[k], v) for k, v in minilm.model.state_dict().items())
    assert torch.equal(minilm.embed(["The bank of the river"]), vectors)
    # an encoder is bidirectional, and still has a head that reads the token before
    assert census.top("previous_token", 1)[0][2] > 0.9


def test_smollm2_has_an_induction_head_and_reports_its_sinks(smollm2):
    census = heads(smollm2, prompts=["The cat sat on the mat by the door."], rows=2, length=12)
    induction = census.induction
    assert induction.shape == (30, 9)
    layer, head, best = census.top("induction", 1)[0]
    assert best > 0.5 and best > 10 * induction.median(), (layer, head, best)
    sinks = census.to_dict()["first_token_per_layer"]
    assert len(sinks) == 30 and all(0.0 <= s <= 1.0 for s in sinks)
    assert max(sinks) > 0.5, "SmolLM2's deeper layers park most weight on the first token"


def test_rollout_of_a_two_layer_toy_equals_the_hand_computation():
    W0 = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    W1 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.6, 0.4, 0.0]])
    # A = 0.5 W + 0.5 I:
    # A0 = [[1, 0, 0], [.25, .75, 0], [.1, .15, .75]], A1 = [[1, 0, 0], [0, 1, 0], [.3, .2, .5]]
    # rollout = A1 @ A0; its last row: .3 [1, 0, 0] + .2 [.25, .75, 0] + .5 [.1, .15, .75]
    expected = torch.tensor([[1.0, 0.0, 0.0], [0.25, 0.75, 0.0], [0.4, 0.225, 0.375]])
    result = rollout(torch.stack([W0, W1]))
    torch.testing.assert_close(result, expected.double(), atol=1e-7, rtol=0)
    assert not torch.allclose(rollout(torch.stack([W1, W0])), result), "the order matters"
    heads_of = torch.stack([torch.stack([W0, torch.eye(3)]), torch.stack([W1, W1])])
    averaged = torch.stack([(W0 + torch.eye(3)) / 2, W1])  # (L, H, T, T) averages its heads
    assert torch.allclose(rollout(heads_of), rollout(averaged))


def test_flow_of_a_two_layer_toy_equals_the_hand_computation():
    W = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    # A = [[1, 0], [.25, .75]] in both layers. From output token 1 to input token 0 the
    # paths are 1 -> 0 -> 0 (capacities .25, 1) and 1 -> 1 -> 0 (.75, .25): .25 + .25;
    # to input token 1 only 1 -> 1 -> 1 (.75, .75). Rollout's row is [.4375, .5625] instead.
    expected = torch.tensor([[1.0, 0.0], [0.5, 0.75]], dtype=torch.float64)
    torch.testing.assert_close(flow(torch.stack([W, W])), expected, atol=1e-12, rtol=0)
    assert rollout(torch.stack([W, W]))[1].tolist() == pytest.approx([0.4375, 0.5625])


def test_text_rollout_over_a_sentence(minilm):
    result = text_rollout(minilm, "The bank of the river")
    T = len(result.tokens)
    assert result.rollout.shape == result.flow.shape == (T, T)
    assert result.rollout.sum(-1).tolist() == pytest.approx([1.0] * T)
    assert (result.flow <= 1 + 1e-9).all() and (result.flow >= 0).all()
    assert set(result.to_dict()) == {"tokens", "rollout", "flow"}


def test_bad_input_is_one_line_value_error(minilm):
    long = " ".join(["river"] * (FLOW_MAX_TOKENS + 4))
    with pytest.raises(ValueError, match="flow computes 16 at most") as error:
        text_rollout(minilm, long)
    assert "\n" not in str(error.value)
    assert text_rollout(minilm, long, with_flow=False).flow is None
    with pytest.raises(ValueError, match="16 tokens at most"):
        flow(torch.rand(2, 17, 17))
    stand_in = types.SimpleNamespace(model=torch.nn.Linear(2, 2), source="linear")
    with pytest.raises(ValueError, match="census reads encoders, decoders .* linear is a Linear"):
        heads(stand_in)
    with pytest.raises(ValueError, match="unknown score 'nope'"):
        census_of(planted_decoder(), [[1, 2]], induction_ids(range(V), 1, 3, 0)).top("nope")
    with pytest.raises(ValueError, match="second half"):
        census_of(planted_decoder(), [[1, 2]], torch.tensor([[1, 2, 3, 4]]))
