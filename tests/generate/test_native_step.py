"""NativeStep (qkv/generate/step.c): one decoding step of a plain Llama-like decoder in one
native call, held to FastStep, its reference, which runs the same products from Python.

NativeStep's cache holds float16 where FastStep's holds float32; with FastStep's cache rounded
the same way (`HalfCacheStep`), the two give the same numbers at most steps and differ at
the others by float32's rounding (the C step's attention and norms round differently from
torch's in the last bits), on tiny models built here in every layout NativeStep reads
(separate and fused projections, biases, grouped heads, a window). On the embedded SmolLM2's
own file, its greedy tokens follow the float32 model's.
"""

from __future__ import annotations

import dataclasses
import textwrap

import gguf
import numpy as np
import pytest
import torch

import kquant_blocks
from qkv import native
from qkv.generate import Sampling, decode_steps
from qkv.generate.fast_step import FastStep, fast_step_refusal, head_of
from qkv.generate.native_step import NativeStep, native_step_refusal
from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig
from qkv.nn.quant_linear import QuantLinear, kernels
from sanitized import run_sanitized

pytestmark = pytest.mark.skipif(kernels() is None, reason="no native kernels")
VOCAB = 50


def config(**block) -> DecoderConfig:
    block = {"width": 64, "num_heads": 4, "num_kv_heads": 2, "mlp": "swiglu", "mlp_hidden": 96,
             "norm": "rmsnorm", "bias": False, **block}  # fmt: skip
    return DecoderConfig(
        vocab_size=VOCAB, num_layers=3, position="rotary", block=BlockConfig(**block)
    )


KINDS = {
    "llama": config(),
    "qwen2": config(qkv_bias=True),
    "fused": config(fused_qkv=True, fused_mlp=True, num_kv_heads=4),
    "window": config(window=4, num_kv_heads=1),
}


