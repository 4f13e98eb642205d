"""The logit lens and direct logit attribution: the terms add up to the model's own logit."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from qkv.inspect.lens import decoder_lens, lens
from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig
from variant_models import decoder, gemma2_like, tiny

TEXT = "The capital of France is"  # SmolLM2: 5 tokens, ' Paris' next


def random_decoder(**config) -> Decoder:
    """A tiny random decoder, every weight and bias drawn (a term on the wrong side shows)."""
    block = {"width": 32, "num_heads": 4, **config.pop("block", {})}
    cfg = DecoderConfig(vocab_size=40, num_layers=3, block=BlockConfig(**block), **config)
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0) * 0.5)
    return model


LLAMA = {
    "position": "rotary",
    "tie_embeddings": False,
    "block": {"num_kv_heads": 2, "mlp": "swiglu", "norm": "rmsnorm", "bias": False},
}
GPT2 = {"position": "learned", "lm_head_bias": True, "block": {"norm": "layernorm"}}
NEOX = {"position": "rotary", "block": {"norm": "layernorm", "parallel": True}}
GEMMA = {"position": "rotary", "head_scale": 0.7,
         "block": {"norm": "rmsnorm_plus1", "mlp": "geglu_tanh", "bias": False}}  # fmt: skip


def float64_copy(model: Decoder) -> Decoder:
    """A float64 copy, never the model itself: its forward is float64 throughout (norms
    included), so the identity can be checked to 1e-9."""
    return copy.deepcopy(model).double()


def check_sum(model: Decoder, ids: torch.Tensor, position: int = -1, token_id=None):
    """The terms plus the norm's remainder (computed from its shift and the head's bias) are
    the logit of the model's own float64 forward, to 1e-9."""
    found = decoder_lens(model, ids, position=position, token_id=token_id)
    a = found.attribution
    with torch.inference_mode():
        own = model(ids).logits[0, position, found.token_id].item()
    terms = a.embeddings + a.heads.sum().item() + a.attention_bias.sum().item() + a.mlps.sum()
    assert abs(terms + a.remainder_explicit - own) < 1e-9
    assert abs(a.remainder - a.remainder_explicit) < 1e-9
    assert a.logit == own
    return found


@pytest.mark.parametrize(
    "config", [LLAMA, GPT2, NEOX, GEMMA], ids=["llama", "gpt2", "neox", "gemma"]
)
def test_terms_add_up_to_the_logit_in_float64(config):
    model = float64_copy(random_decoder(**config))
    ids = torch.randint(0, 40, (1, 7), generator=torch.Generator().manual_seed(1))
    found = check_sum(model, ids)
    check_sum(model, ids, position=3, token_id=11)
    a = found.attribution
    assert a.heads.shape == (3, 4) and a.mlps.shape == a.attention_bias.shape == (3,)
    assert bool((a.heads != 0).all()) and bool((a.mlps != 0).all())
    has_shift = config is GPT2 or config is NEOX  # LayerNorm's shift, GPT2's head bias too
    assert (abs(a.remainder_explicit) > 1e-3) == has_shift
    assert bool((a.attention_bias != 0).all()) == has_shift


def test_each_term_is_its_sublayers_own_output():
    """The heads' terms are the attention sub-layer's output, the MLP's the MLP's: computed
    here by calling the block's own sub-layers (GPT-2-like, no rotary), read out through the
    final LayerNorm with its scale frozen on the final stream."""
    model = float64_copy(random_decoder(**GPT2))
    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    found = decoder_lens(model, ids, position=4, token_id=7)
    a = found.attribution
    with torch.inference_mode():
        out = model(ids, hidden_states=True)
        final = out.hidden_states[-1][0, 4]
        scale = (final.var(unbiased=False) + model.norm.eps).rsqrt()
        row = model.lm_head.weight[7]

        def read(c):  # (C,) through the frozen norm (centred, scaled, gained) and the head
            return float((model.norm.weight * (c - c.mean()) * scale) @ row)

        for layer, block in enumerate(model.blocks):
            x = out.hidden_states[layer]
            attended, _ = block.attn(block.attn_norm(x), causal=True)  # (1, T, C)
            mlp = block.mlp(block.mlp_norm(x + attended))
            expected = read(attended[0, 4])
            got = a.heads[layer].sum().item() + a.attention_bias[layer].item()
            assert abs(got - expected) < 1e-9
            assert abs(a.mlps[layer].item() - read(mlp[0, 4])) < 1e-9
        assert abs(a.embeddings - read(out.hidden_states[0][0, 4])) < 1e-9
        bias = float(model.norm.bias @ row + model.lm_head.bias[7])
    assert abs(a.remainder_explicit - bias) < 1e-12


def test_smollm2_terms_add_up_to_its_float64_logit(smollm2):
    ids = torch.tensor([smollm2.encode(TEXT).ids])
    found = check_sum(float64_copy(smollm2.model), ids)
    assert found.attribution.heads.shape == (30, 9)
    assert found.attribution.remainder_explicit == 0.0  # RMSNorm has no shift, no head bias


@pytest.fixture(scope="module")
def paris(smollm2):
    return lens(smollm2, TEXT)


