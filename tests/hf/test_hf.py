"""qkv inside transformers (`qkv.hf`): tiny random checkpoints built by transformers, run with
attn_implementation="qkv", beside the same checkpoint on "sdpa" (logits, generated tokens) and
on "eager" (output_attentions): families qkv loads itself and families it does not (Cohere,
Starcoder2, Granite), with padding, past a sliding window and with a soft-cap that bites; what
is refused by name; the memory of keeping some layers; qkv's inspection on such a model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as hf
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

import qkv
import qkv.hf
from qkv.attention import attention_weights
from qkv.viz.report import read_weights

SRC = Path(__file__).parents[2] / "src"
T = 13  # past every tiny model's sliding window (4)
SMALL = dict(vocab_size=99, hidden_size=48, intermediate_size=37, max_position_embeddings=64,
             initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=98)  # fmt: skip
TINY = {
    "llama": (hf.LlamaForCausalLM, hf.LlamaConfig(
        **SMALL, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2)),
    "mistral": (hf.MistralForCausalLM, hf.MistralConfig(
        **SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        sliding_window=4)),
    "gemma2": (hf.Gemma2ForCausalLM, hf.Gemma2Config(
        **SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=32, sliding_window=4, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0)),
    "cohere": (hf.CohereForCausalLM, hf.CohereConfig(  # not among qkv's own families
        **SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1)),
    "starcoder2": (hf.Starcoder2ForCausalLM, hf.Starcoder2Config(  # nor this, with a window
        **SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        sliding_window=4)),
    "granite": (hf.GraniteForCausalLM, hf.GraniteConfig(  # nor this, with its own scale
        **SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        attention_multiplier=0.3)),
    "bert": (hf.BertModel, hf.BertConfig(  # an encoder: no causal rule, padding on the right
        **SMALL, num_hidden_layers=2, num_attention_heads=4)),
}  # fmt: skip
# Gemma 2 computes a soft-cap, which torch's sdpa does not: transformers runs it eager only
REFERENCE = {"gemma2": "eager"}
WORDS = ["[UNK]", "the", "bank", "of", "river", "was", "wide", "and", "deep"]
TEXT = "the bank of the river was wide and deep"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> {implementation: model}, each family's one random checkpoint loaded three ways."""
    made = {}
    for name, (cls, config) in TINY.items():
        folder = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        cls(config).save_pretrained(folder)
        made[name] = {impl: cls.from_pretrained(folder, attn_implementation=impl).eval()
                      for impl in {"qkv", "eager", REFERENCE.get(name, "sdpa")}}  # fmt: skip
    return made


