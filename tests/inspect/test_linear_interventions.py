"""hide, ablate, patch, lens and the census on linear layers (a running memory, the gated
delta rule): each checked against the same question asked another way, outside qkv's
interventions (a write strength forced to 0, an output matrix's columns zeroed, a read swapped
in by hand), so that a number could fail."""

from __future__ import annotations

import copy

import pytest
import torch

import qkv
from linear_models import linear_model
from qkv.inspect.census import text_rollout
from qkv.inspect.lens import _readout
from qkv.nn.edit import Edit
from qkv.viz.lines import census_lines
from variant_models import TEXT

BANK, DEEP = 1, 8  # token positions in TEXT
# the layer computes its rule in float32, and runs that resume after a prefix continue its
# memory in another order of additions (recurrent, not chunked): round-off of ~1e-6 on final
# vectors of size ~20, after the test model's large weights; the changes measured are > 1e-3
ATOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return linear_model()


def ids_of(model):
    return torch.tensor([model.encode(TEXT).ids])


def final_states(model, edits=None) -> torch.Tensor:
    with torch.no_grad():
        return model.model(ids_of(model), edits=edits).hidden[0]


def unwritten(model, layer: int, heads: list[int], positions: list[int]) -> torch.Tensor:
    """The final vectors with `positions` writing nothing into `heads`' memories in `layer`:
    their write strength forced to 0 (sigmoid(-inf)), not through an Edit."""

    def silenced(module, inputs, output):
        output = output.clone()
        for p in positions:
            output[:, p, heads] = float("-inf")
        return output

    handle = model.model.blocks[layer].attn.write.register_forward_hook(silenced)
    try:
        return final_states(model)
    finally:
        handle.remove()


def one_minus_cosine(a, b):
    return 1 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def test_hiding_a_key_is_not_writing_it_into_the_memory(model):
    hidden = qkv.hide(model, TEXT, "bank", layers=[0])
    expected = unwritten(model, 0, [0, 1], [BANK])
    torch.testing.assert_close(hidden.states, expected, atol=ATOL, rtol=0)
    assert (expected - hidden.clean_states).abs().max() > 1e-3  # the key did matter
    for head in (0, 1):  # each head's cell of the table: that head's memory alone
        alone = unwritten(model, 0, [head], [BANK])
        effect = one_minus_cosine(hidden.clean_states, alone).mean()
        assert float(hidden.effect[0, head]) == pytest.approx(float(effect), rel=1e-3, abs=1e-7)


def test_hiding_a_key_from_one_query_resumes_from_the_memory_before_the_key(model):
    # the runs start after the clean prefix, whose memory holds no hidden key; the same hide
    # over the whole text in one forward must agree
    hidden = qkv.hide(model, TEXT, "bank", query="deep", layers=[0, 1, 2])
    mask = torch.zeros(1, 2, 9, 9, dtype=torch.bool)
    mask[:, :, DEEP, BANK] = True
    whole = final_states(model, {n: Edit(hide=mask) for n in range(3)})
    torch.testing.assert_close(hidden.states, whole, atol=ATOL, rtol=0)
    assert (whole[DEEP] - hidden.clean_states[DEEP]).abs().max() > 1e-3
    torch.testing.assert_close(whole[:DEEP], hidden.clean_states[:DEEP], atol=ATOL, rtol=0)
    one = final_states(model, {1: Edit(hide=mask[:, [1]].expand(1, 2, 9, 9) & (
        torch.arange(2) == 1)[None, :, None, None])})  # fmt: skip
    effect = one_minus_cosine(hidden.clean_states[DEEP], one[DEEP])
    assert float(hidden.effect[1, 1]) == pytest.approx(float(effect), rel=1e-3, abs=1e-7)


def test_ablating_a_linear_head_zeroes_what_it_gives_the_output_projection(model):
    ablated = qkv.ablate(model, TEXT, [(1, 0)])
    silent = copy.deepcopy(model)
    with torch.no_grad():
        silent.model.blocks[1].attn.out.weight[:, :16] = 0.0  # head 0's 16 columns
    expected = final_states(silent)
    torch.testing.assert_close(ablated.states, expected, atol=ATOL, rtol=0)
    assert ablated.total > 1e-4


