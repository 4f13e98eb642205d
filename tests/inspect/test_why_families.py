"""qkv.why's terms sum to the score on every family qkv loads (each family's tiny config, in
float64: 1e-9) and on every attention backend (float32: 1e-5), and what it cannot split it
refuses by name."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from qkv.attention import backend_names
from qkv.inspect.layer_heads import heads_per_layer
from qkv.inspect.why import cross_why, stack_why
from qkv.inspect.why_parts import tolerance_of
from qkv.io.build import with_backend
from qkv.models.stacks import self_attention_stack
from qkv.nn.delta import GatedDeltaNet

# the families' tiny configs live beside their round trips in tests/io, whose helpers import
# their neighbours by module name
sys.path.insert(0, str(Path(__file__).parents[1] / "io"))
from test_family_configs import FAMILY, LLAMA, ROUND_TRIPS

# what qkv.why refuses, and the words of its refusal
REFUSED = {
    "deepseek_v4": "DeepSeek-V4",
    "gemma4": "Gemma 4",
}
QUERY, KEY = 5, 4  # a pair every layer sees: one apart, in one chunk of Llama 4's


def _config(name: str):
    """The family's tiny config (Llama 4's round trip reads transformers' full-size defaults:
    its tiny model's config instead)."""
    if name == "llama4":
        from test_family_llama4 import TINY  # a module of tests/io, loaded for Llama 4 alone

        return FAMILY[name].config(TINY.to_dict())
    return ROUND_TRIPS[name][0]


def _model(name: str, config):
    assert config.vocab_size * config.block.width < 10**6, f"{name}'s config is not tiny"
    torch.manual_seed(0)
    model = FAMILY[name].model(config).double().eval()
    with torch.no_grad():  # larger weights than the init's, so each part and variant shows
        for p in model.parameters():
            p.mul_(4.0)
    return self_attention_stack(model, "qkv.why", name)


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_the_terms_sum_to_the_score_on_every_family(name):
    stack = _model(name, _config(name))
    ids = torch.randint(1, 50, (1, 7), generator=torch.Generator().manual_seed(1))
    split = 0
    for layer, heads in enumerate(heads_per_layer(stack)):
        if isinstance(stack.blocks[layer].attn, GatedDeltaNet):  # a memory: no score to split
            with pytest.raises(ValueError, match="is linear attention"):
                stack_why(stack, ids, QUERY, KEY, layer=layer, head=0)
            continue
        try:
            why = stack_why(stack, ids, QUERY, KEY, layer=layer, head=heads - 1, checks=1)
        except ValueError as refused:
            assert name in REFUSED, f"{name} layer {layer}: {refused}"
            assert re.search(REFUSED[name], str(refused))
            continue
        split += 1
        l2 = getattr(stack.blocks[layer].attn, "qk_norm", None) == "l2"  # float32 in the model
        assert why.total == pytest.approx(why.pre_cap, rel=tolerance_of(torch.float64, l2),
                                          abs=1e-9)  # fmt: skip
        assert why.terms.shape == (len(why.parts_q), len(why.parts_k))
        rest = why.score - (why.bias or 0.0)  # the pre-cap score, capped where the layer caps
        cap = why.softcap
        assert rest == pytest.approx(why.pre_cap if cap is None else
                                     cap * math.tanh(why.pre_cap / cap),
                                     rel=1e-9, abs=1e-9)  # fmt: skip
        assert all(c.whole == pytest.approx(c.value, rel=1e-7, abs=1e-9) for c in why.carried)
        if layer:
            assert any(p.startswith(f"L{layer - 1}.") for p in why.parts_q)
    assert split or name in REFUSED


def test_every_backend_gives_terms_that_sum_to_its_score():
    ids = torch.randint(1, 50, (1, 9), generator=torch.Generator().manual_seed(2))
    scores = {}
    for backend in backend_names():
        torch.manual_seed(0)
        model = FAMILY["llama"].model(with_backend(LLAMA, backend)).eval()
        why = stack_why(model, ids, 8, 3, layer=1, head=3, checks=0)
        assert why.total == pytest.approx(why.pre_cap, rel=1e-5, abs=1e-6), backend
        scores[backend] = why.score
    assert max(scores.values()) - min(scores.values()) < 1e-5


@pytest.mark.parametrize("name", ["bart", "marian", "t5"])
def test_cross_attention_terms_sum_to_the_score(name):
    """The query's parts are the decoder's (earlier cross-attention heads among them), the
    key's the encoder's, through its final norm."""
    torch.manual_seed(0)
    model = FAMILY[name].model(ROUND_TRIPS[name][0]).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    source = torch.randint(1, 50, (1, 6), generator=torch.Generator().manual_seed(3))
    target = torch.randint(1, 50, (1, 5), generator=torch.Generator().manual_seed(4))
    for layer in range(model.config.decoder_layers):
        why = cross_why(model, source, target, 4, 2, layer=layer, head=3, checks=2)
        assert why.total == pytest.approx(why.pre_cap, rel=1e-9, abs=1e-9)
        assert why.parts_k[0] == "enc.embedding" and why.parts_q[0] == "embedding"
        assert any(p.startswith("enc.L1.") for p in why.parts_k)  # the encoder's last layer
        assert {c.side for c in why.checks} == {"query", "key"}
        assert all(c.whole == pytest.approx(c.value, rel=1e-7, abs=1e-9) for c in why.carried)
