"""`qkv.load` and `Pretrained`: a real model with its tokenizer, ready to use and inspect.

>>> minilm = load("minilm")
>>> minilm.embed(["The bank of the river", "The bank lent me money"]).shape
torch.Size([2, 384])
>>> minilm.attentions("The bank of the river").weights.shape  # (L, H, T, T)
torch.Size([6, 12, 7, 7])
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from qkv.attention.eager import compute_dtype
from qkv.attention.inputs import check_indices
from qkv.generate import (
    GenerationAttention,
    Recording,
    RowKeeper,
    Sampling,
    SummaryKeeper,
    check_recording_size,
    decode_steps,
    seq2seq_steps,
)
from qkv.io.families import Family
from qkv.io.hf import Pooling, save_folder
from qkv.models import Decoder, Encoder, EncoderDecoder
from qkv.models.config import Layers
from qkv.nn import AttentionRecord

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Attentions:
    """One forward pass over one text, and what the attention of each layer asked computed.

    Or an encoder-decoder's cross-attention, from a target text's tokens (the queries) to the
    source text's (the keys). Every number is read from the layers' records (AttentionRecord):
    q, k, v, mask and scale as the model's backend received them.
    """

    records: dict[int, AttentionRecord]  # layer -> what its attention computed
    tokens: list[str]  # the key tokens: the text's, the source's for cross-attention
    encoded: object  # the tokenizer's Encoded of `tokens`: offsets, words, find("bank#2")
    heads: list[int]  # the query heads `weights` shows, counted from 0
    query_tokens: list[str] | None = None  # cross-attention: the decoder's, start token first
    made: Tensor | None = None  # (L', H, Tq, Tk): the weights the forward pass made, if any

    @property
    def layers(self) -> list[int]:
        """The layers recorded, counted from 0, in the order `weights` stacks them."""
        return sorted(self.records)

    @property
    def pieces(self) -> list[str]:
        """The key tokens as people read them, what pages and plots show (`Encoded.pieces`:
        " river", not "Ġriver"; a byte of a character split over tokens as <0xE6>, never
        U+FFFD), where the tokenizer tells them; the vocabulary's names otherwise."""
        return getattr(self.encoded, "pieces", None) or list(self.tokens)

    @functools.cached_property
    def weights(self) -> Tensor:
        """(L', H', Tq, Tk) float32 for `layers` and `heads`: row i is query token i's
        attention over the keys (T x T over one text)."""
        from qkv.attention.eager import weights_into

        out = self.made  # filled a layer at a time: never two copies of the weights at once
        for i, layer in enumerate(self.layers):
            record = self.records[layer]
            if record.made is not None:
                continue  # made in out[i] by the forward pass
            if out is None:
                s = record.shape
                out = record.q.new_empty(len(self.layers), len(self.heads), s.Tq, s.Tk,
                                         dtype=compute_dtype(record.q.dtype))  # fmt: skip
            plain = (record.lse is None and record.mask is None and record.window is None
                     and record.softcap is None and record.bias is None)  # fmt: skip
            if plain and record.q.shape[0] == 1 and self.heads == list(range(record.shape.H)):
                weights_into(out[i], record.q, record.k, causal=record.causal,
                             scale=record.scale)  # fmt: skip
            else:
                out[i] = record.weights(self.heads)[0]  # (H', Tq, Tk)
        return out

    @property
    def scale(self) -> float:
        """The factor every recorded layer put on its dot products (1/sqrt(D) in the article)."""
        return self._same("scale")

    @property
    def causal(self) -> bool:
        """Whether every recorded layer hid the keys after each query (a decoder)."""
        return self._same("causal")

    def _same(self, name: str):
        found = {getattr(record, name) for record in self.records.values()}
        if len(found) != 1:
            raise ValueError(f"the layers differ in {name} ({sorted(found)}); ask one layer's")
        return found.pop()

    def vectors(self) -> tuple[Tensor, Tensor, Tensor]:
        """Every recorded layer's and head's q, k and v over the text: (L', H, T, D) each.

        The vectors attention received (after rotary rotation), with grouped key/value heads
        repeated so that query head h sits beside the key/value head it reads: any pair's
        steps can be redone from them (weights = softmax(q k^T * scale), masked as `allowed`).
        A layer whose scores are more than that (a soft-cap, a score bias) is refused by name:
        its pairs are `record.steps()`.
        """
        beyond = [n for n in self.layers if self.records[n].softcap is not None
                  or self.records[n].bias is not None]  # fmt: skip
        if beyond:
            raise ValueError(
                f"layer {beyond[0]} caps its scores or adds a bias to them, so q, k and v alone "
                "do not redo its pairs; use records[layer].steps(head, query)"
            )
        qs, ks, vs = [], [], []
        for layer in self.layers:
            record = self.records[layer]
            group = record.shape.group
            qs.append(record.q[0])  # (H, T, D)
            ks.append(record.k[0].repeat_interleave(group, dim=0))  # query head h reads h // group
            vs.append(record.v[0].repeat_interleave(group, dim=0))
        return torch.stack(qs), torch.stack(ks), torch.stack(vs)

    def __repr__(self) -> str:
        from qkv.viz.notebook import attentions_repr

        return attentions_repr(self)

    def _repr_html_(self) -> str:
        """How Jupyter shows it (see qkv.viz.notebook): self-contained, nothing fetched."""
        from qkv.viz.notebook import attentions_html

        return attentions_html(self)


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
        # a .gguf file whose 4-bit matrices this model holds dequantized, and its size and
        # modification time when it was read (set by `load`)
        self.four_bit_file: Path | None = None
        self._four_bit_stamp: tuple | None = None
        self._four_bit_digest = ""  # the file's SHA-256 when loaded: its int4 cache's name
        # generate's 4-bit copy, made on first use, and the model's weights it was made from
        self._int4: tuple[nn.Module, tuple] | None = None

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
        it keeps is bounded by qkv.generate.RECORD_MAX_BYTES, checked before any step.
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
            prompts = [self._chat(p, system) for p in prompts]
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
            return self._generate_recorded(model, ids, Recording.of(record), sampling,
                                           max_new_tokens, list(stop), stream)  # fmt: skip
        steps = decode_steps(model, ids, mask, sampling, max_new_tokens)
        return self._decode(steps, list(stop), stream, len(prompts))

    def generation_model(self, precision: str = "auto") -> tuple[nn.Module, str]:
        """The model `generate(precision=...)` decodes with, and why.

        "int4" is a copy of the model whose 4-bit matrices (the .gguf file's Q4_0 and Q4_1)
        stay 4-bit, its LM head 8-bit, as `load(..., int4=True)` makes it; it shares every
        other tensor with the model and is made once, on first use. "auto" takes it where
        the model was loaded from such a file onto the CPU and this torch has the int4
        kernel, and the model's weights have not changed since (any write torch counts: see
        `_weights_state`); "loaded" is the model itself.
        """
        if precision not in ("auto", "loaded", "int4"):
            raise ValueError(f"precision must be 'auto', 'loaded' or 'int4', got {precision!r}")
        if self._int4_loaded():
            return self.model, "the model as loaded with int4=True"
        if precision == "loaded":
            return self.model, "the model as loaded, as asked"
        lacks = self._why_not_int4()
        if lacks is not None:
            if precision == "int4":
                raise ValueError(f"precision='int4' cannot be given here: {lacks}")
            return self.model, f"the model as loaded ({lacks})"
        if self._int4 is None:
            self._int4 = self._four_bit_copy(), _weights_state(self.model)
        return self._int4[0], f"{self.four_bit_file.name}'s own 4-bit matrices, in 4 bits"

    def _why_not_int4(self) -> str | None:
        from qkv.nn.quantized import int4_available

        parameter = next(self.model.parameters())
        if self.four_bit_file is None:
            return f"{self.source} is not a .gguf file with 4-bit matrices"
        if not int4_available():
            return f"torch {torch.__version__} has no CPU int4 kernel"
        if parameter.device.type != "cpu":
            return "the model is not on the CPU"
        if parameter.dtype != torch.float32:
            return f"the model is {parameter.dtype}, not float32"
        if self._int4 is not None and self._int4[1] != _weights_state(self.model):
            # the file's 4-bit matrices are no longer this model's weights
            return "the model's weights have changed since it was loaded"
        if self._int4 is None and _stamp(self.four_bit_file) != self._four_bit_stamp:
            return f"{self.four_bit_file.name} has changed on disk since it was loaded"
        return None

    def _int4_loaded(self) -> bool:
        from qkv.nn.quantized import Int4Linear

        return any(isinstance(m, Int4Linear) for m in self.model.modules())

    def _four_bit_copy(self) -> nn.Module:
        """The model with the file's 4-bit matrices swapped in, sharing every other tensor:
        from the cache of an earlier process where there is one (`qkv.io.int4_cache`)."""
        import copy

        from qkv.io import int4_cache
        from qkv.io.gguf import default_cache_dir, read_int4
        from qkv.io.load import use_int4

        shared = {id(t): t for t in (*self.model.parameters(), *self.model.buffers())}
        twin = copy.deepcopy(self.model, shared)  # the modules copied, their tensors not
        cache = None
        if self._four_bit_digest:
            cache = int4_cache.cache_path(self._four_bit_digest, default_cache_dir())
            if int4_cache.restore(twin, cache):
                return twin.eval()
        use_int4(twin, self.family, self.config, read_int4(self.four_bit_file), self.source)
        if cache is not None:
            int4_cache.store(twin, cache)
        return twin.eval()

    def _generate_recorded(self, model, ids, recording, sampling, max_new_tokens, stop, stream):
        """generate for one prompt ids (1, P), keeping the attention rows `recording` asks."""
        cfg = model.config
        layers, heads = recording.resolve(cfg.num_layers, cfg.block.num_heads, self.source)
        if recording.summaries:  # a few numbers per row: the prompt's are summarized in chunks
            keeper = SummaryKeeper(layers, heads, recording.top_k)
        else:
            itemsize = 8 if next(model.parameters()).dtype == torch.float64 else 4
            check_recording_size(len(layers), len(heads), ids.shape[1], max_new_tokens, itemsize)
            keeper = RowKeeper(layers, heads)
        chosen = []

        def steps():
            for token in decode_steps(model, ids, None, sampling, max_new_tokens,
                                      layers=layers, keep=keeper):  # fmt: skip
                chosen.append(int(token[0]))
                yield token

        (continuation,) = self._continue(steps(), stop, stream, 1)
        if continuation.within is not None:  # a stop string: the text's tokens, none after
            del chosen[continuation.within :]
        every = ids[0].tolist() + chosen
        P = ids.shape[1]
        return GenerationAttention(
            continuation.text, every, [self.tokenizer.id_to_token(i) or str(i) for i in every],
            self.tokenizer.pieces(every), P, layers, heads, *(
                (None, [], keeper.summaries().first(P - 1 + len(chosen)))
                if recording.summaries else (keeper.prompt, keeper.steps[: len(chosen) - 1])),
        )  # fmt: skip

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

    def _chat(self, prompt: str, system: str | None) -> str:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _decode(self, steps, stop, stream, n) -> str | list[str]:
        texts = [r.text for r in self._continue(steps, stop, stream, n)]
        return texts[0] if n == 1 else texts

    def _continue(self, steps, stop, stream, n) -> list[_Continuation]:
        """Each of n sequences' text as `steps` give its tokens, to the end-of-sequence token,
        a stop string or the last step; pieces streamed as they are certain."""
        rows = [_Continuation(self.tokenizer.stream(), stop) for _ in range(n)]

        def emit(row: int, piece: str) -> None:
            if stream is not None and piece:
                stream(row, piece)

        eos = self._eos_ids()
        for tokens in steps:
            for row, token in enumerate(tokens.tolist()):
                if not rows[row].done:
                    emit(row, rows[row].finish() if token in eos else rows[row].push(token))
            if all(r.done for r in rows):
                break
        for row, continuation in enumerate(rows):  # text held back for a partial character
            if not continuation.done:
                emit(row, continuation.finish())
        return rows

    def _eos_ids(self) -> set[int]:
        ids = self.hf_config.get("eos_token_id")
        ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
        if self.tokenizer.eos_id is not None:
            ids.add(self.tokenizer.eos_id)
        return ids

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
        (`qkv.cpu.choose_precision`; the cosine of each to float32 stays above 0.9999).
        A sentence longer than the model reads (`max_sentence_tokens`: a sentence-transformers
        folder's max_seq_length, else the context window) is cut there, its [CLS] ... [SEP]
        kept, as sentence-transformers cuts it; a warning is logged saying which were cut.
        """
        if not isinstance(self.model, Encoder):
            raise ValueError(f"embed needs an encoder model; {self.source} is {self.family.name}")
        if precision not in ("auto", "float32", "bfloat16"):
            raise ValueError(
                f"precision must be 'auto', 'float32' or 'bfloat16', got {precision!r}"
            )
        if precision == "auto":
            from qkv.device import choose_precision

            precision = choose_precision()[0]
        if isinstance(sentences, str):
            sentences = [sentences]
        pooling = self.pooling or Pooling()
        limit = self.max_sentence_tokens
        rows_ids, lengths = self.tokenizer.encode_ids(sentences, max_length=limit)
        cut = [i for i, n in enumerate(lengths) if n > limit]
        if cut:
            listed = ", ".join(map(str, cut[:10])) + (" ..." if len(cut) > 10 else "")
            logger.warning(
                "%s reads %d tokens of a sentence; %d of %d sentences were longer and were cut "
                "there (sentences %s, counted from 0)", self.source, limit, len(cut),
                len(sentences), listed,
            )  # fmt: skip
        order = sorted(range(len(sentences)), key=lambda i: -len(rows_ids[i]))
        out = torch.empty(len(sentences), self.config.block.width)
        lower = precision == "bfloat16"
        with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=lower):
            for start in range(0, len(order), batch_size):
                rows = order[start : start + batch_size]
                ids, mask = self.tokenizer.pad([rows_ids[i] for i in rows])  # (B, T)
                padded = None if bool(mask.all()) else mask  # unpadded: the unmasked kernel
                hidden = self.model(ids, attention_mask=padded).hidden.float()  # (B, T, C)
                out[rows] = pool(hidden, mask, pooling)
        return out

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
        None (the default) makes them where they take at most MADE_MAX_BYTES (2 GiB:
        SmolLM2 up to 1,409 tokens), and keeps the records alone beyond.
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
        stack = self.model.decoder if target is not None else self.model
        stack = stack.encoder if isinstance(stack, EncoderDecoder) else stack
        L, H = stack.config.num_layers, stack.config.block.num_heads
        every = layers is None or (isinstance(layers, str) and layers == "all")
        layers = range(L) if every else check_indices("layer", layers, L, self.source)
        heads = check_indices("head", range(H) if heads is None else heads, H, self.source)
        if not layers or not heads:
            raise ValueError("no layer or no head asked for; leave layers and heads out for all")
        encoded = self.encode(text)
        ids = torch.tensor([encoded.ids])  # (1, Ts)
        if target is not None:
            targets, queries, _ = self.decoder_input(target)
            with torch.inference_mode():
                records = self.model(ids, targets, cross_layers=layers).cross_records
            return Attentions(records, list(encoded.tokens), encoded, heads, queries)
        # made outside inference mode, so that `.weights` may fill a layer the pass did not
        made = _made_for(stack, weights, len(layers), heads, ids.shape[1])
        with torch.inference_mode():
            if made is not None:
                records = stack(ids, layers=layers, logits=False, weights=made).records
            else:
                records = stack(ids, layers=layers, logits=False).records
        return Attentions(records, list(encoded.tokens), encoded, heads, made=made)

    def save(self, folder: str | Path) -> None:
        """Export as a Hugging Face folder that `transformers` loads with equal outputs."""
        from qkv.nn.quantized import Int4Linear

        if any(isinstance(m, Int4Linear) for m in self.model.modules()):
            raise ValueError("a model loaded with int4=True cannot be exported; load it without")
        save_folder(Path(folder), self.model, self.family, self.config, self.hf_config,
                    self.tokenizer)  # fmt: skip


MADE_MAX_BYTES = 2**31  # the most `attentions(weights=None)` makes in the forward pass


def check_weights_option(weights) -> None:
    """`attentions(weights=...)` takes True, False or None; anything else is refused."""
    if weights is not None and type(weights) is not bool:
        raise ValueError(f"weights must be True, False or None (made up to "
                         f"{MADE_MAX_BYTES // 2**30} GiB), not {weights!r}")  # fmt: skip


def _made_for(stack: nn.Module, weights: bool | None, L: int, heads: list[int],
              T: int) -> Tensor | None:  # fmt: skip
    """The (L, H, T, T) tensor a decoder's forward pass makes its weights in for
    `attentions`, or None: where weights are not wanted (or not by default at this size),
    some heads only are asked, or the model is not a decoder on the CPU (see `attentions`)."""
    first = next(stack.parameters())
    dtype, H = compute_dtype(first.dtype), len(heads)
    if not isinstance(stack, Decoder) or first.device.type != "cpu" or weights is False:
        return None
    if heads != list(range(stack.config.block.num_heads)):
        return None
    size = L * H * T * T * torch.finfo(dtype).bits // 8
    if weights is None and size > MADE_MAX_BYTES:
        return None
    return torch.empty(L, H, T, T, dtype=dtype)


def _stamp(path: Path | None) -> tuple | None:
    """A file's size and modification time: what tells that it was written again."""
    if path is None:
        return None
    try:
        stat = path.stat()
    except OSError:
        return ("gone",)
    return stat.st_size, stat.st_mtime_ns


def _weights_state(model: nn.Module) -> tuple:
    """Which tensors the model's weights are, where their memory is and how often each was
    written in place: an optimizer step, a load_state_dict, a swapped parameter or its
    `.data` replaced change it. (A write into `p.data` itself is counted nowhere in torch.)"""
    state = []
    for p in model.parameters():
        try:
            version = p._version
        except RuntimeError:  # an inference tensor keeps no count: never taken as unchanged
            version = object()
        state.append((id(p), p.data_ptr(), version))
    return tuple(state)


class _Continuation:
    """The text one sequence has generated so far, cut at the first stop string.

    Text that might be the start of a stop string is held back from the stream until the
    next tokens tell, so a stream never shows text that the result will not contain.
    """

    def __init__(self, stream, stop: list[str]):
        self.stream, self.stop = stream, [s for s in stop if s]
        self.text, self.emitted, self.done = "", 0, False
        self.ends: list[int] = []  # the text's length after each token, before any cut
        self.within: int | None = None  # after a stop string: how many tokens the text holds

    def push(self, token: int) -> str:
        """Add a token; return the text that is now certain (possibly empty)."""
        piece = self.stream.push(token)
        self.ends.append(len(self.text) + len(piece))
        return self._add(piece, final=False)

    def finish(self) -> str:
        """End the sequence: return whatever was held back."""
        piece = self._add(self.stream.finish(), final=True)
        self.done = True
        return piece

    def _add(self, piece: str, final: bool) -> str:
        text = self.text + piece
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:  # a stop string: keep what came before it, and stop
            text, self.done, final = text[:cut], True, True
            self.within = sum(end <= cut for end in self.ends)  # the tokens wholly before it
        held = 0 if final else max((_overlap(text, s) for s in self.stop), default=0)
        self.text = text
        out, self.emitted = text[self.emitted : len(text) - held], len(text) - held
        return out


def _overlap(text: str, stop: str) -> int:
    """How many last characters of text begin `stop` (at most len(stop) - 1)."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def pool(hidden: Tensor, mask: Tensor, pooling: Pooling) -> Tensor:
    """Token vectors (B, T, C) with mask (B, T) -> sentence vectors (B, C)."""
    real = mask.to(hidden.dtype)[..., None]  # (B, T, 1)
    if pooling.mode == "mean":
        vectors = (hidden * real).sum(1) / real.sum(1).clamp(min=1e-9)
    elif pooling.mode == "cls":
        vectors = hidden[:, 0]
    else:
        vectors = hidden.masked_fill(real == 0, float("-inf")).max(1).values
    return torch.nn.functional.normalize(vectors, dim=-1) if pooling.normalize else vectors


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
    from qkv.io.load import load_source

    loaded = load_source(source, dtype=dtype, backend=backend, int4=int4)
    pretrained = Pretrained(loaded.model, loaded.tokenizer, loaded.config, family=loaded.family,
                            hf_config=loaded.hf_config, source=loaded.source,
                            pooling=loaded.pooling)  # fmt: skip
    pretrained.four_bit_file = loaded.four_bit_file
    pretrained._four_bit_stamp = _stamp(loaded.four_bit_file)
    pretrained._four_bit_digest = loaded.four_bit_digest
    if loaded.run is not None:
        # io finds a run's checkpoint; its RunConfig is train's to parse (io never imports train)
        from qkv.io.runs import CONFIG
        from qkv.train.config import RunConfig

        pretrained.run = RunConfig.from_toml(loaded.run / CONFIG)
    return pretrained
