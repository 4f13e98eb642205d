"""The boxes of a model diagram, drawn from a stack config in the order the pass computes
them, each with the words that say what it computes (see `qkv.inspect.diagram`)."""

from __future__ import annotations

from dataclasses import dataclass

from qkv.inspect.anatomy import NORMS, experts_words, layer_anatomy
from qkv.models import DecoderConfig
from qkv.nn.mlps import GATED

MLP_NAMES = {"swiglu": "SwiGLU", "geglu": "GeGLU", "geglu_tanh": "GeGLU"}


@dataclass(frozen=True)
class Box:
    """One tensor of the pass. shape: "(B, T, C) = (1, 9, 384)"; size: its numbers (1, 9, 384);
    tensor: its name in qkv.cache's naming ("L{layer}.q"), None where no tensor is kept apart;
    explain: what it computes, in the article's words (the text alternative)."""

    id: str
    label: str
    shape: str
    step: str
    tensor: str | None
    explain: str
    size: tuple[int, ...] = ()


def _shape(dims) -> tuple[str, tuple[int, ...]]:
    """ "(B, T, C) = (1, 9, 384)" and (1, 9, 384) from (("B", 1), ("T", 9), ("C", 384))."""
    letters, numbers = zip(*dims, strict=True)
    return f"({', '.join(letters)}) = ({', '.join(map(str, numbers))})", tuple(numbers)


def _count(config, test) -> str:
    """ "" where every layer passes `test`, else " in 3 of 4 layers"."""
    n, L = sum(bool(test(i)) for i in range(config.num_layers)), config.num_layers
    return "" if n == L else f" in {n} of {L} layers"