def batch(B: int = 2, left: bool = True):
    """Random ids (B, T) and a mask whose last row is padded by 5 (on the left for decoders)."""
    torch.manual_seed(1)
    ids = torch.randint(1, 99, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[-1, slice(0, 5) if left else slice(T - 5, T)] = 0
    return ids, mask


@pytest.mark.parametrize("name", list(TINY))
def test_logits_equal_sdpa_and_attentions_equal_eager_with_padding(built, name):
    ids, mask = batch(left=name != "bert")
    with torch.inference_mode():
        ours = built[name]["qkv"](ids, attention_mask=mask, output_attentions=True)
        peer = built[name][REFERENCE.get(name, "sdpa")](ids, attention_mask=mask)
        eager = built[name]["eager"](ids, attention_mask=mask, output_attentions=True)
    field = "last_hidden_state" if name == "bert" else "logits"
    # sdpa, as qkv, gives a query that sees no key zeros; eager a uniform row: the padding
    # positions' own outputs (no one's input) differ from eager's only
    shown = mask.bool() if name in REFERENCE else torch.ones_like(mask, dtype=torch.bool)
    torch.testing.assert_close(getattr(ours, field)[shown], getattr(peer, field)[shown],
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    assert len(ours.attentions) == len(eager.attentions) == 2
    for mine, theirs in zip(ours.attentions, eager.attentions, strict=True):
        assert mine.shape == theirs.shape == (2, TINY[name][1].num_attention_heads, T, T)
        torch.testing.assert_close(mine[0], theirs[0], atol=1e-6, rtol=0)
        seen = mask[1].bool()  # the padded row's real queries; its padding queries see no key
        torch.testing.assert_close(mine[1][:, seen], theirs[1][:, seen], atol=1e-6, rtol=0)
        if name != "bert":  # left padding: a query before the text sees no key, gets zeros
            assert mine[1][:, ~seen].abs().max() == 0
        assert mine[1][..., ~seen].abs().max() == 0  # no query puts weight on padding


@pytest.mark.parametrize("name", ["mistral", "gemma2", "starcoder2"])
def test_the_sliding_window_hides_far_keys_and_is_read_from_the_mask(built, name):
    ids, _ = batch(B=1)
    with torch.inference_mode(), qkv.hf.keep(built[name]["qkv"], records=True) as kept:
        ours = built[name]["qkv"](ids, output_attentions=True)
    with torch.inference_mode():
        eager = built[name]["eager"](ids, output_attentions=True)
    windowed = [layer for layer, r in kept.records.items() if r.window is not None]
    assert windowed == ([0] if name == "gemma2" else [0, 1])  # Gemma 2: every other layer
    for layer in windowed:
        record = kept.records[layer]
        assert (record.window, record.mask, record.causal) == (4, None, True)  # no mask made
        far = ours.attentions[layer][0, :, 4:, 0]  # key 0 is 4 or more tokens back
        assert far.abs().max() == 0 and eager.attentions[layer][0, :, 4:, 0].abs().max() == 0
        torch.testing.assert_close(ours.attentions[layer], eager.attentions[layer], atol=1e-6,
                                   rtol=0)  # fmt: skip


def test_the_soft_cap_bites_and_is_computed(built):
    """Gemma 2's cap of 2.0 changes these weights by far more than the tolerance: equal to
    eager's with it, not equal without it."""
    ids, _ = batch(B=1)
    model = built["gemma2"]["qkv"]
    with torch.inference_mode(), qkv.hf.keep(model, records=True) as kept:
        capped = model(ids, output_attentions=True).attentions[1]  # the global layer
        eager = built["gemma2"]["eager"](ids, output_attentions=True).attentions[1]
    torch.testing.assert_close(capped, eager, atol=1e-6, rtol=0)
    record = kept.records[1]
    assert record.softcap == 2.0 and record.backend == "eager"  # sdpa computes no cap
    uncapped = attention_weights(record.q, record.k, causal=True, scale=record.scale)
    assert (capped - uncapped).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "cohere", "starcoder2"])
def test_generate_with_the_kv_cache_gives_the_peers_tokens(built, name):
    ids, mask = batch()
    options = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    peer = built[name][REFERENCE.get(name, "sdpa")].generate(ids, **options)
    ours = built[name]["qkv"].generate(ids, **options)
    assert ours.shape == (2, T + 8)
    assert torch.equal(ours, peer)


def test_a_static_cache_s_empty_slots_are_hidden(built):
    """A static cache hands the prefill all its slots as keys, with no mask (sdpa's causal
    rule from the first key hides the empty ones): qkv drops them, and reports them as 0."""
    ids = batch(B=1)[0]
    options = dict(max_new_tokens=3, do_sample=False, cache_implementation="static",
                   output_attentions=True, return_dict_in_generate=True)  # fmt: skip
    ours = built["llama"]["qkv"].generate(ids, **options)
    assert torch.equal(ours.sequences, built["llama"]["sdpa"].generate(ids, **options).sequences)
    eager = built["llama"]["eager"].generate(ids, **options).attentions[0]  # the prefill's
    for mine, theirs in zip(ours.attentions[0], eager, strict=True):
        assert mine.shape == theirs.shape and mine.shape[-1] > T  # every slot of the cache
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


