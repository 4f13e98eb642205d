"""The `flash` Triton kernels against float64 references, forward and backward.

Without a GPU these run the real kernels in Triton's interpreter (the root conftest sets
TRITON_INTERPRET=1), so every size here is small; flash_cases.py holds the checks, and
benchmarks/flash_gpu.py runs them at full size on a GPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from flash_cases import CASES, MASKS, TOLERANCE, Case, check, check_varlen, make_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import attend, attention_weights, explain_choice, loop
from qkv.attention.flash import attention_weights_from_lse, backend, flash_attention
from qkv.attention.flash import flash_attention_varlen as varlen
from qkv.models import (
    Decoder,
    DecoderConfig,
    Encoder,
    EncoderConfig,
    EncoderDecoder,
    EncoderDecoderConfig,
)
from qkv.nn import BlockConfig

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


def assert_within_tolerance(errors: dict[str, float], dtype: torch.dtype) -> None:
    tolerance = TOLERANCE[dtype]
    assert errors["blind"] == 0.0, "a query that sees no key must get exact zeros"
    assert errors["lse_blind"] == 0.0, "a query that sees no key must get lse = -inf"
    assert errors["lse"] < 1e-5, errors  # float32 in every dtype
    for name in ("out", "dq", "dk", "dv"):
        assert errors[name] < tolerance, f"{name}: {errors[name]:.2e} >= {tolerance:.0e}"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_gradients_match_float64(case):
    assert_within_tolerance(check(case), case.dtype)


@settings(max_examples=10, deadline=None)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 2), group=st.integers(1, 3),
    Tq=st.integers(1, 40), Tk=st.integers(1, 40), D=st.sampled_from([32, 48, 64, 80, 96, 128]),
    dtype=st.sampled_from([bf16, fp16, fp32]), causal=st.booleans(), mask=st.sampled_from(MASKS),
)  # fmt: skip
def test_random_shapes_match_float64(B, Hkv, group, Tq, Tk, D, dtype, causal, mask):
    case = Case(B, Hkv * group, Hkv, Tq, Tk, D, dtype, causal, mask)
    assert_within_tolerance(check(case), dtype)


def test_matches_the_loop_backend_the_article_itself():
    q, k, v, mask = make_inputs(Case(B=1, H=2, Hkv=1, Tq=9, Tk=12, D=32, dtype=fp32), "cpu")
    mask = torch.rand(1, 1, 9, 12) > 0.3
    got = attend(q, k, v, mask=mask, causal=True, backend="flash")
    want = loop.attend(q, k, v, mask=mask, causal=True)
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_of_different_lengths_match_each_alone(causal):
    # an empty sequence, queries shorter and longer than their keys, lengths off the tiles
    errors = check_varlen([5, 0, 23, 17], [9, 4, 23, 30], causal=causal)
    assert errors["lse"] < 1e-5
    for name in ("out", "dq", "dk", "dv"):
        assert errors[name] < TOLERANCE[bf16], (name, errors[name])


def test_packed_batch_equals_the_padded_batch_with_a_key_padding_mask():
    lengths = [11, 30, 3]
    T, H, D = max(lengths), 2, 32
    padded = torch.randn(3, H, T, D, dtype=fp16)
    real = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    out_padded, lse_padded = flash_attention(padded, padded, padded, mask=real[:, None, None])
    packed = padded.transpose(1, 2)[real]  # (N, H, D), padding dropped
    cu = torch.tensor([0, *lengths]).cumsum(0).int()
    out_packed, lse_packed = varlen(packed, packed, packed, cu)
    torch.testing.assert_close(out_packed, out_padded.transpose(1, 2)[real], rtol=0, atol=0)
    torch.testing.assert_close(lse_packed, lse_padded.transpose(0, 1)[:, real], rtol=0, atol=0)


def test_strided_views_are_read_in_place_and_give_the_same_numbers():
    q, k, v, _ = make_inputs(Case(B=2, H=4, Hkv=2, Tq=19, Tk=19, D=64, dtype=bf16), "cpu")
    # (B, T, H, D) memory seen as (B, H, T, D), as a model's split_heads gives it
    views = [t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    dense = [t.clone().requires_grad_() for t in (q, k, v)]
    assert not views[0].is_contiguous()
    out_view, _ = flash_attention(*views, causal=True)
    out_dense, _ = flash_attention(*dense, causal=True)
    dout = torch.randn_like(out_dense)
    out_view.backward(dout)
    out_dense.backward(dout)
    torch.testing.assert_close(out_view, out_dense, rtol=0, atol=0)
    for a, b in zip(views, dense, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_weights_from_the_lse_equal_the_eager_weights_of_the_chosen_heads():
    case = Case(B=2, H=6, Hkv=2, Tq=13, Tk=21, D=32, dtype=fp32, mask="blind")
    q, k, v, mask = make_inputs(case, "cpu")
    _, lse = flash_attention(q, k, v, mask=mask, causal=True)
    heads = [5, 0, 3]
    got = attention_weights_from_lse(q, k, lse, heads=heads, mask=mask, causal=True)
    want = attention_weights(q, k, mask=mask, causal=True)[:, heads]
    assert got.shape == (2, 3, 13, 21)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    sums = got.sum(-1)
    blind = ~(mask[:, heads] & torch.ones(13, 21, dtype=torch.bool).tril(8)).any(-1)
    assert blind.any() and (sums[blind] == 0).all()
    torch.testing.assert_close(sums[~blind], torch.ones_like(sums[~blind]))


def test_inputs_the_kernel_cannot_run_get_a_message_naming_what_is_allowed(monkeypatch):
    x = torch.zeros(1, 2, 3, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="bfloat16, float16 or float32, not torch.float64"):
        attend(x, x, x, backend="flash")
    wide = torch.zeros(1, 2, 3, 512, dtype=bf16)
    with pytest.raises(ValueError, match="D=512 is over its largest, 256"):
        flash_attention(wide, wide, wide)
    packed = torch.zeros(8, 2, 32, dtype=bf16)
    with pytest.raises(ValueError, match=r"rise from 0 to the number of packed tokens \(8\)"):
        varlen(packed, packed, packed, torch.tensor([0, 5, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="packed as"):
        varlen(packed[None], packed, packed, torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q has 2 sequences but cu_seqlens_k has 1"):
        varlen(packed, packed, packed, torch.tensor([0, 3, 8]), torch.tensor([0, 8]))
    # Outside the interpreter, a CPU tensor is refused with the way to run it anyway.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = torch.zeros(1, 2, 3, 64, dtype=bf16)
    with pytest.raises(ValueError, match="runs on CUDA GPUs and q is on cpu"):
        attend(cpu, cpu, cpu, backend="flash")


def test_auto_picks_flash_only_where_a_committed_benchmark_measured_it_fastest():
    x = torch.zeros(1, 2, 3, 64, dtype=bf16)
    choice = explain_choice(x, x, x)  # the kernel runs here (the interpreter) but is slow
    assert choice.backend == "sdpa"
    assert "only on CUDA" in choice.passed_over["flash"]
    assert backend.MEASURED_FASTER == (), "a region needs a committed benchmarks/results table"


# ---------------------------------------------------------------- models on `flash`

BLOCK = BlockConfig(width=48, num_heads=6, num_kv_heads=2, mlp="swiglu", mlp_hidden=80,
                    norm="rmsnorm", bias=False)  # fmt: skip
LLAMA_LIKE = DecoderConfig(vocab_size=61, num_layers=2, position="rotary", block=BLOCK)
BERT_LIKE = EncoderConfig(
    vocab_size=61, num_layers=2, type_vocab_size=2,
    block=BlockConfig(width=32, num_heads=4, norm_position="post"),
)  # fmt: skip
ORIGINAL = EncoderDecoderConfig(vocab_size=61, encoder_layers=1, decoder_layers=2,
                                block=BlockConfig(width=32, num_heads=4, mlp="relu"))  # fmt: skip


def pair(cls, config):
    """The same model (same weights) on `sdpa` and on `flash`, float32."""
    models = []
    for name in ("sdpa", "flash"):
        torch.manual_seed(0)
        models.append(cls(replace(config, block=replace(config.block, backend=name))))
    return models


def assert_same_training_step(run, models):
    """Equal outputs and equal gradients of every parameter for one loss on each model."""
    outputs = []
    for model in models:
        out = run(model)
        out.pow(2).mean().backward()
        outputs.append(out.detach())
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=2e-5)
    named = [dict(model.named_parameters()) for model in models]
    for name, param in named[0].items():
        torch.testing.assert_close(named[1][name].grad, param.grad, rtol=0, atol=2e-5, msg=name)


def test_a_decoder_on_flash_trains_like_one_on_sdpa():
    ids = torch.randint(0, 61, (2, 21))
    real = torch.ones(2, 21, dtype=torch.long)
    real[0, :4] = 0  # a left-padded sequence: padding and causal masks combined
    assert_same_training_step(
        lambda model: model(ids, attention_mask=real).logits, pair(Decoder, LLAMA_LIKE)
    )


def test_an_encoder_and_cross_attention_on_flash_train_like_sdpa():
    ids, real = torch.randint(0, 61, (2, 17)), torch.ones(2, 17, dtype=torch.long)
    real[1, 11:] = 0
    assert_same_training_step(
        lambda model: model(ids, attention_mask=real).hidden, pair(Encoder, BERT_LIKE)
    )
    source, target = torch.randint(0, 61, (2, 19)), torch.randint(0, 61, (2, 6))
    source_mask = torch.ones(2, 19, dtype=torch.long)
    source_mask[0, 15:] = 0
    assert_same_training_step(
        lambda model: model(source, target, source_mask=source_mask).logits,
        pair(EncoderDecoder, ORIGINAL),
    )


def test_a_decoder_on_flash_decodes_with_its_cache_and_reports_its_weights():
    sdpa, flash = pair(Decoder, LLAMA_LIKE)
    ids = torch.randint(0, 61, (1, 12))
    with torch.no_grad():
        want = sdpa(ids, layers="all")
        got = flash(ids, layers="all")
        cache = flash.new_cache()
        steps = [flash(ids[:, :5], cache=cache).logits]
        steps += [flash(ids[:, t : t + 1], cache=cache).logits for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), want.logits, rtol=0, atol=2e-5)
    for layer, record in got.records.items():  # from the kernel's lse, equal to the eager ones
        assert record.lse is not None and record.backend == "flash"
        want_weights = want.records[layer].weights()  # (B, H, T, T)
        torch.testing.assert_close(record.weights(), want_weights, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            record.weights([5, 2]), want_weights[:, [5, 2]], rtol=0, atol=1e-6
        )


# ---------------------------------------------------------------- the interpreter's fixes


def test_bfloat16_is_rounded_and_multiplied_as_a_gpu_does():
    """On the CPU this checks qkv's fixes to Triton's interpreter (flash/interpreter.py);
    on a GPU, the hardware they imitate."""
    import triton
    import triton.language as tl

    from qkv.attention.flash.kernels import launching  # the fixes, as for qkv's launches

    @triton.jit
    def product(A, B, Out, Rounded, N: tl.constexpr):
        rows = tl.arange(0, N)
        tile = rows[:, None] * N + rows[None, :]
        a, b = tl.load(A + tile), tl.load(B + tile)
        tl.store(Out + tile, tl.dot(a, b))  # bfloat16 operands, float32 product
        tl.store(Rounded + tile, tl.dot(a.to(tl.float32), b.to(tl.float32)).to(tl.bfloat16))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = torch.randn(2, 16, 16, device=device).bfloat16()
    out = torch.empty(16, 16, device=device)
    rounded = torch.empty(16, 16, device=device, dtype=bf16)
    with launching():
        product[(1,)](a, b, out, rounded, 16)
    exact = a.float() @ b.float()
    torch.testing.assert_close(out, exact, rtol=0, atol=1e-5)
    assert torch.equal(rounded, exact.bfloat16()), "float32 -> bfloat16 rounds to nearest even"
