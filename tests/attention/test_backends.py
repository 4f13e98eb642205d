"""Every backend against `loop`, the article's literal algorithm, on fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import (
    BACKENDS,
    Backend,
    attend,
    attention_weights,
    backend_names,
    explain_choice,
    loop,
    register_backend,
    steps,
)
from qkv.attention import eager as eager_backend
from qkv.attention.inputs import check_inputs

FAST = ["eager", "sdpa"]
# Absolute tolerance, relative to the largest value entry, for an output in each dtype.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@st.composite
def attention_inputs(draw, dtypes=tuple(TOLERANCE)):
    """q, k, v, mask and causal of random sizes, with some queries that see no key."""
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.integers(1, 3))
    Tq, Tk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    D = draw(st.sampled_from([1, 3, 8, 16]))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, Tk, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, Tk, D, generator=gen).to(dtype)
    mask_shape = draw(
        st.sampled_from([None, (B, 1, 1, Tk), (B, H, Tq, Tk), (Tq, Tk), (1, H, 1, Tk)])
    )
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=gen) > draw(st.sampled_from([0.2, 0.6]))
        if draw(st.booleans()):  # hide every key from some query
            mask[..., 0, :] = False
    causal = draw(st.booleans())
    scale = draw(st.sampled_from([None, 0.3]))
    return q, k, v, mask, causal, scale


def _tolerance(v: torch.Tensor) -> float:
    return TOLERANCE[v.dtype] * max(1.0, v.abs().max().item())


def _allowed(q, k, mask, causal) -> torch.Tensor:
    """(B, H, Tq, Tk) True where a query may see a key, built independently of qkv's code."""
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    allowed = torch.ones(Tq, Tk, dtype=torch.bool)
    if causal:  # query i sees key j when j <= i + Tk - Tq
        allowed = allowed & (torch.arange(Tk)[None, :] <= torch.arange(Tq)[:, None] + Tk - Tq)
    if mask is not None:
        allowed = allowed & mask
    return allowed.expand(B, H, Tq, Tk)


def _no_key_visible(q, k, mask, causal) -> torch.Tensor:
    """(B, H, Tq) True where a query may see no key at all."""
    return ~_allowed(q, k, mask, causal).any(-1)


@pytest.mark.parametrize("backend", FAST)
@settings(max_examples=60, deadline=None)
@given(inputs=attention_inputs())
def test_forward_matches_loop(backend, inputs):
    q, k, v, mask, causal, scale = inputs
    expected = loop.attend(q, k, v, mask=mask, causal=causal, scale=scale)
    out = attend(q, k, v, mask=mask, causal=causal, scale=scale, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected.double(), atol=_tolerance(v), rtol=0)
    blind = _no_key_visible(q, k, mask, causal)
    assert (out[blind] == 0).all(), "a query that sees no key must get exact zeros"


@pytest.mark.parametrize("backend", FAST)
@settings(max_examples=30, deadline=None)
@given(inputs=attention_inputs(dtypes=(torch.float32,)))
def test_gradients_match_float64_autograd_of_loop(backend, inputs):
    q, k, v, mask, causal, scale = inputs
    grad_out = torch.randn(q.shape)

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, mask=mask, causal=causal, scale=scale)
        loss = (out * grad_out.to(dtype)).sum()
        # a blind query's output does not depend on q at all in `loop`: count that as 0
        return torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)

    expected = grads(loop.attend, torch.float64)
    actual = grads(lambda *a, **kw: attend(*a, **kw, backend=backend), torch.float32)
    for name, got, want in zip("qkv", actual, expected, strict=True):
        assert got.isfinite().all(), f"d{name} has NaN or inf"
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4, msg=f"d{name}")
    blind = _no_key_visible(q, k, mask, causal)
    assert (actual[0][blind] == 0).all(), "a query that sees no key gets no gradient"


@settings(max_examples=30, deadline=None)
@given(inputs=attention_inputs(dtypes=(torch.float64, torch.float32)))
def test_eager_weights_match_the_loop_steps(inputs):
    q, k, v, mask, causal, scale = inputs
    out, weights = eager_backend.attend(
        q, k, v, mask=mask, causal=causal, scale=scale, return_weights=True
    )
    traces = steps(q, k, v, mask=mask, causal=causal, scale=scale)
    traced = torch.stack([t.weights for t in traces])
    contextualized = torch.stack([t.contextualized for t in traces]).view(q.shape)
    torch.testing.assert_close(out.double(), contextualized, atol=1e-5, rtol=0)
    torch.testing.assert_close(weights.double().flatten(0, 2), traced, atol=1e-6, rtol=0)
    recomputed = attention_weights(q, k, mask=mask, causal=causal, scale=scale)
    assert torch.equal(recomputed, weights)
    hidden = ~_allowed(q, k, mask, causal)
    assert (weights[hidden] == 0).all(), "a hidden key gets exactly zero weight"
    sums = weights.sum(-1)
    blind = _no_key_visible(q, k, mask, causal)
    torch.testing.assert_close(sums, (~blind).to(sums.dtype))