def blocks_of(w: np.ndarray, fmt: str) -> np.ndarray:
    """w (N, K) float as a GGUF file's rows of Q8_0 or Q4_1 blocks (N, K / 32 * bytes)."""
    N, K = w.shape
    b = w.reshape(N, K // 32, 32).astype(np.float32)
    if fmt == "Q8_0":
        d = np.abs(b).max(-1) / 127
        q = np.round(b / np.where(d == 0, 1, d)[..., None]).clip(-127, 127).astype(np.int8)
        head = d.astype(np.float16).view(np.uint8).reshape(N, K // 32, 2)
        return np.concatenate([head, q.view(np.uint8)], -1).reshape(N, -1)
    lo, hi = b.min(-1), b.max(-1)
    d = (hi - lo) / 15
    q = np.round((b - lo[..., None]) / np.where(d == 0, 1, d)[..., None]).clip(0, 15)
    q = q.astype(np.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    scales = np.stack([d.astype(np.float16), lo.astype(np.float16)], -1).view(np.uint8)
    return np.concatenate([scales.reshape(N, K // 32, 4), packed], -1).reshape(N, -1)


def random_model(cfg: DecoderConfig, seed: int, swap) -> Decoder:
    """A random decoder whose every block matrix is what swap(name, linear, in_attention)
    makes of it (a QuantLinear)."""
    torch.manual_seed(seed)
    model = Decoder(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    for block in model.blocks:
        for module in (block.attn, block.mlp):
            for name, linear in list(module.named_children()):
                if type(linear) is torch.nn.Linear:
                    setattr(module, name, swap(name, linear, module is block.attn))
    return model


def quantized_model(cfg: DecoderConfig, fmt: str = "Q4_1", seed: int = 0) -> Decoder:
    """A random decoder whose every block matrix is a QuantLinear of fmt blocks."""

    def swap(name, linear, in_attention):
        raw = torch.from_numpy(blocks_of(linear.weight.detach().numpy(), fmt))
        return QuantLinear(fmt, raw, linear.in_features, linear.bias)

    return random_model(cfg, seed, swap)


def teacher_forced(step, model: Decoder, tokens: list[int]) -> torch.Tensor:
    """The step's output (len(tokens), C) for each token fed in turn."""
    return torch.cat([step(torch.tensor([t])) for t in tokens])


class _Halved(torch.Tensor):
    """A float32 cache whose every write is rounded to float16 first, as NativeStep's."""

    def index_copy_(self, dim, index, source):
        return super().index_copy_(dim, index, source.half().float())


class HalfCacheStep(FastStep):
    """FastStep with its cache rounded to float16, as NativeStep's: the reference that
    NativeStep must give to float32's last bits (FastStep's own float32 cache moves a random
    model's outputs by 2-5%)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.keys = [k.half().float().as_subclass(_Halved) for k in self.keys]
        self.values = [v.half().float().as_subclass(_Halved) for v in self.values]


def prompt_cache(model: Decoder, prompt: torch.Tensor):
    cache = model.new_cache()
    with torch.inference_mode():
        model(prompt, cache=cache, logits=False)
    return cache


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_each_step_follows_faststep(kind, fmt):
    """Every step's output (the final norm's) within a few percent of FastStep's, fed the same
    tokens, for every layout: a wrong offset, sign or order would be off by its whole size."""
    model = quantized_model(KINDS[kind], fmt)
    assert native_step_refusal(model, 1, False) is None
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    want = teacher_forced(HalfCacheStep(model, prompt_cache(model, prompt), 19), model, tokens)
    step = NativeStep(model, prompt_cache(model, prompt), 19)
    got = teacher_forced(step, model, tokens)
    off = (got - want).abs().amax(-1) / want.abs().amax(-1)  # each step's, of its largest
    # measured on an AMD EPYC (AVX2): equal at most steps, 2e-7 at the worst; an input
    # rounded to the other side of an 8-bit boundary would move a step by up to 1e-3 here,
    # and a mistake (a sign, an offset, a bias) by 100% and more
    assert float(off.max()) < 1e-2, f"a step differs from FastStep's by {float(off.max()):.2%}"
    # the cache holds every token's key, rounded to float16, and nothing past them
    assert step.length == 19 and bool(step.keys[0][:, 19:].eq(0).all())
    assert not bool(step.keys[-1][:, 18].eq(0).all())


def test_the_scalar_step_follows_faststep_as_the_simd_one(monkeypatch):
    """The step's own loops without AVX2 (the norm's sum of squares, the float16 rounding of
    keys and values, the SiLU gate; QKV_NATIVE_ISA=scalar forces them here) follow FastStep
    as the SIMD ones do: a wrong lane or a skipped tail would be off by its whole size."""
    model = quantized_model(KINDS["llama"], "Q8_0")
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    tokens = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(4)).tolist()
    want = teacher_forced(HalfCacheStep(model, prompt_cache(model, prompt), 15), model, tokens)
    simd = teacher_forced(NativeStep(model, prompt_cache(model, prompt), 15), model, tokens)
    monkeypatch.setenv("QKV_NATIVE_ISA", "scalar")
    step = NativeStep(model, prompt_cache(model, prompt), 15)
    assert step._model.variant == step._model.attn_variant == 0  # the scalar loops run
    scalar = teacher_forced(step, model, tokens)
    for got in (simd, scalar):
        off = (got - want).abs().amax(-1) / want.abs().amax(-1)
        assert float(off.max()) < 1e-2, f"a step differs from FastStep's by {off.tolist()}"


# Matrices of every format a file's blocks come in, mixed as llama.cpp's Q4_K_M mixes them
# (SmolLM2's: 5-bit q, k and output projections, an 8-bit v, K-quant MLPs) and the other way
# round (K-quants in attention, whose inputs go in two parts, as `use_blocks` sets them)
MIXTURES = {
    "q4_k_m": {"q": "Q5_0", "k": "Q5_0", "v": "Q8_0", "out": "Q5_1", "gate": "Q4_K",
               "up": "Q5_K", "down": "Q6_K"},
    "k_attention": {"q": "Q4_K", "k": "Q5_K", "v": "Q6_K", "out": "Q4_K", "gate": "Q5_0",
                    "up": "Q5_1", "down": "Q4_K"},
}  # fmt: skip


def mixed_model(formats: dict[str, str], seed: int = 0) -> Decoder:
    """A random two-block decoder 256 wide (whole K-quant super-blocks) of `formats`' blocks:
    the 32-column formats quantized from its weights by gguf-py, the K-quants random blocks
    of small scales (gguf-py quantizes none of them)."""
    rng = np.random.default_rng(seed)

    def swap(name, linear, in_attention):
        fmt, (N, K) = formats[name], linear.weight.shape
        if fmt in kquant_blocks.BLOCK_BYTES:
            raw = kquant_blocks.random_blocks(fmt, N, K, rng).reshape(N, K // 256, -1)
            at, size = (208, 2) if fmt == "Q6_K" else (0, 4)  # the float16 d (, dmin)
            small = rng.uniform(1e-4, 5e-4, (N, K // 256, 2)).astype(np.float16)
            raw[:, :, at : at + size] = small.view(np.uint8)[..., :size]
            raw = raw.reshape(N, -1)
        else:
            raw = gguf.quants.quantize(linear.weight.detach().numpy(),
                                       gguf.GGMLQuantizationType[fmt])  # fmt: skip
        return QuantLinear(fmt, torch.from_numpy(raw), K, linear.bias,
                           parts=2 if in_attention else 1)  # fmt: skip

    cfg = config(width=256, num_heads=4, num_kv_heads=2, mlp_hidden=512)
    return random_model(dataclasses.replace(cfg, num_layers=2), seed, swap)


@pytest.mark.parametrize("mixture", MIXTURES)
def test_every_format_steps_as_faststep_and_reads_a_prompt_as_its_steps(mixture):
    """5-bit, 8-bit and K-quant matrices in one step (the K-quants through quant_k.c's
    product, in two parts in attention): the outputs equal FastStep's at most steps; and a
    prompt read in one call as its steps."""
    model = mixed_model(MIXTURES[mixture])
    assert native_step_refusal(model, 1, False) is None
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(2)).tolist()
    reference = HalfCacheStep(model, prompt_cache(model, prompt), 13)
    step = NativeStep(model, prompt_cache(model, prompt), 13)
    want, got = teacher_forced(reference, model, tokens), teacher_forced(step, model, tokens)
    off = (got - want).abs().amax(-1) / want.abs().amax(-1)
    # The products' inputs differ from FastStep's in float32's last bits (the C step's norm
    # and attention round apart from torch's), which moves an 8-bit rounding now and then:
    # measured on an AMD EPYC (AVX2), seeds 0-3 of both mixtures, the median step within
    # 1e-5 of FastStep's and the worst up to 3e-2. Any one attention product in one part
    # where FastStep has two moved the median step by 2e-2 to 5e-2 (the least min 1e-2); a
    # product read wrong moves every step by its whole size.
    assert float(off.median()) < 1e-3, f"steps differ from FastStep's: {off.tolist()}"
    assert float(off.max()) < 1e-1, f"a step differs from FastStep's by {float(off.max()):.2%}"
    one_by_one = NativeStep(model, None, 13)
    steps = teacher_forced(one_by_one, model, [*prompt[0].tolist(), *tokens])
    at_once = NativeStep(model, None, 13)
    torch.testing.assert_close(at_once.read(prompt), steps[4:5], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(at_once.read(torch.tensor([tokens])), steps[-1:], rtol=1e-6,
                               atol=1e-6)  # fmt: skip
    for mine, theirs in zip(at_once.keys, one_by_one.keys, strict=True):
        assert torch.equal(mine, theirs)


def test_inputs_in_different_parts_in_one_product_are_refused():
    """q in two parts and k, v in one: the step rounds one input for the three, so it does
    not take them (a file's model never has them so; a user may set them)."""
    model = mixed_model(MIXTURES["q4_k_m"])
    model.blocks[1].attn.k.parts = 1
    assert native_step_refusal(model, 1, False) == (
        "block 1's q, k and v round their inputs in different parts"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_read_in_one_call_is_its_steps(kind):
    """NativeStep.read: a prompt's rows through each matrix at once, each row attending to
    the cache up to itself, gives what feeding it one token at a time gives (attention's
    inputs in two parts, as a file's models have them); then the steps go on from it."""
    model = quantized_model(KINDS[kind], "Q4_1", seed=1)
    for block in model.blocks:
        for linear in block.attn.children():
            if isinstance(linear, QuantLinear):
                linear.parts = 2
    tokens = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    one_by_one = NativeStep(model, None, 12)
    want = teacher_forced(one_by_one, model, tokens[0].tolist())
    at_once = NativeStep(model, None, 12)
    last = at_once.read(tokens[:, :7])
    more = at_once.read(tokens[:, 7:])  # a second read goes on from the first's cache
    # each row's products add its blocks in one order, however many rows share an unpack
    torch.testing.assert_close(last, want[6:7], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(more, want[8:9], rtol=1e-6, atol=1e-6)
    mine_all, theirs_all = at_once.keys + at_once.values, one_by_one.keys + one_by_one.values
    for mine, theirs in zip(mine_all, theirs_all, strict=True):
        assert torch.equal(mine, theirs)
    token = torch.tensor([3])
    torch.testing.assert_close(at_once(token), one_by_one(token), rtol=1e-6, atol=1e-6)
    assert at_once.length == one_by_one.length == 10
    with pytest.raises(ValueError, match="overflow the cache"):
        at_once.read(tokens[:, :3])
    with pytest.raises(ValueError, match=r"reads input_ids \(1, T\)"):
        at_once.read(tokens[0])
    assert at_once.length == 10


def test_decode_steps_take_it_where_it_runs_and_faststep_elsewhere(monkeypatch):
    """Greedy decoding of one unpadded sequence reads a short prompt through NativeStep.read
    and each later token through NativeStep, giving the tokens of its reference (HalfCacheStep,
    by hand); a longer prompt is read by Decoder.forward first; a batch goes through FastStep."""
    model = quantized_model(KINDS["llama"], "Q8_0")
    calls = {"native": 0, "fast": 0, "read": 0}
    for cls, method, name in ((NativeStep, "__call__", "native"), (FastStep, "__call__", "fast"),
                              (NativeStep, "read", "read")):  # fmt: skip
        real = getattr(cls, method)
        monkeypatch.setattr(cls, method, lambda self, *a, _r=real, _n=name: (
            calls.__setitem__(_n, calls[_n] + 1) or _r(self, *a)))  # fmt: skip
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    greedy = Sampling(temperature=0.0)
    got = torch.cat(list(decode_steps(model, prompt[:1], None, greedy, 8))).tolist()
    assert calls == {"native": 7, "fast": 0, "read": 1}
    cache, head = model.new_cache(), head_of(model)
    with torch.inference_mode():
        want = [int(model(prompt[:1], cache=cache).logits[0, -1].argmax())]
        step = HalfCacheStep(model, cache, 14)
        for _ in range(7):
            want.append(int(head(step(torch.tensor(want[-1:])))[0].argmax()))
    assert got == want
    monkeypatch.setattr("qkv.generate.decode.NATIVE_PROMPT", 5)  # 6 tokens: forward reads them
    assert torch.cat(list(decode_steps(model, prompt[:1], None, greedy, 8))).tolist() == want
    assert calls == {"native": 14, "fast": 7, "read": 1}  # fast: HalfCacheStep's 7
    list(decode_steps(model, prompt, None, greedy, 8))
    assert calls == {"native": 14, "fast": 14, "read": 1}  # and the batch's 7


def test_the_pool_lingers_while_a_native_decoder_runs_and_no_longer():
    """decode_steps counts itself among the pool's decoders (whose workers spin between tokens
    rather than sleep) from its prompt to its last token, nested ones too, and uncounts itself
    when it ends, is closed early or fails; FastStep's decoding is never counted."""
    model = quantized_model(KINDS["llama"], "Q8_0")
    lib = native.library()
    running = lambda: lib.qkv_pool_linger(0)  # noqa: E731 (the count, unchanged)
    prompt = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(5))
    greedy = Sampling(temperature=0.0)
    assert running() == 0
    first = decode_steps(model, prompt[:1], None, greedy, 6)
    next(first)
    assert running() == 1
    second = decode_steps(model, prompt[:1], None, greedy, 6)
    next(second)
    assert running() == 2
    assert len(list(second)) == 5 and running() == 1  # ran out
    first.close()  # closed early
    assert running() == 0
    batch = decode_steps(model, prompt, None, greedy, 3)  # a batch: FastStep's
    next(batch)
    assert running() == 0
    batch.close()
    failing = decode_steps(model, prompt[:1], None, greedy, 4)
    next(failing)
    with pytest.raises(RuntimeError, match="stop here"):
        failing.throw(RuntimeError("stop here"))
    assert running() == 0


def test_what_it_does_not_compute_is_refused_by_name():
    model = quantized_model(KINDS["llama"])
    assert "one sequence" in native_step_refusal(model, 2, False)
    assert "one sequence" in native_step_refusal(model, 1, True)
    model.blocks[1].mlp.down = torch.nn.Linear(96, 64)
    assert (
        native_step_refusal(model, 1, False) == "block 1 multiplies a Linear, not a file's blocks"
    )
    with pytest.raises(ValueError, match="cannot run this model"):
        NativeStep(model, prompt_cache(model, torch.tensor([[1, 2]])), 4)
    qk = quantized_model(config(qk_norm="head"))
    assert fast_step_refusal(qk, torch.device("cpu")) is None
    assert native_step_refusal(qk, 1, False) == "block 0 normalizes q and k"
    gelu = quantized_model(config(mlp="geglu_tanh"))
    assert "SiLU" in native_step_refusal(gelu, 1, False)


def test_a_full_cache_and_a_wrong_token_are_refused_before_the_call():
    model = quantized_model(KINDS["llama"])
    step = NativeStep(model, prompt_cache(model, torch.tensor([[1, 2, 3]])), 4)
    with pytest.raises(ValueError, match="one token"):
        step(torch.tensor([1, 2]))
    step(torch.tensor([4]))
    with pytest.raises(ValueError, match="its capacity"):
        step(torch.tensor([5]))
    with pytest.raises(ValueError, match="less than the 3 cached"):
        NativeStep(model, prompt_cache(model, torch.tensor([[1, 2, 3]])), 2)
    step = NativeStep(model, None, 4)
    for bad in (VOCAB, -1):  # the token table's rows, read directly, are checked as embed does
        with pytest.raises(ValueError, match=f"token ids must be in 0-{VOCAB - 1}"):
            step(torch.tensor([bad]))
    assert step.length == 0


def test_a_token_is_its_table_row_where_the_embedding_is_only_that():
    """Each step's vector is the token table's row read directly where the model's embedding
    adds nothing to it, and the module's output (here scaled, as Gemma's) elsewhere: both
    follow FastStep's steps (as test_each_step_follows_faststep measures them)."""
    plain = quantized_model(KINDS["llama"])
    scaled = quantized_model(KINDS["llama"])
    scaled.embed.scale = 8.0
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    tokens = [9, 2, 6, 2]
    for model, direct in ((plain, True), (scaled, False)):
        step = NativeStep(model, prompt_cache(model, prompt), 9)
        assert (step._table is not None) is direct
        want = teacher_forced(HalfCacheStep(model, prompt_cache(model, prompt), 9), model, tokens)
        got = teacher_forced(step, model, tokens)
        off = (got - want).abs().amax(-1) / want.abs().amax(-1)
        assert float(off.max()) < 1e-2, f"{float(off.max()):.2%} off FastStep's"


def test_the_step_runs_clean_under_sanitizers(tmp_path):
    """ASan and UBSan around whole steps (a two-block model of random blocks of 4-, 5-bit and
    K-quant formats mixed in one product, grouped heads, a window, attention's inputs in two
    parts), a prompt of several rows then one row at a time, in a process without torch:
    numpy and ctypes, the sanitizers preloaded."""
    built = native.build(tmp_path, sanitize=True)
    script = textwrap.dedent(f"""
        import ctypes, numpy as np
        lib = ctypes.CDLL({str(built)!r})
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        class M(ctypes.Structure):
            _fields_ = [("fmt", ctypes.c_int), ("parts", ctypes.c_int), ("N", i64), ("K", i64),
                        ("panels", p),
                        ("scales", p), ("mins", p), ("bias", p)]
        class L(ctypes.Structure):
            _fields_ = [("attn_norm", p), ("mlp_norm", p)] + [(n, M) for n in "qkvoGUD"] + [
                ("keys", p), ("values", p), ("window", i64), ("scale", f32)]
        class Model(ctypes.Structure):
            _fields_ = [("variant", ctypes.c_int), ("attn_variant", ctypes.c_int),
                        ("nth", ctypes.c_int)] + [(n, i64) for n in
                        ("L", "C", "H", "Hkv", "D", "F", "cap")] + [("eps", f32),
                        ("final_eps", f32), ("layers", ctypes.POINTER(L)), ("final_norm", p),
                        ("cos", p), ("sin", p)]
        lib.qkv_quant_repack.argtypes = [ctypes.c_int, p, i64, i64, p, p, p]
        lib.qkv_quantk_repack.argtypes = [ctypes.c_int, p, i64, i64, p]
        lib.qkv_quantk_panel_bytes.restype = i64
        lib.qkv_quantk_panel_bytes.argtypes = [ctypes.c_int, i64, i64]
        lib.qkv_step_work_floats.restype = i64
        lib.qkv_step_work_floats.argtypes = [i64] * 6
        lib.qkv_step.argtypes = [ctypes.POINTER(Model), p, i64, i64, p]
        rng = np.random.default_rng(0)
        keep = []
        def matrix(N, K, bias, parts=1, fmt="Q4_1"):
            b = rng.standard_normal(N).astype(np.float32) if bias else None
            at = None if b is None else b.ctypes.data
            if fmt == "Q4_K":  # quant_k.c's format 0, its panels alone
                raw = rng.integers(0, 256, (N, K // 256 * 144)).astype(np.uint8)
                raw.reshape(N, -1, 144)[:, :, 1] = raw.reshape(N, -1, 144)[:, :, 3] = 0x1c
                panels = np.empty(lib.qkv_quantk_panel_bytes(0, N, K), np.uint8)
                lib.qkv_quantk_repack(0, raw.ctypes.data, N, K, panels.ctypes.data)
                keep.extend([panels, b])
                return M(16, parts, N, K, panels.ctypes.data, None, None, at)
            code, size, each = {{"Q4_1": (1, 20, 256), "Q5_0": (3, 22, 512)}}[fmt]
            raw = rng.integers(0, 256, (N, K // 32 * size)).astype(np.uint8)
            raw.reshape(N, -1, size)[:, :, 1] = raw.reshape(N, -1, size)[:, :, 3] = 0x2c
            P = (N + 15) // 16 * (K // 32)
            panels, sc, mi = np.empty(P * each, np.uint8), np.empty(P * 16, np.float32), \\
                np.empty(P * 16, np.float32)
            lib.qkv_quant_repack(code, raw.ctypes.data, N, K, panels.ctypes.data,
                                 sc.ctypes.data, mi.ctypes.data)
            keep.extend([panels, sc, mi, b])
            return M(code, parts, N, K, panels.ctypes.data, sc.ctypes.data, mi.ctypes.data, at)
        C, H, Hkv, D, F, cap, nl = 256, 4, 2, 64, 512, 9, 2
        layers = (L * nl)()
        for i in range(nl):
            norms = [np.ones(C, np.float32) for _ in range(2)]
            caches = [np.zeros((Hkv, cap, D), np.uint16) for _ in range(2)]
            keep.extend(norms + caches)
            layers[i] = L(norms[0].ctypes.data, norms[1].ctypes.data,
                          matrix(H * D, C, 1, 2, "Q4_K"), matrix(Hkv * D, C, 1, 2, "Q5_0"),
                          matrix(Hkv * D, C, 1, 2), matrix(C, H * D, 0, 2, "Q5_0"),
                          matrix(F, C, 0, 1, "Q4_K"), matrix(F, C, 0, 1, "Q5_0"),
                          matrix(C, F, 1, 1, "Q4_K"),
                          caches[0].ctypes.data, caches[1].ctypes.data, 3 * i, 0.25)
        angles = np.arange(cap)[:, None] * np.ones(D)[None]
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        work = np.empty(lib.qkv_step_work_floats(C, H, Hkv, D, F, 4) + 16, np.float32)
        final = np.ones(C, np.float32)
        aligned = (work.ctypes.data + 63) // 64 * 64
        rows = [4, 1, 1, 2, 1]  # a prompt, steps, two more rows: the cache's 9
        mask = lib.qkv_quant_variants()
        for variant in [v for v in range(4) if mask >> v & 1]:
            for nth in (1, 2):
                model = Model(variant, min(variant, 1), nth, nl, C, H, Hkv, D, F, cap, 1e-5,
                              1e-5, layers, final.ctypes.data, cos.ctypes.data,
                              sin.ctypes.data)
                for at, m in zip(np.cumsum([0] + rows[:-1]), rows):
                    x = rng.standard_normal((m, C)).astype(np.float32)
                    assert lib.qkv_step(ctypes.byref(model), x.ctypes.data, m, at, aligned) == 0
                    assert np.isfinite(x).all()
        print("clean")
    """)
    run_sanitized(script)