def test_patching_a_linear_heads_read_swaps_that_read_alone(model):
    corrupt = "the bank of the river was deep and wide"
    patched = qkv.patch(model, TEXT, corrupt, "diff: river, wide")
    attn = model.model.blocks[0].attn
    clean_read = model.attentions(TEXT).records[0].out  # (1, H, T, Dv)
    gated = attn.gated_read

    def swapped(out, x):  # the corrupt run, head 1's read replaced by the clean run's
        out = out.clone()
        out[:, 1] = clean_read[:, 1]
        return gated(out, x)

    attn.gated_read = swapped
    try:
        with torch.no_grad():
            logits = model.model(torch.tensor([model.encode(corrupt).ids])).logits[0, -1]
    finally:
        del attn.gated_read
    logprobs = logits.double().log_softmax(-1)
    river, wide = (model.tokenizer.token_to_id(w) for w in ("river", "wide"))
    expected = float(logprobs[river] - logprobs[wide])
    assert float(patched.heads[0, 1]) == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert abs(float(patched.heads[0, 1]) - patched.corrupt) > 1e-4


def test_the_lens_gives_each_linear_head_what_the_output_projection_reads(model):
    found = qkv.lens(model, TEXT, token="river")
    split = found.attribution
    assert abs(split.remainder) < 1e-4 * max(1.0, abs(split.logit))
    with torch.no_grad():
        out = model.model(ids_of(model), hidden_states=True)
        direction, _, _ = _readout(model.model, out.hidden_states[-1][0, -1].double(),
                                   split.token_id)  # fmt: skip
        for layer in (0, 1):
            block = model.model.blocks[layer]
            attended, _ = block.attn(block.attn_norm(out.hidden_states[layer]))
            direct = float(attended[0, -1].double() @ direction)
            assert float(split.heads[layer].sum()) == pytest.approx(direct, rel=1e-4, abs=1e-6)
            assert float(split.heads[layer].abs().max()) > 1e-3


def test_the_census_reads_shares_of_the_effective_weights_and_says_so(model):
    census = qkv.heads(model, prompts=[TEXT], rows=1, length=4)
    assert census.effective == [True, True, False]
    W = model.attentions(TEXT).records[0].weights()[0].double()  # (H, T, T), signed
    assert bool((W < 0).any())
    shares = W.abs() / W.abs().sum(-1, keepdim=True)
    previous = shares.diagonal(-1, -2, -1).mean(-1)  # queries 1..T-1
    torch.testing.assert_close(census.previous_token[0], previous, atol=1e-6, rtol=0)
    entropy = -(shares[:, 1:] * shares[:, 1:].log()).nan_to_num().sum(-1).mean(-1)
    torch.testing.assert_close(census.entropy[0], entropy, atol=1e-6, rtol=0)
    assert "layers 0, 1: effective weights (linear attention)" in census_lines(census)
    assert census.to_dict()["effective_weights"] == [True, True, False]
    with pytest.raises(ValueError, match="layer 0 keeps a running memory"):
        text_rollout(model, TEXT)


@pytest.mark.parametrize("fade", ["head", "channel"])
def test_generating_keeps_each_new_tokens_effective_weights_over_every_token(fade):
    """A linear layer's record while decoding holds the new token alone (the rest is in its
    memory); the rows kept must still be what one forward over the whole text gives."""
    model = linear_model(fade)
    seen = model.generate("the bank of the river", 5, record="all", temperature=1.0, seed=2)
    whole = model.model(torch.tensor([seen.ids[:-1]]), layers="all").records
    P = seen.prompt_length
    for j in range(1, seen.generated):
        row = seen.row(j)  # (L, H, P + j): the row of the query at P + j - 1
        for layer in range(3):
            want = whole[layer].weights()[0, :, P + j - 1, : P + j]
            torch.testing.assert_close(row[layer], want, atol=1e-5, rtol=0)
    assert (seen.row(seen.generated - 1)[0] < 0).any()  # signed: effective weights