def test_steps_follow_the_article_step_by_step():
    torch.manual_seed(1)
    B, H, Hkv, T, D = 1, 4, 2, 5, 8
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    traces = steps(q, k, v)
    assert len(traces) == B * H * T
    one = traces[3 * T + 2]  # batch 0, head 3 (reads key head 1), query 2
    assert (one.batch, one.head, one.query_index) == (0, 3, 2)
    assert [p.key_index for p in one.pairs] == list(range(T)), "every key, the word itself too"
    for p in one.pairs:
        assert torch.equal(p.key_vector, k[0, 1, p.key_index].double())
        assert math.isclose(p.attention_scalar.item(), (one.query_vector @ p.key_vector).item())
        assert math.isclose(p.scaled_scalar.item(), p.attention_scalar.item() / math.sqrt(D))
        assert torch.equal(p.value_vector, v[0, 1, p.key_index].double())
        torch.testing.assert_close(p.scaled_value_vector, p.normalized_weight * p.value_vector)
    assert math.isclose(one.weights.sum().item(), 1.0)
    total = sum(p.scaled_value_vector for p in one.pairs)
    torch.testing.assert_close(one.contextualized, total)
    # the sum is the output: the query's own vector is not added back
    torch.testing.assert_close(loop.attend(q, k, v)[0, 3, 2].double(), total)


def test_causal_with_fewer_queries_aligns_to_the_last_keys():
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    full = attend(torch.cat([torch.randn(1, 1, 3, 4), q], 2), k, v, causal=True)
    for backend in ["loop", *FAST]:
        out = attend(q, k, v, causal=True, backend=backend)
        torch.testing.assert_close(out, full[:, :, 3:], atol=1e-5, rtol=0)


def test_more_queries_than_keys_with_causal_leaves_the_first_queries_blind():
    q, k = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 3, 4)
    for backend in ["loop", *FAST]:
        out = attend(q, k, k, causal=True, backend=backend)
        assert (out[:, :, :3] == 0).all() and (out[:, :, 3:] != 0).any()


def test_auto_is_sdpa_on_cpu_and_can_be_overridden():
    x = torch.randn(1, 2, 3, 4)
    assert explain_choice(x, x, x).backend == "sdpa"
    assert torch.equal(attend(x, x, x, backend="eager"), eager_backend.attend(x, x, x))


def test_a_new_backend_is_one_registry_line_and_auto_explains_passing_it_over():
    calls = []

    def fast(q, k, v, **kw):
        calls.append(q.shape)
        return BACKENDS["eager"].forward(q, k, v, **kw)

    def only_float64(q, mask, causal, shape):
        return None if q.dtype == torch.float64 else f"needs float64, got {q.dtype}"

    register_backend(Backend("test-fast", fast, 1, "test", supports=only_float64))
    try:
        x = torch.randn(1, 1, 3, 4)
        choice = explain_choice(x, x, x)
        assert choice.backend == "sdpa"
        assert "needs float64" in choice.passed_over["test-fast"] and "test-fast" in str(choice)
        attend(x.double(), x.double(), x.double())
        assert calls == [x.shape]
        with pytest.raises(ValueError, match="cannot run these inputs: needs float64"):
            attend(x, x, x, backend="test-fast")
    finally:
        del BACKENDS["test-fast"]


def _ok(B=1, H=4, Hkv=2, Tq=3, Tk=5, D=8):
    return torch.randn(B, H, Tq, D), torch.randn(B, Hkv, Tk, D), torch.randn(B, Hkv, Tk, D)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: (torch.randn(4, 3, 8), *_ok()[1:], None), "4 dimensions"),
        (lambda: (*_ok(Hkv=3)[:1], *_ok(H=3, Hkv=3)[1:], None), "not a multiple"),
        (lambda: (_ok()[0], _ok(D=4)[1], _ok(D=4)[2], None), "head size D=8"),
        (lambda: (_ok()[0], _ok(B=2)[1], _ok(B=2)[2], None), "batch size"),
        (lambda: (*_ok()[:2], torch.randn(1, 2, 4, 8), None), "same shape"),
        (lambda: (*_ok(), torch.ones(1, 1, 3, 4, dtype=torch.bool)), "does not broadcast"),
        (lambda: (*_ok(), torch.ones(1, 1, 1, 5)), "boolean"),
        (lambda: (*[t.int() for t in _ok()], None), "dtype"),
        (lambda: (_ok()[0].double(), *_ok()[1:], None), "share one dtype"),
        (lambda: (*_ok(Tq=0), None), "at least 1"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "loop", *FAST])
def test_bad_arguments_say_what_is_wrong(make, message, backend):
    q, k, v, mask = make()
    with pytest.raises(ValueError, match=message):
        attend(q, k, v, mask=mask, backend=backend)