class Drawing:
    """Boxes and edges, added in the order the pass computes them."""

    def __init__(self, batch: int, config):
        self.B, self.V, self.boxes, self.edges = batch, config.vocab_size, [], []

    def add(self, id, label, dims, step, tensor, explain, after=()) -> str:
        shape, size = _shape([("B", self.B), *dims])
        self.boxes.append(Box(id, label, shape, step, tensor, explain, size))
        self.edges.extend((source, id) for source in after)
        return id

    def stack(self, cfg, prefix: str, T, cross=None) -> str:
        """Draw one stack's inputs, its layer and its output; the id of its last box."""
        x = self.inputs(cfg, prefix, T)
        x = self.layer(cfg, prefix, T, x, cross)
        C, norm = cfg.block.width, NORMS.get(cfg.block.norm, cfg.block.norm)
        if cfg.has_final_norm:
            x = self.add(f"{prefix}final_norm", f"Final {norm}", [T, ("C", C)], "layers",
                         f"{prefix}final", f"The last layer's output, normalized ({norm}).",
                         [x])  # fmt: skip
        if isinstance(cfg, DecoderConfig):
            return self.head(cfg, T, x)
        if cfg.mlm_head:
            words = (
                "Each position's vector through a dense layer and a LayerNorm, then times "
                "the token matrix: a score for every word of the vocabulary."
            )
            return self.add(
                f"{prefix}logits",
                "MLM head → logits",
                [T, ("V", self.V)],
                "training",
                f"{prefix}logits",
                words,
                [x],
            )
        return x

    def inputs(self, cfg, prefix: str, T) -> str:
        C = ("C", cfg.block.width)
        role = "source" if prefix == "enc." else "target" if getattr(
            cfg, "cross_attention", False) else ""  # fmt: skip
        shifted = (" (read shifted right: the start token, then the target without its last "
                   "token)" if role == "target" else "")  # fmt: skip
        label = f"{role.capitalize()} tokens" if role else "Tokens"
        text = f"The {role} text" if role else "The text"
        x = self.add(f"{prefix}tokens", label, [T], "tokens", None,
                     f"{text} cut into {T[1]} tokens{shifted}, each one number: its id among "
                     f"the vocabulary's {self.V:,}.")  # fmt: skip
        boxes = []
        words = (
            f"Each token id picks its row of the token embedding matrix (V × C): {C[1]} "
            "numbers per token"
        )
        if cfg.embed_scale:
            words += f", multiplied by sqrt(C) = {cfg.block.width**0.5:.4g}"
        if cfg.type_vocab_size:
            words += ", plus a segment (token type) embedding"
        label = "Token embeddings" + (" × √C" if cfg.embed_scale else "")
        boxes.append([f"{prefix}embed", label, words + "."])
        if cfg.position in ("learned", "sinusoidal"):
            kind = ("learned (one row per position, up to "
                    f"{cfg.max_positions})" if cfg.position == "learned" else
                    "fixed sinusoids")  # fmt: skip
            boxes.append([f"{prefix}position", f"+ {cfg.position} positions",
                          f"A position embedding, {kind}, is added to each token's vector, so the "
                          "same word at another place gets another vector."])  # fmt: skip
        if cfg.embed_norm:
            norm = NORMS.get(cfg.block.norm, cfg.block.norm)
            boxes.append([f"{prefix}embed_norm", norm, f"The summed embeddings, normalized "
                          f"({norm}): what the first layer reads."])  # fmt: skip
        for n, (id, label, explain) in enumerate(boxes):
            last = n == len(boxes) - 1
            x = self.add(
                id, label, [T, C], "embeddings", f"{prefix}embed" if last else None, explain, [x]
            )
        return x

    def layer(self, cfg, prefix: str, T, x: str, cross) -> str:
        """One block of cfg, drawn once: its boxes are `{prefix}L.` and their tensors
        `{prefix}L{layer}.`; the id of the block's output box."""
        p, t = f"{prefix}L.", f"{prefix}L{{layer}}."
        block, a = cfg.block, layer_anatomy(cfg, 0)
        C, pos, norm = ("C", block.width), block.norm_position, NORMS.get(block.norm, block.norm)
        stream = self.add(f"{p}resid_pre", "Layer input x", [T, C], "layers", f"{t}resid_pre",
                          "The vector of each token entering this layer: the embeddings for the "
                          "first layer, the previous layer's output after it.", [x])  # fmt: skip
        reads = stream
        if pos == "pre":
            first = ("" if getattr(cfg, "first_attn_norm", True) else
                     " (not in the first layer, which reads the embeddings' norm)")  # fmt: skip
            reads = self.add(f"{p}norm_attn", norm, [T, C], "layers", f"{t}attn_in",
                             f"The layer input, normalized ({norm}) before attention reads "
                             f"it{first}.", [stream])  # fmt: skip
        attended = self.attention(cfg, p, t, T, T, reads, reads, a, "")
        if block.parallel:
            return self.feed_forward(cfg, p, t, T, stream, norm, attended)
        stream = self.add(f"{p}resid_mid", "x + attention", [T, C], "layers", f"{t}resid_mid",
                          "The attention's output added to the layer input (the residual "
                          "connection): the original vector is kept beside its context.",
                          [stream, attended])  # fmt: skip
        mlp_in = "mlp_in"
        if pos == "post":
            mlp_in = "cross_in" if cross else "mlp_in"
            stream = self.add(f"{p}norm_attn", norm, [T, C], "layers", f"{t}{mlp_in}",
                              f"The sum, normalized ({norm}) after attention (post-norm).",
                              [stream])  # fmt: skip
        if cross:
            stream = self.cross(cfg, p, t, T, stream, cross, norm)
        return self.feed_forward(cfg, p, t, T, stream, norm)

    def cross(self, cfg, p, t, T, stream: str, cross, norm: str) -> str:
        source, S = cross
        pos, C = cfg.block.norm_position, ("C", cfg.block.width)
        reads = stream
        if pos == "pre":
            reads = self.add(f"{p}norm_cross", norm, [T, C], "cross", f"{t}cross_in",
                             f"The stream, normalized ({norm}) before cross-attention reads it.",
                             [stream])  # fmt: skip
        a = layer_anatomy(cfg, 0, cross=True)
        attended = self.attention(cfg, p, t, T, S, reads, source, a, "cross_")
        stream = self.add(f"{p}resid_cross", "x + cross-attention", [T, C], "cross",
                          f"{t}resid_cross", "The cross-attention's output added to the stream "
                          "(the residual connection).", [stream, attended])  # fmt: skip
        if pos == "post":
            stream = self.add(f"{p}norm_cross", norm, [T, C], "cross", f"{t}mlp_in",
                              f"The sum, normalized ({norm}) after cross-attention (post-norm).",
                              [stream])  # fmt: skip
        return stream

    def attention(self, cfg, p, t, Tq, Tk, reads, keys_from, a, kind: str) -> str:
        """Queries from `reads`, keys and values from `keys_from` (the same box but in
        cross-attention); the id of the box whose output joins the stream."""
        block, cross = cfg.block, kind == "cross_"
        H, Hkv, D = ("H", block.num_heads), ("Hkv", block.kv_heads), ("D", a.head_dim)
        if Hkv[1] == H[1]:
            Hkv = ("H", H[1])
        step = "cross" if cross else "qkv"
        source = "the encoder's output" if cross else "the layer's input"
        shared = (f"; {Hkv[1]} key/value heads, each shared by {H[1] // Hkv[1]} query heads "
                  "(grouped-query attention)" if Hkv[0] == "Hkv" else "")  # fmt: skip
        normed = ", normalized per head (QK-norm)" if a.qk_norm in ("head", "full") else ""
        turns = cfg.position == "rotary" and not cross
        before = "_before_rotary" if turns else ""
        q = self.add(f"{p}{kind}q", "Queries q = x W_Q", [H, Tq, D], step, f"{t}{kind}q{before}",
                     f"Each token's vector times the query matrix W_Q, split into {H[1]} heads "
                     f"of {D[1]} numbers{normed}: what each word is looking for.",
                     [reads])  # fmt: skip
        k = self.add(f"{p}{kind}k", "Keys k = x W_K", [Hkv, Tk, D], step, f"{t}{kind}k{before}",
                     f"The vectors of {source} times the key matrix W_K{normed}{shared}: what "
                     "each word offers to be found by.", [keys_from])  # fmt: skip
        v = self.add(f"{p}{kind}v", "Values v = x W_V", [Hkv, Tk, D], step, f"{t}{kind}v",
                     f"The vectors of {source} times the value matrix W_V{shared}: what each "
                     "word passes on when it is attended to.", [keys_from])  # fmt: skip
        scores_from = [q, k]
        if turns:
            base = f"base {cfg.rope_base:g}"
            if cfg.local_rope_base is not None:
                base += f", sliding layers' base {cfg.local_rope_base:g}"
            if cfg.rope_scaling is not None:
                base += f", scaled {cfg.rope_scaling.kind} x{cfg.rope_scaling.factor:g}"
            if a.rope_dims:
                base += f"; {a.rope_dims} of {D[1]} numbers turn"
            where = _count(cfg, cfg.turns)
            turn = (f"Rotary positions turn each pair of numbers by an angle that grows with the "
                    f"token's position ({base}){where}, so q·k depends on how far apart the "
                    "words are; nothing is added to the token vectors.")  # fmt: skip
            if a.qk_norm == "l2":
                turn = turn[:-1] + "; then each is scaled to length 1 (L2 QK-norm)."
            scores_from = [
                self.add(f"{p}q_rotary", "Rotary q", [H, Tq, D], "embeddings", f"{t}q", turn, [q]),
                self.add(f"{p}k_rotary", "Rotary k", [Hkv, Tk, D], "embeddings", f"{t}k", turn,
                         [k]),
            ]  # fmt: skip
        scores = self.scores(cfg, p, t, H, Tq, Tk, scores_from, a, kind)
        weights = self.add(f"{p}{kind}weights", "Weights = softmax", [H, Tq, Tk],
                           "cross" if cross else "scaling", f"{t}{kind}weights",
                           _softmax_words(cfg, a, cross), [scores])  # fmt: skip
        z = self.add(f"{p}{kind}z", "z = weights · v", [H, Tq, D], step, f"{t}{kind}z",
                     "Each head's value vectors scaled by their weights and summed: the word's "
                     "vector with context, one per head.", [weights, v])  # fmt: skip
        heads = "cross" if cross else "heads"
        concat = self.add(f"{p}{kind}concat", "Concatenate heads", [Tq, ("H·D", H[1] * D[1])],
                          heads, None, f"The {H[1]} heads' outputs side by side: one vector of "
                          f"{H[1] * D[1]} numbers per token.", [z])  # fmt: skip
        out = "attn_out" if not cross else "cross_out"
        sublayer = block.sublayer_norm
        o = self.add(f"{p}{kind}o", "Project: · W_O", [Tq, ("C", block.width)], heads,
                     None if sublayer else f"{t}{out}", "The concatenated heads times the "
                     "output matrix W_O, back to the model's width C.", [concat])  # fmt: skip
        if sublayer:
            norm = NORMS.get(block.norm, block.norm)
            id = f"{p}norm_{kind or 'attn_'}out"
            o = self.add(id, norm, [Tq, ("C", block.width)], heads, f"{t}{out}",
                         f"The attention's output, normalized ({norm}) before it is added "
                         "to the stream.", [o])  # fmt: skip
        return o

    def scores(self, cfg, p, t, H, Tq, Tk, after, a, kind: str) -> str:
        D = a.head_dim
        if a.scale_divisor is None:
            label, words = "Scores q·k/√D", f"divided by sqrt(D) = sqrt({D})"
        elif a.scale_divisor == 1:
            label, words = "Scores q·k", "not divided by sqrt(D): the scale is 1 (folded into W_Q)"
        else:
            label, words = "Scores q·k/√d", f"divided by sqrt({a.scale_divisor:g}), not sqrt(D)"
        if cfg.block.temperature is not None and not kind:
            where = _count(cfg, lambda i: cfg.block_for(i).temperature)
            words += f", times a temperature growing with the query's position{where}"
        if a.softcap is not None:
            words += f", then capped: {a.softcap:g} · tanh(score / {a.softcap:g})"
        step, itself = ("cross", "") if kind else ("scaling", ", each word with itself too")
        scores = self.add(f"{p}{kind}scores", label, [H, Tq, Tk], step, f"{t}{kind}scores",
                          f"One dot product for every pair of words (query · key{itself}), "
                          f"{words}.", after)  # fmt: skip
        if not a.relative_bias:
            return scores
        return self.add(f"{p}position_bias", "+ relative position bias", [H, Tq, Tk],
                        "embeddings", f"{t}bias", "A learned number for each head and each "
                        f"distance between query and key ({cfg.relative_buckets} buckets, up to "
                        f"{cfg.relative_max_distance} tokens) added to the scores: T5's only "
                        "positions.", [scores])  # fmt: skip

    def feed_forward(self, cfg, p, t, T, stream: str, norm: str, beside: str | None = None) -> str:
        """The MLP and its residual sum; `beside`: a parallel block's attention output, added
        in the same sum (the MLP then reads the layer input too)."""
        block, C = cfg.block, ("C", cfg.block.width)
        pos = block.norm_position
        reads = stream
        if pos == "pre":
            what = "The layer input (beside attention)" if beside else "The stream"
            reads = self.add(f"{p}norm_mlp", norm, [T, C], "layers", f"{t}mlp_in",
                             f"{what}, normalized ({norm}) before the MLP reads it.",
                             [stream])  # fmt: skip
        hidden = block.mlp_hidden or 4 * block.width
        if block.experts is not None:
            label = "Experts (MoE)"
            words = (f"A mixture of experts{_count(cfg, lambda i: cfg.block_for(i).experts)}: "
                     f"{experts_words(block.experts)}; each token's vector goes through the "
                     "experts its router chose.")  # fmt: skip
        elif block.mlp in GATED:
            label = f"{MLP_NAMES[block.mlp]} MLP"
            words = (f"Each token's vector alone: {GATED[block.mlp]}(x W_gate) times x W_up "
                     f"({hidden} numbers), narrowed back to C by W_down.")  # fmt: skip
        else:
            label = "MLP"
            words = (f"Each token's vector alone: widened to {hidden} numbers, through "
                     f"{block.mlp}, narrowed back to C.")  # fmt: skip
        sublayer = block.sublayer_norm
        mlp = self.add(
            f"{p}mlp", label, [T, C], "layers", None if sublayer else f"{t}mlp_out", words, [reads]
        )
        if sublayer:
            mlp = self.add(f"{p}norm_mlp_out", norm, [T, C], "layers", f"{t}mlp_out",
                           f"The MLP's output, normalized ({norm}) before it is added to the "
                           "stream.", [mlp])  # fmt: skip
        if beside:
            return self.add(f"{p}resid_post", "x + attention + MLP", [T, C], "layers",
                            f"{t}resid_post", "Attention and the MLP both read the layer input "
                            "(a parallel block); both outputs are added to it: this layer's "
                            "output, the next layer's input.", [stream, beside, mlp])  # fmt: skip
        if pos != "post":
            return self.add(f"{p}resid_post", "x + MLP", [T, C], "layers", f"{t}resid_post",
                            "The MLP's output added to the stream: this layer's output, the "
                            "next layer's input.", [stream, mlp])  # fmt: skip
        total = self.add(f"{p}add_mlp", "x + MLP", [T, C], "layers", None,
                         "The MLP's output added to the stream (the residual connection).",
                         [stream, mlp])  # fmt: skip
        return self.add(f"{p}norm_mlp", norm, [T, C], "layers", f"{t}resid_post",
                        f"The sum, normalized ({norm}) after the MLP (post-norm): this layer's "
                        "output, the next layer's input.", [total])  # fmt: skip

    def head(self, cfg, T, x: str) -> str:
        matrix = ("the token embedding matrix (tied)" if cfg.tie_embeddings else
                  "the LM head's own matrix")  # fmt: skip
        words = (
            f"Each position's vector times {matrix}: a score for every word of the "
            "vocabulary as the next token"
        )
        if cfg.head_scale is not None:
            words += f" (the vectors scaled by {cfg.head_scale:.4g} first)"
        if cfg.logit_softcap is not None:
            words += f", capped: {cfg.logit_softcap:g} · tanh(logit / {cfg.logit_softcap:g})"
        words += "; training lowers the cross-entropy of the true next token."
        return self.add(
            "logits", "LM head → logits", [T, ("V", self.V)], "training", "logits", words, [x]
        )


def _softmax_words(cfg, a, cross: bool) -> str:
    words = "Softmax over the keys: each query's scores become weights that sum to one"
    if a.causal:
        words += "; a token sees only itself and the tokens before it (causal mask)"
    if cross:
        words += "; the target's tokens (queries) over the source's tokens (keys)"
    if not cross and cfg.block.window is not None:
        where = _count(cfg, lambda i: cfg.layer_type(i) == "sliding")
        words += f"; only the last {cfg.block.window} tokens{where} (a sliding window)"
    if cfg.block.chunk is not None and not cross:
        where = _count(cfg, lambda i: cfg.layer_type(i) == "chunked")
        words += f"; only the query's own chunk of {cfg.block.chunk} tokens{where}"
    if a.sinks:
        words += "; a learned sink per head takes part of each query's weight"
    return words + "."
