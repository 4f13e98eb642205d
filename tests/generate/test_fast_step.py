"""FastStep, the few-operations decoding step, against the trusted paths: every step's output
equals a full forward pass over the whole sequence without a cache, for each kind of block
it takes; greedy decoding gives Decoder.forward's tokens; what it cannot run is refused by
name and decoded by Decoder.forward instead."""

from __future__ import annotations

import pytest
import torch

from qkv.generate import Sampling, decode, decode_steps
from qkv.generate.fast_step import FastStep, _norm_of, fast_step_refusal
from qkv.models import Decoder, DecoderConfig, EncoderDecoder, EncoderDecoderConfig
from qkv.models.config import mask_positions
from qkv.nn import BlockConfig
from qkv.nn.norms import RMSNorm

VOCAB = 40
CPU = torch.device("cpu")


def config(position="rotary", **block) -> DecoderConfig:
    stack = ("rope_dims", "layer_types", "local_rope_base", "rope_layers", "embed_scale_rounded")
    extra = {k: block.pop(k) for k in stack if k in block}
    return DecoderConfig(vocab_size=VOCAB, num_layers=2, position=position, **extra,
                         block=BlockConfig(**{"width": 32, "num_heads": 4, **block}))  # fmt: skip


KINDS = {
    "llama": config(num_kv_heads=2, mlp="swiglu", norm="rmsnorm", bias=False),
    "qwen2": config(num_kv_heads=2, mlp="swiglu", norm="rmsnorm", bias=False, qkv_bias=True),
    "gpt2": config("learned", fused_qkv=True, mlp="gelu"),
    "neox": config(parallel=True, rope_dims=4, mlp="gelu"),
    "gemma3": config(
        num_kv_heads=1,
        head_dim=16,
        norm="rmsnorm_plus1",
        sublayer_norm=True,
        qk_norm="head",
        mlp="geglu_tanh",
        bias=False,
        window=3,
        layer_types=("sliding", "full"),
        local_rope_base=10.0,
        embed_scale_rounded=True,
    ),
    "olmo2": config(
        norm="rmsnorm",
        norm_position="none",
        sublayer_norm=True,
        qk_norm="full",
        mlp="swiglu",
        bias=False,
    ),
    "smollm3": config(
        num_kv_heads=2, mlp="swiglu", norm="rmsnorm", bias=False, rope_layers=(True, False)
    ),
}