def test_unknown_backend_and_bad_scale_list_what_is_allowed():
    q, k, v = _ok()
    with pytest.raises(ValueError, match=r"unknown attention backend 'fast'.*'sdpa'"):
        attend(q, k, v, backend="fast")
    assert set(backend_names()) >= {"loop", "eager", "sdpa", "auto"}
    with pytest.raises(ValueError, match="scale must be a positive"):
        attend(q, k, v, scale=-1.0)


@pytest.mark.parametrize(
    ("H", "Hkv", "Tq", "Tk", "causal", "dtype"),
    [
        (9, 3, 64, 64, True, torch.float32),  # SmolLM2's grouping, one text
        (4, 4, 7, 7, False, torch.float32),
        (6, 2, 5, 9, True, torch.float64),  # fewer queries than keys: aligned to the end
        (4, 2, 9, 5, True, torch.float32),  # more: the first queries see no key
        (9, 3, 300, 300, True, torch.float32),  # causal blocks of 97 query rows, the last short
        (6, 2, 70, 400, True, torch.float64),  # blocks of 54 rows, aligned to the end
    ],
)
def test_weights_into_fills_its_tensor_with_eagers_weights(H, Hkv, Tq, Tk, causal, dtype):
    """`Attentions.weights`' way: each layer's weights made in place in the one output."""
    gen = torch.Generator().manual_seed(H * Tq + Tk)
    q = torch.randn(1, H, Tq, 16, generator=gen, dtype=dtype)
    k = torch.randn(1, Hkv, Tk, 16, generator=gen, dtype=dtype)
    want = eager_backend.attention_weights(q, k, causal=causal, scale=0.3)[0]
    out = torch.full((H, Tq, Tk), float("nan"), dtype=dtype)
    assert eager_backend.weights_into(out, q, k, causal=causal, scale=0.3) is out
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)  # the last bit may differ
    if causal and Tq > Tk:
        assert bool((out[:, : Tq - Tk] == 0).all())  # blind rows are zeros, not NaN
    with pytest.raises(ValueError, match="out must be a contiguous"):
        eager_backend.weights_into(out.transpose(1, 2), q, k, causal=causal, scale=0.3)


@pytest.mark.parametrize(("H", "Hkv", "Tq", "Tk"), [(9, 3, 300, 300), (4, 2, 5, 9), (2, 2, 40, 40)])
def test_attend_into_gives_the_loops_output_and_eagers_weights(H, Hkv, Tq, Tk):
    """The output and the weights made together, a block of queries at a time (qkv.hf's way
    when every weight is asked for): the article's loop's output, eager's weights."""
    gen = torch.Generator().manual_seed(H + Tq)
    q = torch.randn(1, H, Tq, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, Hkv, Tk, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    weights = torch.full((H, Tq, Tk), float("nan"), dtype=torch.float64)
    out = eager_backend.attend_into(weights, q, k, v, scale=0.3)
    # the loop (a Python loop over every pair: 50 s for all 9 heads at 300 tokens) on the
    # first key/value head's group of query heads; every head's output against its weights
    group = H // Hkv
    want = attend(q[:, :group], k[:, :1], v[:, :1], causal=True, scale=0.3, backend="loop")
    torch.testing.assert_close(out[:, :group], want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weights, eager_backend.attention_weights(q, k, causal=True,
                                                                        scale=0.3)[0])  # fmt: skip
    values = v[0].repeat_interleave(group, dim=0)  # (H, Tk, 16): each query head's
    torch.testing.assert_close(out[0], weights @ values, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        eager_backend.attend_into(torch.empty(H, 5, 4, dtype=torch.float64), q[:, :, :5],
                                  k[:, :, :4], v[:, :, :4], scale=0.3)  # fmt: skip


def test_the_mask_check_accepts_exactly_the_shapes_torch_broadcasts_to_the_scores():
    """check_inputs' own broadcast rule (a Python loop, cheaper per layer) against
    torch.broadcast_shapes on random mask shapes of 0 to 5 dimensions."""
    q, k, v = _ok(B=2, H=4, Hkv=2, Tq=3, Tk=5)
    target = torch.Size((2, 4, 3, 5))
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(400):
        dims = int(torch.randint(0, 6, (), generator=generator))
        shape = tuple(int(torch.randint(1, 6, (), generator=generator)) for _ in range(dims))
        try:
            torch_says = len(shape) <= 4 and torch.broadcast_shapes(shape, target) == target
        except RuntimeError:
            torch_says = False
        seen.add(torch_says)
        mask = torch.ones(shape, dtype=torch.bool)
        if torch_says:
            check_inputs(q, k, v, mask, None)
        else:
            with pytest.raises(ValueError, match="does not broadcast"):
                check_inputs(q, k, v, mask, None)
    assert seen == {True, False}
