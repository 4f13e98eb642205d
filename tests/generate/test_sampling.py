"""Sampling rules, on logits chosen so the answer is known."""

from __future__ import annotations

import pytest
import torch

from qkv.generate import Sampling
from qkv.generate.sampling import greedy

LOGITS = torch.log(torch.tensor([[0.05, 0.4, 0.3, 0.2, 0.05]]))


def draws(sampling: Sampling, n: int = 400) -> set[int]:
    generator = torch.Generator().manual_seed(0)
    return {int(sampling.pick(LOGITS, generator)) for _ in range(n)}


def test_greedy_takes_the_most_likely_token():
    assert draws(Sampling(temperature=0.0), 5) == {1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_is_torchs_argmax_ties_nan_and_every_shape(dtype):
    """The greedy pick (numpy's argmax on the CPU for float32 and float64) is torch's argmax
    everywhere: the first of tied largest values, the first NaN of a row with NaNs, -inf rows,
    a 1-D vector, a strided view and an inference tensor; int64 like torch's."""
    rng = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=rng).to(dtype)
    logits[1, 100] = logits[1, 7] = 50.0  # a tie: the first wins
    logits[2, 300], logits[2, 9000] = float("nan"), float("nan")
    logits[3] = float("-inf")
    logits[4, 5] = float("inf")
    for x in (logits, logits[0], logits[:, ::3], logits.t().contiguous().t()):
        want = x.argmax(dim=-1)
        got = greedy(x)
        assert got.dtype == torch.int64 and got.shape == want.shape and torch.equal(got, want)
    with torch.inference_mode():
        inferred = logits.clone()
    assert torch.equal(greedy(inferred), logits.argmax(-1))
    assert torch.equal(Sampling(temperature=0.0).pick(logits, None), logits.argmax(-1))
    assert greedy(logits)[1] == 7 and greedy(logits)[2] == 300


def test_top_k_and_top_p_keep_exactly_the_expected_tokens():
    assert draws(Sampling(temperature=1.0)) == {0, 1, 2, 3, 4}
    assert draws(Sampling(temperature=1.0, top_k=2)) == {1, 2}
    # 0.4 + 0.3 = 0.7 < 0.75, so the third most likely (0.2) is still needed to reach it
    assert draws(Sampling(temperature=1.0, top_p=0.75)) == {1, 2, 3}
    assert draws(Sampling(temperature=1.0, top_p=0.7)) == {1, 2}


def test_a_seed_repeats_and_temperature_sharpens():
    a = [int(Sampling(temperature=1.0).pick(LOGITS, torch.Generator().manual_seed(3)))
         for _ in range(20)]  # fmt: skip
    b = [int(Sampling(temperature=1.0).pick(LOGITS, torch.Generator().manual_seed(3)))
         for _ in range(20)]  # fmt: skip
    assert a == b
    assert draws(Sampling(temperature=0.01)) == {1}


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45, 1e-8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_tiny_temperature_samples_the_most_likely_tokens_never_nan(temperature, dtype):
    logits = torch.randn(3, 50).to(dtype)
    for row in (0, 2):  # one most likely token (bfloat16's randn ties now and then)
        logits[row, int(logits[row].argmax())] = logits[row].max() + 1
    logits[1, [7, 30]] = logits[1].max() + 1  # a tie for the most likely: both are drawn
    generator = torch.Generator().manual_seed(0)
    for sampling in (Sampling(temperature), Sampling(temperature, top_k=5, top_p=0.9)):
        drawn = [sampling.pick(logits, generator).tolist() for _ in range(200)]
        assert {row[0] for row in drawn} == {int(logits[0].argmax())}
        assert {row[1] for row in drawn} == {7, 30}
        assert {row[2] for row in drawn} == {int(logits[2].argmax())}


def test_a_huge_temperature_is_near_uniform():
    assert draws(Sampling(temperature=1e308)) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("seed", [-1, 2**64, True, 1.0])
def test_a_seed_torch_would_wrap_or_overflow_on_is_refused(seed):
    # torch.Generator.manual_seed(-1) wraps to 2**64-1 silently; 2**64 overflows with
    # "Overflow when unpacking long long"
    with pytest.raises(ValueError, match=r"seed must be a whole number from 0 to 2\*\*64-1"):
        Sampling(temperature=1.0, seed=seed)
    Sampling(temperature=1.0, seed=2**64 - 1)  # the largest torch takes


def test_a_prompt_with_no_tokens_is_refused_by_name(smollm2):
    with pytest.raises(ValueError, match=r"prompt 1 \(counted from 0\) is empty"):
        smollm2.generate(["The river", ""], 2)