def built(cfg: DecoderConfig, dtype=torch.float64) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(cfg).to(dtype).eval()
    with torch.no_grad():  # larger weights than the init's, so that every part shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_each_step_equals_a_full_forward_pass(kind):
    """Left-padded prompts of two rows, then 7 fed-back tokens (more than the window):
    every step's output equals the final norm's output at that position of one forward pass
    over the whole sequence, with no cache."""
    model = built(KINDS[kind])
    assert fast_step_refusal(model, CPU) is None
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (2, 5), generator=gen)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.inference_mode():
        cache = model.new_cache()
        model(ids, attention_mask=mask, cache=cache, logits=False)
        step = FastStep(model, cache, capacity=12, attention_mask=mask)
        for _ in range(7):
            token = torch.randint(VOCAB, (2,), generator=gen)
            ids = torch.cat([ids, token[:, None]], 1)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            got = step(token, mask_positions(mask, 1))
            want = model(ids, attention_mask=mask, logits=False).hidden[:, -1]
            torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)
        with pytest.raises(ValueError, match="capacity"):
            step(token)  # 12 tokens cached: no room for another


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_decoding_gives_forwards_tokens_and_logits(kind, monkeypatch):
    """float32, as generation runs by default: FastStep's tokens are Decoder.forward's, and
    its logits agree to float32 rounding on every step."""
    model = built(KINDS[kind], torch.float32)
    ids = torch.randint(VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    logits = {}
    for name, refusal in (("fast", decode.fast_step_refusal), ("forward", lambda *a: "off")):
        monkeypatch.setattr(decode, "fast_step_refusal", refusal)
        seen = []
        monkeypatch.setattr(Sampling, "pick", lambda self, x, g, seen=seen: seen.append(x)
                            or x.argmax(-1))  # fmt: skip
        tokens = [int(t) for t in decode_steps(model, ids, None, Sampling(), 10)]
        logits[name] = (tokens, torch.cat(seen))
    assert logits["fast"][0] == logits["forward"][0]
    torch.testing.assert_close(logits["fast"][1], logits["forward"][1], rtol=1e-5, atol=1e-5)


def test_the_prompts_token_comes_before_the_steps_copies(monkeypatch):
    """The prompt's token is picked from model(ids).logits' own arithmetic and yielded before
    FastStep and its packed head are made (what a stream waits for before its first token);
    a one-token generation never makes them."""
    model = built(KINDS["llama"], torch.float32)
    ids = torch.randint(VOCAB, (2, 5), generator=torch.Generator().manual_seed(5))
    made = []
    monkeypatch.setattr(decode, "head_of", lambda *a, real=decode.head_of: made.append("head")
                        or real(*a))  # fmt: skip
    monkeypatch.setattr(decode, "FastStep", lambda *a, real=FastStep: made.append("step")
                        or real(*a))  # fmt: skip
    seen = []
    monkeypatch.setattr(Sampling, "pick", lambda self, x, g: seen.append(x) or x.argmax(-1))
    steps = decode_steps(model, ids, None, Sampling(), 3)
    first = next(steps)
    assert made == []
    with torch.inference_mode():  # the same product, of 2 rows where forward's has 10
        torch.testing.assert_close(seen[0], model(ids).logits[:, -1], rtol=1e-6, atol=1e-6)
    assert torch.equal(first, seen[0].argmax(-1))
    assert len(list(steps)) == 2 and sorted(made) == ["head", "step"]
    made.clear()
    assert len(list(decode_steps(model, ids, None, Sampling(), 1))) == 1 and made == []
    assert list(decode_steps(model, ids, None, Sampling(), 0)) == []


def test_a_float32_rms_norm_is_the_modules_bit_for_bit():
    torch.manual_seed(3)
    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    for shape in [(1, 1, 48), (3, 7, 48)]:
        x = torch.randn(shape) * 5
        assert torch.equal(_norm_of(norm)(x), norm(x))


def test_what_it_cannot_run_is_refused_by_name_and_decoded_by_forward():
    capped = built(config(softcap=5.0))
    assert "soft-caps" in fast_step_refusal(capped, CPU)
    post = built(config(norm_position="post", mlp="gelu"))
    assert "post-norm" in fast_step_refusal(post, CPU)
    loop = built(config(backend="loop"))
    assert "'loop' backend" in fast_step_refusal(loop, CPU)
    training = built(KINDS["llama"]).train()
    assert "training" in fast_step_refusal(training, CPU)
    assert "CPU" in fast_step_refusal(built(KINDS["llama"]), torch.device("meta"))
    pair = EncoderDecoderConfig(vocab_size=VOCAB, encoder_layers=1, decoder_layers=1,
                                block=BlockConfig(width=16, num_heads=2))  # fmt: skip
    seq2seq = EncoderDecoder(pair)
    assert "cross-attention" in fast_step_refusal(seq2seq.decoder, CPU)
    # a refused model still decodes, through Decoder.forward
    ids = torch.tensor([[1, 2, 3]])
    tokens = [int(t) for t in decode_steps(capped, ids, None, Sampling(), 3)]
    with torch.inference_mode():
        first = capped(ids).logits[0, -1].argmax()
    assert tokens[0] == int(first) and len(tokens) == 3


def test_each_generation_reads_the_weights_as_they_are_now(monkeypatch):
    """float32 matrices are copied into oneDNN's layout for each generation, never kept past
    it: a write torch counts nowhere (through .data) is seen by the next generation."""
    model = built(KINDS["llama"], torch.float32)
    ids = torch.randint(VOCAB, (1, 4), generator=torch.Generator().manual_seed(4))
    before = [int(t) for t in decode_steps(model, ids, None, Sampling(), 6)]
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.down.weight.data.copy_(torch.randn_like(block.mlp.down.weight) * 3)
    after = [int(t) for t in decode_steps(model, ids, None, Sampling(), 6)]
    monkeypatch.setattr(decode, "fast_step_refusal", lambda *a: "off")
    assert after == [int(t) for t in decode_steps(model, ids, None, Sampling(), 6)]
    assert after != before  # the write changed the continuation