def test_dropout_in_training_is_eagers_with_the_same_random_draws(tmp_path):
    cls, config = hf.LlamaForCausalLM, hf.LlamaConfig(**SMALL, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5)  # fmt: skip
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    ids, _ = batch(B=1)
    found, trained = {}, {}
    for impl in ("qkv", "eager"):
        trained[impl] = cls.from_pretrained(tmp_path, attn_implementation=impl).train()
        torch.manual_seed(7)
        found[impl] = trained[impl](ids, output_attentions=True)
    torch.testing.assert_close(found["qkv"].logits, found["eager"].logits, atol=1e-5, rtol=1e-5)
    dropped = found["qkv"].attentions[0]
    assert (dropped == 0).float().mean() > 0.3  # the draws dropped about half of the weights
    torch.testing.assert_close(dropped, found["eager"].attentions[0], atol=1e-6, rtol=0)
    found["qkv"].logits.sum().backward()  # and it trains: gradients reach the projections
    assert trained["qkv"].model.layers[0].self_attn.q_proj.weight.grad.abs().max() > 0


def test_keep_returns_only_the_layers_and_heads_asked(built):
    ids, mask = batch()
    model = built["llama"]["qkv"]
    with torch.inference_mode():
        every = model(ids, attention_mask=mask, output_attentions=True).attentions
        with qkv.hf.keep(model, layers=[1], heads=[4, 0]) as kept:
            some = model(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(some) == 1 and list(kept.weights) == [1] and kept.records == {}
    assert some[0] is kept.weights[1] and some[0].shape == (2, 2, T, T)
    torch.testing.assert_close(some[0], every[1][:, [4, 0]], atol=0, rtol=0)
    with torch.inference_mode():  # the keep ended: every layer again
        assert len(model(ids, output_attentions=True).attentions) == 2


@pytest.mark.parametrize("name", ["gpt2", "gpt_bigcode"])
def test_a_family_that_drops_output_attentions_still_returns_and_keeps_them(tmp_path, name):
    """GPT-2 and GPTBigCode drop `output_attentions` before their attention's call (transformers
    collects the weights by hooks): qkv returned none, and `keep` kept nothing."""
    cls, config = {
        "gpt2": (hf.GPT2LMHeadModel, hf.GPT2Config),
        "gpt_bigcode": (hf.GPTBigCodeForCausalLM, hf.GPTBigCodeConfig),
    }[name]
    torch.manual_seed(0)
    cls(config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64)).save_pretrained(
        tmp_path
    )
    eager, ours = (cls.from_pretrained(tmp_path, attn_implementation=i).eval()
                   for i in ("eager", "qkv"))  # fmt: skip
    ids, mask = batch()
    with torch.inference_mode():
        want = eager(ids, attention_mask=mask, output_attentions=True).attentions
        got = ours(ids, attention_mask=mask, output_attentions=True).attentions
        with qkv.hf.keep(ours, layers=[0, 1], heads=[3]) as kept:
            ours(ids, attention_mask=mask, output_attentions=True)
    assert len(want) == len(got) == 2 and sorted(kept.weights) == [0, 1]
    real = mask.bool()[:, None, :, None]  # padded queries: qkv's zeros, eager's uniform rows
    for layer in range(2):
        torch.testing.assert_close(got[layer] * real, want[layer] * real, atol=1e-6, rtol=0)
        torch.testing.assert_close(kept.weights[layer], got[layer][:, [3]], atol=0, rtol=0)


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon"])
def test_a_family_with_its_own_attention_is_refused_at_load(tmp_path, name):
    """Bloom and MPT loaded on "qkv" ran their own ALiBi attention on a mask built for a kernel
    they never called: no causal rule (Bloom's token 0 put 29% of its weight on token 5).
    Falcon raised KeyError: 'qkv'."""
    cls, config = {
        "bloom": (hf.BloomForCausalLM, hf.BloomConfig(vocab_size=99, hidden_size=32, n_layer=2,
                                                      n_head=4)),
        "mpt": (hf.MptForCausalLM, hf.MptConfig(vocab_size=99, d_model=32, n_layers=2,
                                                n_heads=4)),
        "falcon": (hf.FalconForCausalLM, hf.FalconConfig(vocab_size=99, hidden_size=32,
                                                         num_hidden_layers=2,
                                                         num_attention_heads=4)),
    }[name]  # fmt: skip
    cls(config).save_pretrained(tmp_path)
    said = rf"refused: {cls.__name__} computes its attention in its own code"
    if name != "falcon":
        said += r" \(ALiBi position biases among them\)"
    with pytest.raises(ValueError, match=said):
        cls.from_pretrained(tmp_path, attn_implementation="qkv")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"layers": [2]}, r"layer 2 is out of range: LlamaForCausalLM has 2 layers \(0-1\)"),
        ({"heads": [6]}, r"head 6 is out of range: LlamaForCausalLM has 6 heads \(0-5\)"),
        ({"layers": []}, "no layer or no head asked for"),
    ],
)
def test_keep_refuses_what_the_model_does_not_have(built, options, message):
    with pytest.raises(ValueError, match=message), qkv.hf.keep(built["llama"]["qkv"], **options):
        pass