def test_last_depth_is_the_models_own_prediction(smollm2, paris):
    ids = torch.tensor([smollm2.encode(TEXT).ids])
    with torch.inference_mode():
        out = smollm2.model(ids, hidden_states=True)
        own = out.logits[0, -1]
        # every depth through the model's own final norm and head, as the lens says
        streams = torch.stack([h[0, -1] for h in out.hidden_states])  # (L+1, C)
        through = smollm2.model.project(smollm2.model.norm(streams))
    assert torch.equal(paris.logits[-1], own)
    torch.testing.assert_close(paris.logits, through, rtol=1e-5, atol=1e-4)
    assert paris.layers == ["embeddings", *(f"layer {i}" for i in range(30))]
    assert paris.position == 4 and paris.tokens[-1] == "Ġis"
    assert paris.token == " Paris" and paris.token_id == int(own.argmax())
    assert paris.top_ids[-1] == own.topk(5).indices.tolist() and paris.rank[-1] == 0
    assert paris.rank[0] > 100, "the embeddings alone do not predict Paris"
    logprobs = own.double().log_softmax(-1)
    assert paris.logprob[-1] == pytest.approx(logprobs[paris.token_id].item(), abs=1e-9)
    for probs in paris.top_probs:
        assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-9
    a = paris.attribution
    assert a.logit == own[paris.token_id].item()
    assert abs(a.total - a.logit) < 1e-9 and abs(a.remainder) < 1e-4  # float32: rounding only


def test_a_token_given_as_text_and_a_position(smollm2, paris):
    asked = lens(smollm2, TEXT, token=" London", position=3, top=3)
    london = smollm2.tokenizer.encode(" London", add_special_tokens=False).ids[0]
    assert asked.token_id == london and asked.attribution.token_id == london
    assert asked.position == 3 and len(asked.top_ids[0]) == 3
    prefix = lens(smollm2, "The capital of France", token=london, top=3)  # causal: the same
    torch.testing.assert_close(asked.logits, prefix.logits, rtol=1e-4, atol=1e-4)


def test_to_dict_is_json(paris):
    data = json.loads(json.dumps(paris.to_dict()))
    assert data["token"] == " Paris" and data["position"] == 4 and len(data["top"]) == 31
    assert data["top"][-1][0] == {"id": paris.token_id, "token": " Paris",
                                  "prob": paris.top_probs[-1][0]}  # fmt: skip
    a = data["attribution"]
    assert len(a["heads"]) == 30 and len(a["heads"][0]) == 9 and len(a["mlps"]) == 30
    sizes = [abs(t["logit"]) for t in a["terms"]]
    assert sizes == sorted(sizes, reverse=True) and len(a["terms"]) == 1 + 30 * 10
    assert a["total"] == pytest.approx(a["logit"], abs=1e-9)


def test_refuses_an_encoder_by_name(minilm):
    with pytest.raises(ValueError, match="minilm is bert, not a decoder"):
        lens(minilm, "The bank of the river")


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (gemma2_like(), "sublayer_norm"),
        (decoder(logit_softcap=30.0), "soft-caps its logits"),
        (decoder(norm_position="post"), "post-norm"),
    ],
    ids=["sublayer-norm", "softcap", "post-norm"],
)
def test_refuses_what_is_not_a_sum_and_keeps_the_lens(config, why):
    model = tiny(config)
    with pytest.raises(ValueError, match=why):
        lens(model, "the bank of the river")
    alone = lens(model, "the bank of the river", attribute=False)
    assert alone.attribution is None and alone.rank[-1] == 0
    with torch.inference_mode():
        own = model.model(torch.tensor([model.encode("the bank of the river").ids])).logits
    assert torch.equal(alone.logits[-1], own[0, -1])


def test_bad_tokens_and_positions_are_one_line_errors(smollm2):
    with pytest.raises(ValueError, match=r"'Parisxyzzy' is not one token .*\['P"):
        lens(smollm2, TEXT, token="Parisxyzzy")
    with pytest.raises(ValueError, match="token id 99999 is outside the vocabulary"):
        lens(smollm2, TEXT, token=99999)
    with pytest.raises(ValueError, match=r"position 5 is out of range: the text has 5 tokens"):
        lens(smollm2, TEXT, position=5)
    with pytest.raises(ValueError, match="top must be"):
        lens(smollm2, TEXT, top=0)


def test_the_model_is_unchanged(smollm2):
    model = random_decoder(**LLAMA)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.inference_mode():
        logits = model(ids).logits
    decoder_lens(model, ids)
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, logits)
    ids = torch.tensor([smollm2.encode(TEXT).ids])

    def sums():  # one number per parameter: any change to a weight changes its sum
        return torch.stack([p.detach().sum() for p in smollm2.model.parameters()])

    before = sums()
    with torch.inference_mode():
        logits = smollm2.model(ids).logits
    lens(smollm2, TEXT)
    assert torch.equal(sums(), before)
    assert {p.dtype for p in smollm2.model.parameters()} == {torch.float32}
    with torch.inference_mode():
        assert torch.equal(smollm2.model(ids).logits, logits)


def test_refuses_packed_weights_by_name():
    model = random_decoder(**LLAMA)
    model.blocks[1].attn.out = torch.nn.Identity()  # stands for an Int4Linear: no matrix
    with pytest.raises(ValueError, match=r"packed \(int4\): load it without int4"):
        decoder_lens(model, torch.tensor([[1, 2, 3]]))
