"""Linear attention (the gated delta rule): the recurrent and chunked forms equal the loop, the
rule written out one token at a time in float64; the effective weights equal their definition
as a product of matrices; transformers' own torch forms (Qwen3.5's and Kimi's) agree; a hidden
pair is a write that query's memory never got; the memory carries over from one call to the
next; gradients agree; bad inputs are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention.linear import delta_rule, effective_row, effective_weights
from qkv.attention.loop_memory import remember


def _inputs(gen, B, H, T, Dk, Dv, per_channel, dtype=torch.float64):
    q = F.normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=gen, dtype=dtype)
    beta = torch.rand(B, H, T, generator=gen, dtype=dtype)
    shape = (B, H, T, Dk) if per_channel else (B, H, T)
    decay = -torch.rand(shape, generator=gen, dtype=dtype)  # fades between e^-1 and 1
    return q, k, v, beta, decay


@st.composite
def rules(draw):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    T, Dk, Dv = (
        draw(st.integers(1, 13)),
        draw(st.sampled_from([1, 3, 8])),
        draw(st.sampled_from([1, 5])),
    )
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q, k, v, beta, decay = _inputs(gen, B, H, T, Dk, Dv, draw(st.booleans()))
    state = (
        torch.randn(B, H, Dk, Dv, generator=gen, dtype=torch.float64)
        if draw(st.booleans())
        else None
    )
    mask = None
    if draw(st.booleans()):
        mask = (
            torch.rand(draw(st.sampled_from([(T, T), (B, H, T, T), (B, 1, 1, T)])), generator=gen)
            > 0.3
        )
    scale = draw(st.sampled_from([None, 0.7]))
    return (q, k, v), dict(beta=beta, decay=decay, state=state, mask=mask, scale=scale)


@settings(max_examples=60, deadline=None)
@given(rules(), st.sampled_from([1, 2, 5, 64]))
def test_the_recurrent_and_chunked_forms_equal_the_loop(rule, chunk_size):
    (q, k, v), options = rule
    want = delta_rule(q, k, v, form="loop", **options)
    for form in ("recurrent", "chunked", "auto"):
        got = delta_rule(q, k, v, form=form, chunk_size=chunk_size, **options)
        torch.testing.assert_close(got.out, want.out, atol=1e-10, rtol=0)
        if options["mask"] is None:
            torch.testing.assert_close(got.state, want.state, atol=1e-10, rtol=0)


@settings(max_examples=40, deadline=None)
@given(rules())
def test_effective_weights_are_the_product_of_the_writes_and_reproduce_the_output(rule):
    (q, k, v), options = rule
    options["state"] = None
    scale = options["scale"] or q.shape[-1] ** -0.5
    weights = effective_weights(q, k, **{n: options[n] for n in ("beta", "decay", "scale", "mask")})
    out = delta_rule(q, k, v, **options).out
    torch.testing.assert_close(weights @ v, out, atol=1e-10, rtol=0)
    # the definition: a_tj = beta_j k_j^T M_{j+1}^T ... M_t^T q_t scale, with
    # M_i = (I - beta_i k_i k_i^T) diag(g_i), the writes hidden from t taken out
    B, H, T, Dk = q.shape
    beta, fade = options["beta"], options["decay"].exp()
    if fade.dim() == 3:
        fade = fade[..., None].expand(B, H, T, Dk)
    mask = options["mask"]
    allowed = torch.ones(B, H, T, T, dtype=torch.bool) if mask is None else mask.expand(B, H, T, T)
    eye = torch.eye(Dk, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                strength = beta[b, h] * allowed[b, h, t]
                read = q[b, h, t] * scale
                for j in reversed(range(t + 1)):
                    a = strength[j] * k[b, h, j] @ read
                    assert abs(float(a - weights[b, h, t, j])) < 1e-10
                    M = (eye - strength[j] * torch.outer(k[b, h, j], k[b, h, j])) @ torch.diag(
                        fade[b, h, j]
                    )
                    read = M.T @ read
                assert bool((weights[b, h, t, t + 1 :] == 0).all())


def test_float32_effective_weights_reproduce_the_float32_output_to_1e_6():
    gen = torch.Generator().manual_seed(1)
    for per_channel in (False, True):
        q, k, v, beta, decay = _inputs(gen, 2, 3, 150, 16, 8, per_channel, torch.float32)
        out = delta_rule(q, k, v, beta=beta, decay=decay).out
        weights = effective_weights(q, k, beta=beta, decay=decay)
        assert weights.dtype == torch.float64 and out.dtype == torch.float32
        torch.testing.assert_close((weights @ v.double()).float(), out, atol=1e-6, rtol=0)


def test_transformers_torch_forms_agree_with_qkv():
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(2)
    for per_channel, theirs in (
        (False, torch_chunk_gated_delta_rule),
        (True, chunk_kimi_delta_attention),
    ):
        q, k, v, beta, decay = _inputs(gen, 1, 2, 100, 16, 8, per_channel, torch.float32)
        ours = delta_rule(q, k, v, beta=beta, decay=decay, form="chunked")
        out, state = theirs(*(t.transpose(1, 2) for t in (q, k, v)), g=decay.transpose(1, 2),
                            beta=beta.transpose(1, 2), output_final_state=True)  # fmt: skip
        torch.testing.assert_close(out.transpose(1, 2), ours.out, atol=1e-5, rtol=0)
        torch.testing.assert_close(state, ours.state, atol=1e-5, rtol=0)


def test_a_hidden_pair_is_a_write_that_query_never_read():
    gen = torch.Generator().manual_seed(3)
    q, k, v, beta, decay = _inputs(gen, 1, 2, 70, 8, 4, False)
    decay = decay * 0.02  # a slow fade, so that keys 10-12 are still in the memory at 40
    hide = torch.zeros(1, 2, 70, 70, dtype=torch.bool)
    hide[0, 1, 40:50, 10:13] = True  # head 1's queries 40-49 may not read keys 10-12
    got = delta_rule(q, k, v, beta=beta, decay=decay, mask=~hide, form="chunked").out
    unwritten = beta.clone()
    unwritten[0, 1, 10:13] = 0  # computed apart: a run where keys 10-12 never wrote in head 1
    without = delta_rule(q, k, v, beta=unwritten, decay=decay, form="recurrent").out
    plain = delta_rule(q, k, v, beta=beta, decay=decay, form="recurrent").out
    torch.testing.assert_close(got[0, 1, 40:50], without[0, 1, 40:50], atol=1e-12, rtol=0)
    torch.testing.assert_close(got[0, 1, 50:], plain[0, 1, 50:], atol=1e-12, rtol=0)
    torch.testing.assert_close(got[0, 0], plain[0, 0], atol=1e-12, rtol=0)
    assert (got[0, 1, 40:50] - plain[0, 1, 40:50]).abs().max() > 1e-3  # the hiding mattered
    weights = effective_weights(q, k, beta=beta, decay=decay, mask=~hide)
    assert bool((weights[0, 1, 40:50, 10:13] == 0).all())


def test_the_memory_carries_from_one_call_to_the_next():
    gen = torch.Generator().manual_seed(4)
    q, k, v, beta, decay = _inputs(gen, 2, 2, 90, 8, 4, True, torch.float32)
    whole = delta_rule(q, k, v, beta=beta, decay=decay)
    first = delta_rule(q[:, :, :70], k[:, :, :70], v[:, :, :70], beta=beta[:, :, :70],
                       decay=decay[:, :, :70])  # fmt: skip
    outs, state = [first.out], first.state
    for t in range(70, 90):  # then one token at a time, as decoding does
        now = slice(t, t + 1)
        step = delta_rule(q[:, :, now], k[:, :, now], v[:, :, now], beta=beta[:, :, now],
                          decay=decay[:, :, now], state=state)  # fmt: skip
        outs.append(step.out)
        state = step.state
    torch.testing.assert_close(torch.cat(outs, 2), whole.out, atol=1e-5, rtol=0)
    torch.testing.assert_close(state, whole.state, atol=1e-5, rtol=0)


def test_gradients_of_the_chunked_form_equal_the_loops():
    gen = torch.Generator().manual_seed(5)
    inputs = _inputs(gen, 1, 2, 11, 4, 3, True)
    grads = {}
    for form in ("loop", "chunked"):
        leaves = [t.clone().requires_grad_() for t in inputs]
        q, k, v, beta, decay = leaves
        out = delta_rule(q, k, v, beta=beta, decay=decay, form=form, chunk_size=4).out
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        grads[form] = [t.grad for t in leaves]
    for got, want in zip(grads["chunked"], grads["loop"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_remember_walks_back_what_each_key_gave_the_query():
    # one key, written in full: the memory holds v under k, and k's own query reads it back
    k = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    v = torch.tensor([[2.0, -1.0]], dtype=torch.float64)
    one = torch.ones(1, dtype=torch.float64)
    out, memory, steps, from_state = remember(k[0], k, v, one, one, [True])
    assert out.tolist() == [2.0, -1.0] and steps[0].effective_weight.item() == 1.0
    assert memory.tolist() == [[2.0, -1.0], [0.0, 0.0]] and from_state.tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(beta=torch.rand(1, 2, 4)), "beta must be"),
        (dict(decay=torch.rand(1, 1, 4, 3)), "decay"),
        (dict(mask=torch.ones(4, 4)), "must be boolean"),
        (dict(mask=torch.ones(3, 4, dtype=torch.bool)), "does not broadcast"),
        (dict(state=torch.zeros(1, 1, 2, 2)), "state"),
        (dict(form="softmax"), "forms are"),
        (dict(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_inputs_are_refused_by_name(change, message):
    q = k = torch.randn(1, 1, 4, 2)
    options = dict(beta=torch.rand(1, 1, 4), decay=-torch.rand(1, 1, 4)) | change
    with pytest.raises(ValueError, match=message):
        delta_rule(q, k, torch.randn(1, 1, 4, 3), **options)


def test_one_querys_row_walked_back_is_the_last_row_of_the_effective_weights():
    gen = torch.Generator().manual_seed(6)
    for per_channel in (False, True):
        q, k, _, beta, decay = _inputs(gen, 2, 3, 20, 8, 4, per_channel)
        weights = effective_weights(q, k, beta=beta, decay=decay, scale=0.3)
        row = effective_row(q[:, :, -1], k, beta=beta, decay=decay, scale=0.3)
        torch.testing.assert_close(row, weights[:, :, -1], atol=1e-12, rtol=0)


@pytest.mark.parametrize("strength", [1.0, 30.0])
def test_per_channel_fades_across_sub_chunks_equal_the_recurrence(strength):
    """A chunk longer than a sub-chunk pairs its tokens across sub-chunks as matrix products,
    the fade split at the later sub-chunk's start: exact in float64 even where fades are so
    strong that a fade from the chunk's start would underflow."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, beta, decay = _inputs(gen, 1, 2, 150, 8, 4, True)
    decay = decay * strength
    want = delta_rule(q, k, v, beta=beta, decay=decay, form="recurrent")
    for size in (64, 37):
        got = delta_rule(q, k, v, beta=beta, decay=decay, form="chunked", chunk_size=size)
        torch.testing.assert_close(got.out, want.out, atol=1e-10, rtol=0)
        torch.testing.assert_close(got.state, want.state, atol=1e-10, rtol=0)
