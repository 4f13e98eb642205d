"""`qkv.load` and `Pretrained`: a real model with its tokenizer, ready to use and inspect.

>>> minilm = load("minilm")
>>> minilm.embed(["The bank of the river", "The bank lent me money"]).shape
torch.Size([2, 384])
>>> minilm.attentions("The bank of the river").weights.shape  # (L, H, T, T)
torch.Size([6, 12, 7, 7])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from qkv.attention.inputs import check_indices
from qkv.embed import embed as embed_sentences
from qkv.generate import Sampling, continuations, decode_steps, end_ids, seq2seq_steps
from qkv.generate.precision import FourBits, int4_loaded
from qkv.inspect.attentions import Attentions, check_weights_option, self_attentions
from qkv.inspect.generation import GenerationAttention, Recording, generate_recorded
from qkv.inspect.layer_heads import check_heads, heads_per_layer
from qkv.io.families import Family
from qkv.io.hf_folder import Pooling, save_folder
from qkv.io.load import load_source
from qkv.io.run_config import RunConfig
from qkv.io.runs import CONFIG
from qkv.models import Decoder, Encoder, EncoderDecoder, self_attention_stack
from qkv.models.config import Layers


class Pretrained:
    """A pretrained model, its tokenizer and its config. Made by `qkv.load`."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        config,
        *,
        family: Family,
        hf_config: dict,
        source: str,
        pooling: Pooling | None = None,
    ):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.family, self.hf_config, self.source = family, hf_config, source
        self.pooling = pooling
        self.run = None  # a training run's RunConfig, when loaded from a run folder
        # a .gguf file whose 4-bit matrices this model holds dequantized (set by `load`), and
        # generate's 4-bit copy of the model, made from them on first use
        self.four_bits = FourBits()

    @property
    def four_bit_file(self) -> Path | None:
        """The .gguf file whose 4-bit matrices this model holds dequantized, if any."""
        return self.four_bits.file

    def __repr__(self) -> str:
        params = sum(p.numel() for p in self.model.parameters())
        return f"Pretrained({self.source!r}, {self.family.name}, {params / 1e6:.1f}M parameters)"

    @property
    def context_window(self) -> int:
        """How many tokens the model reads at once. RoBERTa's positions start after its
        padding id (514 learned positions hold 512 tokens)."""
        padding = getattr(self.config, "position_padding", None)
        return self.config.max_positions - (0 if padding is None else padding + 1)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompt: str | Sequence[str],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stream: Callable[[int, str], None] | None = None,
        chat: bool = False,
        system: str | None = None,
        record: str | Sequence[int] | dict | Recording | None = None,
        precision: Literal["auto", "loaded", "int4"] = "auto",
    ) -> str | list[str] | GenerationAttention:
        """Continue a prompt (or each of a batch of prompts) with new text.

        temperature 0 is greedy; top_k and top_p narrow sampling; seed makes sampling
        repeatable. Generation ends at the end-of-sequence token, at any `stop` string (not
        included in the result) or after max_new_tokens. stream(row, text) receives text as
        it is made. chat: wrap the prompt in the model's chat template as a user message.
        record (a decoder and one prompt only): also keep the attention each generated token
        was chosen with, read from the layers' records as they decode (no second forward
        pass), and return a `GenerationAttention` (its `.text` the text returned otherwise):
        "all" layers and heads, a list of layers, or `Recording(layers=..., heads=...)`. What
        it keeps is bounded by qkv.inspect.generation.RECORD_MAX_BYTES, checked before any step.
        "summaries" (or `Recording(..., summaries=True)`) keeps each row's entropy, weight
        on token 0 and top keys instead of its weights: a few numbers per row, however long
        the prompt.
        Without record nothing is recorded: every step runs as it would otherwise.
        precision: the weights each step reads (`generation_model`). "auto" decodes a .gguf
        file's own 4-bit matrices in 4 bits on the CPU, as llama.cpp does (several times
        faster than their float32 copy, slightly different numbers), and otherwise the model
        as loaded; "loaded" is always the model as loaded (float32 unless load was told
        otherwise: transformers' numbers); "int4" asks for the 4-bit matrices by name. With
        `record`, "auto" is the model as loaded: what is recorded is what `attentions` shows.

        E.g. load("smollm2").generate("The river bank", 4, record=Recording([0, 29], [3]))
        .row(1) is (2, 1, 4): the second new token's attention over the 3 prompt tokens and
        the first new token, in layers 0 and 29, head 3.
        """
        seq2seq = isinstance(self.model, EncoderDecoder)
        if not isinstance(self.model, Decoder) and not seq2seq:
            raise ValueError(
                f"generate needs a decoder or encoder-decoder model; {self.source} is "
                f"{self.family.name}"
            )
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        sampling = Sampling(temperature, top_k, top_p, seed)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts:
            raise ValueError("no prompt given")
        if record is not None and (seq2seq or len(prompts) != 1):
            raise ValueError(
                "record keeps a decoder's attention over one prompt; "
                + (f"{self.source} is an encoder-decoder" if seq2seq else
                   f"{len(prompts)} prompts were given: generate them one at a time")
            )  # fmt: skip
        # what each step reads, checked before anything is encoded (an encoder-decoder's is
        # always the model as loaded: no .gguf file holds one)
        model, _ = self.generation_model(
            "loaded" if record is not None and precision == "auto" else precision
        )
        if seq2seq:
            return self._translate(prompts, sampling, max_new_tokens, list(stop), stream)
        if chat:
            prompts = [self.chat_prompt(p, system) for p in prompts]
        ids, mask = self.tokenizer.encode_batch(
            prompts, add_special_tokens=not chat, padding_side="left"
        )
        lengths = mask.sum(-1).tolist()
        if 0 in lengths:
            raise ValueError(
                f"prompt {lengths.index(0)} (counted from 0) is empty: it has no tokens to "
                "continue; give some text"
            )
        longest = int(max(lengths))
        if longest + max_new_tokens > self.context_window:
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds "
                f"{self.source}'s context window of {self.context_window} tokens"
            )
        if record is not None:
            return generate_recorded(
                model, ids, Recording.of(record), sampling, max_new_tokens,
                tokenizer=self.tokenizer, eos=end_ids(self.hf_config, self.tokenizer),
                stop=list(stop), stream=stream, source=self.source,
            )  # fmt: skip
        steps = decode_steps(model, ids, mask, sampling, max_new_tokens)
        return self._decode(steps, list(stop), stream, len(prompts))

    def generation_model(self, precision: str = "auto") -> tuple[nn.Module, str]:
        """The model `generate(precision=...)` decodes with, and why.

        "int4" is a copy of the model whose 4-bit matrices (the .gguf file's Q4_0 and Q4_1)
        stay 4-bit, its LM head 8-bit, as `load(..., int4=True)` makes it; it shares every
        other tensor with the model and is made once, on first use. "auto" takes it where
        the model was loaded from such a file onto the CPU and this torch has the int4
        kernel, and the model's weights have not changed since (any write torch counts: see
        `qkv.generate.precision.weights_state`); "loaded" is the model itself.
        """
        return self.four_bits.generation_model(self.model, self.family, self.config,
                                               self.source, precision)  # fmt: skip

    def _translate(self, sources, sampling, max_new_tokens, stop, stream) -> str | list[str]:
        """An encoder-decoder's output for each source: the encoder reads the source, the
        decoder writes a new text from its start token."""
        ids, mask = self.tokenizer.encode_batch(sources, padding_side="right")
        if ids.shape[1] > self.context_window or max_new_tokens > self.context_window:
            raise ValueError(
                f"{self.source} reads and writes at most {self.context_window} tokens; the "
                f"source has {ids.shape[1]}, max_new_tokens is {max_new_tokens}"
            )
        steps = seq2seq_steps(self.model, ids, mask, self.decoder_start(), sampling,
                              max_new_tokens)  # fmt: skip
        return self._decode(steps, stop, stream, len(sources))

    def chat_prompt(self, prompt: str, system: str | None = None) -> str:
        """`prompt` as a user message (after `system`'s, if any) in the model's chat
        template, ending where the assistant's answer begins: what generate(chat=True) reads."""
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _decode(self, steps, stop, stream, n) -> str | list[str]:
        eos = end_ids(self.hf_config, self.tokenizer)
        texts = [r.text for r in continuations(steps, self.tokenizer, eos, stop, stream, n)]
        return texts[0] if n == 1 else texts

    # ------------------------------------------------------------------ embeddings

    def embed(
        self,
        sentences: Sequence[str],
        *,
        batch_size: int = 64,
        precision: Literal["auto", "float32", "bfloat16"] = "auto",
    ) -> Tensor:
        """One vector per sentence (N, C), pooled and normalized as the model's config says.

        Sentences are sorted by length and batched, so padding costs little. precision
        "bfloat16" runs the matrix products in bfloat16 (norms, softmax and pooling stay
        float32): about twice as fast on CPUs with bfloat16 instructions, several times slower
        on others; "float32" is the arithmetic of transformers and sentence-transformers.
        "auto" takes bfloat16 where the CPU has bfloat16 instructions, else float32
        (`qkv.device.choose_precision`; the cosine of each to float32 stays above 0.9999).
        A sentence longer than the model reads (`max_sentence_tokens`: a sentence-transformers
        folder's max_seq_length, else the context window) is cut there, its [CLS] ... [SEP]
        kept, as sentence-transformers cuts it; a warning is logged saying which were cut.
        """
        if not isinstance(self.model, Encoder):
            raise ValueError(f"embed needs an encoder model; {self.source} is {self.family.name}")
        return embed_sentences(
            self.model, self.tokenizer, sentences, pooling=self.pooling or Pooling(),
            limit=self.max_sentence_tokens, source=self.source, batch_size=batch_size,
            precision=precision,
        )  # fmt: skip

    @property
    def max_sentence_tokens(self) -> int:
        """The most tokens `embed` reads of a sentence: a sentence-transformers folder's
        max_seq_length (256 for MiniLM, trained so), else the context window."""
        limit = self.pooling.max_length if self.pooling is not None else None
        return min(limit or self.context_window, self.context_window)

    # ------------------------------------------------------------------ inspection

    def encode(self, text: str):
        """The tokens of one text the model can read whole; a clear error if it cannot."""
        if not text.strip():
            raise ValueError("the text is empty; give a sentence")
        encoded = self.tokenizer.encode(text)
        if len(encoded.ids) > self.context_window:
            raise ValueError(
                f"the text has {len(encoded.ids)} tokens; {self.source} reads at most "
                f"{self.context_window}"
            )
        return encoded

    def decoder_start(self) -> int:
        """The token an encoder-decoder's decoder starts from: config.json's
        decoder_start_token_id; else, for T5 (whose config.json transformers 5 writes without
        one), the pad token T5 starts from; else the tokenizer's end-of-sequence token."""
        start = self.hf_config.get("decoder_start_token_id")
        if start is None and self.family.name == "t5":
            start = self.hf_config.get("pad_token_id", 0)
        start = self.tokenizer.eos_id if start is None else start
        if start is None:
            raise ValueError(f"{self.source} names no decoder_start_token_id in its config")
        return start

    def decoder_input(self, target: str) -> tuple[Tensor, list[str], object]:
        """What an encoder-decoder's decoder reads for `target`, as in training and in
        `generate`: its start token, then `target`'s tokens without special tokens.
        Returns ids (1, Tt), their tokens, and the Encoded of `target` (one token shorter:
        its token i is the decoder's token i + 1)."""
        start = self.decoder_start()
        if not target.strip():
            raise ValueError("the target text is empty; give the decoder's sentence")
        decoded = self.tokenizer.encode(target, add_special_tokens=False)
        ids = torch.tensor([[start, *decoded.ids]])  # (1, Tt)
        if ids.shape[1] > self.context_window:
            raise ValueError(
                f"the target has {ids.shape[1]} tokens with the start token; "
                f"{self.source} reads at most {self.context_window}"
            )
        tokens = [self.tokenizer.id_to_token(start) or str(start), *decoded.tokens]
        return ids, tokens, decoded

    def attentions(
        self,
        text: str,
        *,
        target: str | None = None,
        layers: Layers = "all",
        heads: Sequence[int] | None = None,
        weights: bool | None = None,
    ) -> Attentions:
        """One forward pass over `text`: every layer's record, and the weights (L, H, T, T).

        layers: the layers to record (all by default: "all" or None); heads: the heads
        `weights` shows (all by default); both counted from 0.
        weights: where `.weights` will be read, a decoder's weights of every head are best
        made in the forward pass itself, each layer's with its output in one pass over the
        scores (eager's arithmetic, faster than a fused pass followed by the weights' own
        pass); `.weights` then only hands them over. True makes them so; False keeps the
        records alone, and `.weights` computes from them when first read (for callers of a
        few rows or summaries: a long text's L x H x T x T floats are never all held then);
        None (the default) makes them where they take at most MADE_MAX_BYTES
        (`qkv.inspect.attentions`; 2 GiB: SmolLM2 up to 1,409 tokens), and keeps the records
        alone beyond.
        target (encoder-decoder models only): the decoder's cross-attention instead, weights
        (L, H, Tt, Ts) from the decoder's tokens (its start token, then `target`'s, as in
        training) to `text`'s. Without a target an encoder-decoder shows its encoder. E.g. a
        model that reverses sequences: attentions("a b c d", target="d c b a").query_tokens
        == ["</s>", "d", "c", "b", "a"], and its weights lie near the anti-diagonal.
        """
        seq2seq = isinstance(self.model, EncoderDecoder)
        check_weights_option(weights)
        if target is not None and not seq2seq:
            raise ValueError(
                f"a target text is for encoder-decoder models' cross-attention; {self.source} "
                f"is {self.family.name}"
            )
        if target is not None:  # cross-attention: the decoder's, over the encoder's output
            stack = self.model.decoder
        else:
            stack = self_attention_stack(self.model, "attentions", self.source)
        L = stack.config.num_layers
        every = layers is None or (isinstance(layers, str) and layers == "all")
        layers = check_indices("layer", None if every else layers, L, self.source)
        # each layer's own head count (Qwen3.5's linear layers have more); cross-attention's
        counts = heads_per_layer(stack) if target is None else [stack.config.block.num_heads] * L
        heads = check_heads(heads, layers, counts, self.source) if layers else []
        if not layers or not heads:
            raise ValueError("no layer or no head asked for; leave layers and heads out for all")
        encoded = self.encode(text)
        if target is None:
            return self_attentions(stack, encoded, layers, heads, weights)
        ids = torch.tensor([encoded.ids])  # (1, Ts)
        targets, queries, _ = self.decoder_input(target)
        with torch.inference_mode():
            records = self.model(ids, targets, cross_layers=layers).cross_records
        return Attentions(records, list(encoded.tokens), encoded, heads, queries)

    def save(self, folder: str | Path) -> None:
        """Export as a Hugging Face folder that `transformers` loads with equal outputs."""
        if int4_loaded(self.model):
            raise ValueError("a model loaded with int4=True cannot be exported; load it without")
        save_folder(Path(folder), self.model, self.family, self.config, self.hf_config,
                    self.tokenizer)  # fmt: skip