def test_one_keep_at_a_time(built):
    model = built["llama"]["qkv"]
    with qkv.hf.keep(model), pytest.raises(ValueError, match="already active"):  # noqa: SIM117
        with qkv.hf.keep(model):
            pass
    with qkv.hf.keep(model):  # the first one ended cleanly
        pass


def test_gpt_oss_sinks_are_computed_and_position_biases_refused_at_load_and_at_call(tmp_path):
    """gpt-oss's sinks (s_aux) are one more score in qkv's softmax: outputs and weights equal
    eager's, the weights of a query summing to 1 less its sink's share. T5's position bias is
    refused when the model is made (read from its modeling code) and by any call that passes
    one (the backstop)."""
    torch.manual_seed(0)
    config = hf.GptOssConfig(
        vocab_size=99, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
        num_experts_per_tok=1, sliding_window=4, max_position_embeddings=64)  # fmt: skip
    eager = hf.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in eager.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4) * 2)
    eager.save_pretrained(tmp_path / "oss")
    ours = hf.GptOssForCausalLM.from_pretrained(tmp_path / "oss", attn_implementation="qkv")
    ids = torch.randint(0, 99, (1, 9))
    with torch.no_grad():
        want = eager(ids, output_attentions=True)
        got = ours.eval()(ids, output_attentions=True)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
    for mine, theirs in zip(got.attentions, want.attentions, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
        assert bool((mine.sum(-1) < 0.999).all())  # every query gave its sink a share
    t5 = hf.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=1, num_heads=4)
    with pytest.raises(ValueError, match="T5Model's attention is passed a position bias added"):
        hf.T5Model._from_config(t5, attn_implementation="qkv")
    module = eager.model.layers[0].self_attn
    q = k = v = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"GptOssAttention's attention call passes a position"):
        qkv.hf.attention(module, q, k, v, None, position_bias=torch.zeros(1, 4, 3, 3))


def test_check_and_register_refuse_by_name(built):
    with pytest.raises(ValueError, match="runs attn_implementation='sdpa'; load it with"):
        qkv.hf.check(built["llama"]["sdpa"])
    qkv.hf.check(built["llama"]["qkv"])  # nothing to refuse
    qkv.hf.register()  # idempotent
    with pytest.raises(ValueError, match="registered with qkv backend 'auto'"):
        qkv.hf.register("qkv", backend="eager")
    with pytest.raises(ValueError, match="cannot contain 'flash'"):
        qkv.hf.register("qkv_flash", backend="eager")
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        qkv.hf.register("qkv-fast", backend="fast")
    module = built["llama"]["qkv"].model.layers[0].self_attn
    q = k = v = torch.zeros(1, 6, 3, 8)
    with pytest.raises(ValueError, match="call passes 'alibi', which qkv does not know"):
        qkv.hf.attention(module, q, k, v, None, alibi=torch.ones(1))


def test_a_float_mask_is_its_hidden_keys_and_a_bias_as_eager_adds_it(built):
    """A 4-D float mask (given by a user, not built by transformers for "qkv"): 0 where a query
    may see a key, the dtype's minimum or -inf where not, any other value a bias on the scores,
    as eager adds the mask to them."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    module = built["llama"]["qkv"].model.layers[0].self_attn
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.randn(2, 1, 5, 5)  # a bias...
    mask[0, 0, :, 3] = torch.finfo(torch.float32).min  # ...and hidden keys
    mask[1, 0, 2:, 0] = float("-inf")
    out, weights = qkv.hf.attention(module, q, k, v, mask, scaling=0.5, output_attentions=True)
    peer_out, peer_weights = eager_attention_forward(module, q, k, v, mask, scaling=0.5)
    torch.testing.assert_close(out, peer_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights, peer_weights, atol=1e-6, rtol=0)
    assert weights[0, :, :, 3].abs().max() == 0


def test_a_mask_changed_in_place_between_forwards_is_read_afresh(built):
    """The layers of one forward reuse their first layer's reading of the mask; the next
    forward's first layer reads it again, so a mask changed in place in between is seen (an
    inference tensor counts no versions that would tell)."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    layers = [layer.self_attn for layer in built["llama"]["qkv"].model.layers]
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 6, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with torch.inference_mode():
        mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].clone()
        for module in layers:  # one forward over the causal rule
            qkv.hf.attention(module, q, k, v, mask, output_attentions=True)
        mask[0, 0, 2:, 1] = False  # then key 1 hidden from queries 2 on
        for module in layers:
            _, weights = qkv.hf.attention(module, q, k, v, mask, output_attentions=True)
            float_mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
            _, peer = eager_attention_forward(module, q, k, v, float_mask, scaling=8**-0.5)
            torch.testing.assert_close(weights, peer, atol=1e-6, rtol=0)
            assert weights[0, :, 2:, 1].abs().max() == 0


def test_a_mask_that_is_the_causal_rule_and_window_becomes_them():
    rule = torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)
    padded = rule.expand(2, 1, 6, 6).clone()
    padded[1, :, :, 0] = False
    assert qkv.hf.backend.qkv_mask(rule.expand(2, 1, 6, 6), True, 3, 6, 6) == (None, True, 3, None)
    assert qkv.hf.backend.qkv_mask(rule[None, None], True, 4, 6, 6)[0] is not None  # not 4
    found, causal, window, bias = qkv.hf.backend.qkv_mask(padded, True, 3, 6, 6)
    assert found is padded and (causal, window, bias) == (False, None, None)
    floats = torch.zeros(1, 1, 6, 6).masked_fill(~rule, float("-inf"))
    assert qkv.hf.backend.qkv_mask(floats, True, 3, 6, 6) == (None, True, 3, None)
    with pytest.raises(ValueError, match=r"takes a 4-D \(B, 1, Tq, Tk\) mask"):
        qkv.hf.backend.qkv_mask(rule, True, 3, 6, 6)