def load(
    source: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    backend: str | None = None,
    int4: bool = False,
) -> Pretrained:
    """A pretrained model from an embedded name, a folder, a .gguf file or a hub model id.

    source: "minilm" or "smollm2" (embedded, no network), a Hugging Face folder
    (config.json, model.safetensors or pytorch_model.bin, tokenizer.json), a .gguf file,
    a Hugging Face model id such as "gpt2" or "org/name" (downloaded once, then cached;
    offline mode is respected), or a qkv training-run folder (its last checkpoint; the
    run's config is `.run`). backend: the attention backend the model runs on.
    int4: keep a .gguf file's Q4_0/Q4_1 matrices in 4 bits and run them with torch's CPU
    int4 kernel (inputs rounded to bfloat16), the LM head in 8 bits (a scale per row): faster
    decoding, slightly different numbers.
    """
    loaded = load_source(source, dtype=dtype, backend=backend, int4=int4)
    pretrained = Pretrained(loaded.model, loaded.tokenizer, loaded.config, family=loaded.family,
                            hf_config=loaded.hf_config, source=loaded.source,
                            pooling=loaded.pooling)  # fmt: skip
    pretrained.four_bits = FourBits.of(loaded.four_bit_file, loaded.four_bit_digest)
    if loaded.run is not None:  # io finds a run's last checkpoint and reads its config
        pretrained.run = RunConfig.from_toml(loaded.run / CONFIG)
    return pretrained