def test_the_flash_kernel_s_lse_gives_the_weights(tmp_path):
    """A name registered with backend="flash" (Triton's CPU interpreter here) runs the kernel
    and recomputes the weights from its log-sum-exp, equal to eager's."""
    qkv.hf.register("qkv-kernel", backend="flash")
    cls, config = TINY["llama"]
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    ours = cls.from_pretrained(tmp_path, attn_implementation="qkv-kernel").eval()
    eager = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = batch(B=1)[0][:, :6]
    with torch.inference_mode(), qkv.hf.keep(ours, layers=[0], records=True) as kept:
        mine = ours(ids, output_attentions=True)
    with torch.inference_mode():
        theirs = eager(ids, output_attentions=True)
    assert kept.records[0].backend == "flash" and kept.records[0].lse is not None
    torch.testing.assert_close(mine.attentions[0], theirs.attentions[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(mine.logits, theirs.logits, atol=1e-5, rtol=1e-5)


MEMORY = """
import json, sys, torch, transformers as hf
import qkv.hf
torch.manual_seed(0)
config = hf.LlamaConfig(vocab_size=99, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=4096)
ids = torch.randint(0, 99, (1, 2048))
peaks, kept = {}, {}


def peak_mb():  # this process's peak resident memory: VmHWM, since ru_maxrss would count
    # the pytest process this one was forked from (Linux carries it over an exec)
    with open("/proc/self/status") as status:
        found = next(line for line in status if line.startswith("VmHWM:"))
    return int(found.split()[1]) / 1024  # MB


for impl in ("qkv", "eager"):  # qkv first: a process's peak only grows
    model = hf.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(impl)
    with torch.inference_mode(), qkv.hf.keep(model, layers=[3], heads=[1]) if impl == "qkv" \
            else torch.inference_mode():
        attentions = model.model(ids, output_attentions=True).attentions
    peaks[impl] = peak_mb()
    kept[impl] = sum(a.numel() * a.element_size() for a in attentions) / 2**20
    del attentions, model
print(json.dumps({"peak_mb": peaks, "kept_mb": kept}))
"""


def test_keeping_some_layers_of_2048_tokens_peaks_below_eager():
    """Eager makes and returns every layer's (4, 2048, 2048) weights, 64 MB each; qkv asked
    for one head of one layer makes 16 MB of weights, the rest on sdpa's fused kernel. Both
    run in one fresh process, qkv first, so the process's peak resident memory after each is
    that side's own peak (it can only grow)."""
    result = subprocess.run([sys.executable, "-c", MEMORY], capture_output=True, text=True,
                            timeout=300, env={"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "2",
                                              "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["kept_mb"] == {"qkv": 16.0, "eager": 6 * 64.0}
    peak = found["peak_mb"]
    assert peak["eager"] > peak["qkv"] + 250, peak  # eager holds 384 MB of weights at its end


# ---------------------------------------------------------------- qkv's inspection on it


def save_with_words(name: str, folder: Path) -> Path:
    """TINY[name] with a word-level tokenizer of WORDS, saved by transformers."""
    cls, config = TINY[name]
    torch.manual_seed(0)
    cls(config).save_pretrained(folder)
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer: both qkv and transformers load it."""
    return save_with_words("llama", tmp_path_factory.mktemp("llama-words"))


@pytest.fixture(scope="module")
def both(llama_folder):
    """(qkv's own load, transformers' load on qkv's attention as an Inspected)."""
    model = hf.LlamaForCausalLM.from_pretrained(llama_folder, attn_implementation="qkv")
    tokenizer = hf.AutoTokenizer.from_pretrained(llama_folder)
    return qkv.load(llama_folder), qkv.hf.inspect(model, tokenizer, source="tiny")


def test_attentions_of_a_transformers_model_are_qkvs_own(both):
    ours, theirs = both
    mine, seen = ours.attentions(TEXT, layers=[1], heads=[0, 5]), theirs.attentions(
        TEXT, layers=[1], heads=[0, 5])  # fmt: skip
    assert type(seen) is type(mine) and seen.tokens == mine.tokens == TEXT.split()
    assert seen.layers == [1] and seen.causal and seen.scale == pytest.approx(mine.scale)
    assert seen.weights.shape == (1, 2, 9, 9)
    torch.testing.assert_close(seen.weights, mine.weights, atol=1e-6, rtol=0)
    assert seen.encoded.find("river") == (4, 5)
    # each token's text as the tokenizer's decoder writes it, as qkv's own tokenizer gives it
    assert seen.encoded.pieces == mine.encoded.pieces == TEXT.split()
    assert "qkv attention page" in seen._repr_html_()  # the notebook's view of it
    # the weights option is taken, and refused, as qkv's own attentions take it
    assert torch.equal(theirs.attentions(TEXT, layers=[1], weights=False).weights[:, [0, 5]],
                       theirs.attentions(TEXT, layers=[1]).weights[:, [0, 5]])  # fmt: skip
    with pytest.raises(ValueError, match=r"weights must be True, False or None .* not 1"):
        theirs.attentions(TEXT, weights=1)


def test_trace_of_a_transformers_model_is_qkvs_own(both):
    ours, theirs = both
    mine, found = qkv.trace(ours, TEXT, "river", "bank", layer=1, head=3), theirs.trace(
        TEXT, "river", "bank", layer=1, head=3)  # fmt: skip
    assert (found.query_index, found.key_index, found.kv_head) == (4, 1, 1)
    for name in ("query_vector", "key_vector", "weights", "value_vector", "contextualized",
                 "model_output"):  # fmt: skip
        # float32's rounding apart (1.07e-6 measured on an AVX2 EPYC, where torch's kernels
        # sum in another order than on AVX-512)
        torch.testing.assert_close(getattr(found, name), getattr(mine, name), atol=1e-5, rtol=0)
    assert [c.token for c in found.contributions] == TEXT.split()
    torch.testing.assert_close(torch.tensor([c.size for c in found.contributions]),
                               torch.tensor([c.size for c in mine.contributions]))  # fmt: skip
    # the walk is the model's own computation: the sum of the steps is its output
    torch.testing.assert_close(found.contextualized, found.model_output, atol=1e-5, rtol=0)
    chosen = qkv.trace(theirs, TEXT, "river", "bank")  # the head where river looks most at bank
    assert chosen.weight == pytest.approx(float(theirs.attentions(TEXT).weights[:, :, 4, 1].max()))


def test_the_page_of_a_transformers_model(both, tmp_path):
    ours, theirs = both
    path = theirs.write_page(TEXT, tmp_path / "page.html")
    weights, tokens = read_weights(path.read_text())
    assert tokens == TEXT.split() and weights.shape == (2, 6, 9, 9)
    expected = ours.attentions(TEXT).weights.numpy()
    assert abs(weights - expected).max() < 1e-3  # the page packs its weights to 3 digits
    assert '"vectors"' in path.read_text()  # a clicked pair's steps are redone on the page


def test_an_encoder_is_inspected_and_what_a_trace_cannot_find_is_refused(tmp_path):
    folder = save_with_words("bert", tmp_path / "bert")
    model = hf.BertModel.from_pretrained(folder, attn_implementation="qkv")
    seen = qkv.hf.inspect(model, hf.AutoTokenizer.from_pretrained(folder))
    att = seen.attentions(TEXT)
    assert not att.causal and att.weights.shape == (2, 4, 9, 9)
    eager = hf.BertModel.from_pretrained(folder, attn_implementation="eager")
    with torch.inference_mode():
        ids = torch.tensor([att.encoded.ids])
        expected = torch.cat(eager(ids, output_attentions=True).attentions)  # (L, H, T, T)
    torch.testing.assert_close(att.weights, expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="BertSelfAttention holds none of o_proj, out_proj"):
        seen.trace(TEXT, "river", "bank", layer=0, head=0)
    with pytest.raises(ValueError, match="in training mode"):
        qkv.hf.inspect(model.train(), seen.tokenizer)


def test_qkv_show_draws_a_family_qkv_does_not_implement(tmp_path):
    folder = save_with_words("cohere", tmp_path / "cohere")
    out = tmp_path / "page.html"
    show = [sys.executable, "-m", "qkv.cli", "show", TEXT, "--model", str(folder), "--out"]
    result = subprocess.run([*show, str(out), "--transformers"], capture_output=True,
                            text=True, timeout=120, env={"PYTHONPATH": str(SRC)})  # fmt: skip
    assert result.returncode == 0, result.stderr
    weights, tokens = read_weights(out.read_text())
    assert tokens == TEXT.split() and weights.shape == (2, 4, 9, 9)
    model = hf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    with torch.inference_mode():
        ids = hf.AutoTokenizer.from_pretrained(folder)(TEXT, return_tensors="pt").input_ids
        eager = torch.cat(model(ids, output_attentions=True).attentions)  # (L, H, T, T)
    assert abs(weights - eager.numpy()).max() < 1e-3  # the page packs its weights to 3 digits
    refused = subprocess.run([*show, str(tmp_path / "no.html"), "--transformers", "--backend",
                              "eager"], capture_output=True, text=True, timeout=120,
                             env={"PYTHONPATH": str(SRC)})  # fmt: skip
    assert refused.returncode == 2 and "--backend chooses the backend" in refused.stderr
    assert not (tmp_path / "no.html").exists()


def test_importing_qkv_does_not_import_transformers():
    code = "import sys, qkv; print('transformers' in sys.modules, 'qkv.hf' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env={"PYTHONPATH": str(SRC)})  # fmt: skip
    assert result.stdout.split() == ["False", "False"], result.stderr
