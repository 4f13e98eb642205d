"""Linear attention: a running memory instead of a softmax over every key (the gated delta rule).

Qwen3.5's Gated DeltaNet layers and Kimi Linear's KDA layers do not compare a query with every
key. Each head keeps a memory S, a (Dk, Dv) matrix, and for each token in order:

- every earlier memory fades by g_t (one factor per head, or one per key channel in KDA);
- the memory is asked what it already holds under the token's key, S^T k_t, and the
  difference to the token's value is written under the key with strength beta_t:
  S_t = (I - beta_t k_t k_t^T) diag(g_t) S_{t-1} + beta_t k_t v_t^T;
- the token's query reads the memory: o_t = scale * S_t^T q_t.

The article's question, how much does key word j give query word t, still has an exact answer,
because o_t is a sum of the values: o_t = sum over j <= t of a_tj v_j, with the **effective
weight** a_tj = beta_j k_j^T M_{j+1}^T ... M_t^T q_t scale, M_i = (I - beta_i k_i k_i^T) diag(g_i).
It is signed and does not sum to 1: there is no softmax. `effective_weights` computes every
a_tj without a (T, T, D, D) tensor, by running the rule on the identity's rows as values (o is
linear in v, so the rows of the identity come back as the rows of the weights).

Three forms compute the same rule, `form=` in `delta_rule`:
- "loop": `loop_memory.remember`'s words, one token at a time in float64; the oracle;
- "recurrent": the same recurrence on whole tensors, in float32: decoding one token;
- "chunked": chunks of 64 tokens, each chunk's delta-rule writes solved at once with one
  triangular system (the WY form of Yang et al., "Gated Delta Networks", 2024), then one
  (Dk, Dv) state carried from chunk to chunk: prefill.

A mask hides pairs: a key hidden from a query is not written into the memory that query reads
(its write strength is 0 there; the memory still fades at that token, as the model's gate says).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Form = Literal["auto", "loop", "recurrent", "chunked"]
FORMS = ("loop", "recurrent", "chunked")
CHUNK = 64  # tokens per chunk in the chunked form: the size flash-linear-attention uses too
_PAIR_BUDGET = 1 << 24  # elements of a (chunks, SUB, SUB, Dk) tensor of per-channel pair decays
SUB = 16  # tokens per sub-chunk whose pairs' per-channel fades are made one by one


@dataclass(frozen=True)
class Remembered:
    """What `delta_rule` returns: out (B, H, T, Dv) in q's dtype, and state (B, H, Dk, Dv), the
    memory after the last token, in the compute dtype (float32, float64 for float64 inputs)."""

    out: Tensor
    state: Tensor


@dataclass(frozen=True, eq=False)
class Memory:
    """What a linear-attention call wrote with, beside its q, k and v: the record keeps it.

    beta (B, H, T): each token's write strength; decay (B, H, T) or (B, H, T, Dk): the log of
    the factor every earlier memory fades by at each token, per head or per key channel;
    state (B, H, Dk, Dv): the memory before the call's first token (decoding after a prompt),
    or None where the memory began empty.
    """

    beta: Tensor
    decay: Tensor
    state: Tensor | None = None


@dataclass(frozen=True)
class Rule:
    """One call's inputs, checked: q and k (B, H, T, Dk), v (B, H, T, Dv); beta (B, H, T); g
    (B, H, T, G) the log of each token's fade, G = 1 (per head) or Dk (per key channel); scale on
    every query; state (B, H, Dk, Dv) or None; mask (B, H, T, T) boolean or None (True = seen)."""

    q: Tensor
    k: Tensor
    v: Tensor
    beta: Tensor
    g: Tensor
    scale: float
    state: Tensor | None
    mask: Tensor | None

    def compute(self, dtype: torch.dtype) -> Rule:
        """The same call with every float in `dtype`."""
        state = None if self.state is None else self.state.to(dtype)
        q, k, v, beta, g = (t.to(dtype) for t in (self.q, self.k, self.v, self.beta, self.g))
        return Rule(q, k, v, beta, g, self.scale, state, self.mask)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The rule's arithmetic: float64 for float64 inputs, else float32 (the memory is a sum
    over every token, which half precision would round away)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_rule(q, k, v, beta, decay, scale=None, state=None, mask=None) -> Rule:
    """Check one call of the rule; ValueError naming what is wrong and what is allowed."""
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta), ("decay", decay)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise ValueError(f"linear attention's {name} must be a float tensor")
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(
            f"q and k must be (B, H, T, Dk) and alike; got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    B, H, T, Dk = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, H, T):
        raise ValueError(f"v must be (B, H, T, Dv) = ({B}, {H}, {T}, Dv); got {tuple(v.shape)}")
    if beta.shape != (B, H, T):
        raise ValueError(f"beta must be (B, H, T) = ({B}, {H}, {T}); got {tuple(beta.shape)}")
    if decay.shape not in ((B, H, T), (B, H, T, Dk)):
        raise ValueError(
            f"decay (the log of each token's fade) must be (B, H, T) per head or (B, H, T, Dk) "
            f"per key channel: ({B}, {H}, {T}) or ({B}, {H}, {T}, {Dk}); got {tuple(decay.shape)}"
        )
    g = decay[..., None] if decay.dim() == 3 else decay
    if state is not None and state.shape != (B, H, Dk, v.shape[3]):
        raise ValueError(
            f"state (the memory) must be (B, H, Dk, Dv) = ({B}, {H}, {Dk}, {v.shape[3]}); "
            f"got {tuple(state.shape)}"
        )
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError("linear attention's mask must be boolean (True = the pair is seen)")
        try:
            mask = mask.expand(B, H, T, T)
        except RuntimeError:
            raise ValueError(
                f"mask {tuple(mask.shape)} does not broadcast to (B, H, T, T) = "
                f"({B}, {H}, {T}, {T})"
            ) from None
    scale = Dk**-0.5 if scale is None else float(scale)
    return Rule(q, k, v, beta, g, scale, state, mask)


def delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    beta: Tensor,
    decay: Tensor,
    scale: float | None = None,
    state: Tensor | None = None,
    mask: Tensor | None = None,
    form: Form = "auto",
    chunk_size: int = CHUNK,
) -> Remembered:
    """The gated delta rule over T tokens of every head at once.

    q, k (B, H, T, Dk): the queries and keys as the layer made them (Qwen3.5 and Kimi
    L2-normalize them); v (B, H, T, Dv); beta (B, H, T): each token's write strength; decay
    (B, H, T) or (B, H, T, Dk): the log of the factor every earlier memory fades by at that
    token (<= 0), per head or per key channel; scale: on every query (1/sqrt(Dk) by default);
    state (B, H, Dk, Dv): the memory before the first token (zeros if None); mask: boolean,
    broadcastable to (B, H, T, T), True where a query may read a key's write.
    form: "loop", "recurrent", "chunked", or "auto" (recurrent for a few tokens, else chunked);
    chunk_size: tokens per chunk of the chunked form (any size gives the same numbers).

    >>> q = k = torch.eye(2).view(1, 1, 2, 2); v = torch.tensor([[[[1.0], [2.0]]]])
    >>> half, keep = torch.full((1, 1, 2), 0.5), torch.zeros(1, 1, 2)
    >>> delta_rule(q, k, v, beta=half, decay=keep, scale=1.0).out.flatten().tolist()
    [0.5, 1.0]
    """
    rule = check_rule(q, k, v, beta, decay, scale, state, mask)
    if form == "auto":
        form = "recurrent" if q.shape[2] < 8 else "chunked"
    if form not in FORMS:
        raise ValueError(f"linear attention's forms are {', '.join(FORMS)}, not {form!r}")
    if type(chunk_size) is not int or chunk_size < 1:
        raise ValueError(f"chunk_size must be a whole number >= 1, got {chunk_size!r}")
    if form == "loop":
        from qkv.attention import loop_memory  # the oracle imports this module's Rule

        out, final = loop_memory.forward(rule)
    else:
        if form == "recurrent":
            run = _recurrence
        else:

            def run(rule: Rule) -> tuple[Tensor, Tensor]:
                return _chunked(rule, chunk_size)

        out, final = _with_mask(run, rule.compute(compute_dtype(q.dtype)))
    return Remembered(out.to(q.dtype), final)


def effective_weights(
    q: Tensor,
    k: Tensor,
    *,
    beta: Tensor,
    decay: Tensor,
    scale: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """(B, H, T, T) float64: a_tj, what query t reads of key j's value through the memory, such
    that weights @ v is the rule's output (from the memory's start; a `state` before the first
    token adds its own read). Zero above the diagonal and where the mask hides a pair.

    >>> q = k = torch.eye(2).view(1, 1, 2, 2)
    >>> w = effective_weights(q, k, beta=torch.full((1, 1, 2), 0.5), decay=torch.zeros(1, 1, 2),
    ...                       scale=1.0)
    >>> w[0, 0].tolist()
    [[0.5, 0.0], [0.0, 0.5]]
    """
    B, H, T, _ = q.shape
    identity = torch.eye(T, dtype=torch.float64, device=q.device).expand(B, H, T, T)
    rule = check_rule(q, k, identity, beta, decay, scale, None, mask).compute(torch.float64)
    run = _recurrence if T < 8 else _chunked
    return _with_mask(run, rule)[0]


def effective_row(
    q: Tensor, k: Tensor, *, beta: Tensor, decay: Tensor, scale: float | None = None
) -> Tensor:
    """(B, H, T) float64: one query's effective weights over the T keys written up to and at
    it, q (B, H, Dk) being the last key's token's query (decoding: each new token's row, from
    the keys, write strengths and fades of every token so far). The walk back of
    `loop_memory.remember` on whole tensors: O(T Dk) per head, no memory of Dk x Dv."""
    B, H, T, Dk = k.shape
    scale = Dk**-0.5 if scale is None else scale
    u = q.double() * scale  # what the query asks of the memory just after token j
    k, beta, fade = k.double(), beta.double(), decay.double().exp()
    if fade.dim() == 3:
        fade = fade[..., None]  # (B, H, T, 1): one factor per head
    row = u.new_zeros(B, H, T)
    for j in reversed(range(T)):
        row[:, :, j] = beta[:, :, j] * (k[:, :, j] * u).sum(-1)
        u = fade[:, :, j] * (u - row[:, :, j, None] * k[:, :, j])
    return row


def _with_mask(run, rule: Rule) -> tuple[Tensor, Tensor]:
    """`run` (the recurrent or chunked form) under the rule's mask. A key hidden from every query
    that could read it (padding) is not written at all: one run. Pairs hidden from some queries
    only (an intervention) need one run per distinct set of hidden keys, each query's output
    taken from the run of its own set; the final state is the run with no pair hidden."""
    if rule.mask is None:
        return run(rule)
    B, H, T, _ = rule.mask.shape
    reach = torch.ones(T, T, dtype=torch.bool, device=rule.q.device).tril()  # j <= t
    hidden = ~rule.mask & reach  # (B, H, T, T)
    # a key hidden from every query at or after it: never written, in one run for all
    unseen = (hidden | ~reach).all(dim=2)  # (B, H, T)
    written = rule.beta * ~unseen
    rest = hidden & ~unseen[:, :, None, :]  # hidden from some queries only
    base = Rule(rule.q, rule.k, rule.v, written, rule.g, rule.scale, rule.state, None)
    out, final = run(base)
    if not rest.any():
        return out, final
    sets, which = torch.unique(rest.reshape(-1, T), dim=0, return_inverse=True)
    which = which.reshape(B, H, T)
    for index, keys in enumerate(sets):
        if not keys.any():
            continue  # the queries with no pair hidden read the base run
        beta = written * ~keys
        these, _ = run(Rule(rule.q, rule.k, rule.v, beta, rule.g, rule.scale, rule.state, None))
        out = torch.where((which == index)[..., None], these, out)
    return out, final


def _recurrence(rule: Rule) -> tuple[Tensor, Tensor]:
    """One token at a time on whole (B, H) tensors: fade, recall, write the difference, read."""
    q, k, v, beta, g = rule.q * rule.scale, rule.k, rule.v, rule.beta, rule.g
    B, H, T, Dk = k.shape
    S = q.new_zeros(B, H, Dk, v.shape[3]) if rule.state is None else rule.state.clone()
    out = q.new_empty(v.shape)
    fade = g.exp()[..., None]  # (B, H, T, G, 1): scales the rows of S
    for t in range(T):
        S = S * fade[:, :, t]
        recalled = (k[:, :, t, :, None] * S).sum(2)  # (B, H, Dv) S^T k_t
        delta = (v[:, :, t] - recalled) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (q[:, :, t, :, None] * S).sum(2)  # (B, H, Dv) S^T q_t
    return out, S


def _chunked(rule: Rule, size: int = CHUNK) -> tuple[Tensor, Tensor]:
    """Chunks of `size` tokens: within a chunk, the writes of the delta rule depend on each other
    through a unit lower-triangular system (I + L) U = beta V, solved once per chunk; across
    chunks, one (Dk, Dv) state is carried. No (T, T, Dk, Dv) tensor is ever made."""
    q, k, v, beta, g = rule.q * rule.scale, rule.k, rule.v, rule.beta, rule.g
    B, H, T, Dk = k.shape
    Dv = v.shape[3]
    size = min(size, T)  # a short text is one chunk of its own length, not padded to 64
    pad = -T % size
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (T + pad) // size
    q, k, v, g = (t.reshape(B, H, n, size, t.shape[-1]) for t in (q, k, v, g))
    beta = beta.reshape(B, H, n, size, 1)
    G_in = g.cumsum(3)  # (B, H, n, C, G): the log fade from the chunk's start to each token
    k_beta = k * beta
    lower, on_or_below = _triangles(size, q.device)
    L, Aqk = _pairs(q, k, k_beta, G_in, lower, on_or_below)  # (B, H, n, C, C) each
    U = torch.linalg.solve_triangular(L, v * beta, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(L, k_beta * G_in.exp(), upper=False, unitriangular=True)
    q_faded = q * G_in.exp()  # what each query reads of the state the chunk began with
    G_last = G_in[:, :, :, -1:]  # (B, H, n, 1, G)
    k_to_end = k * (G_last - G_in).exp()  # each key faded to the chunk's end
    fade_all = G_last.exp().transpose(-1, -2)  # (B, H, n, G, 1): the whole chunk's fade of S
    S = q.new_zeros(B, H, Dk, Dv) if rule.state is None else rule.state.clone()
    out = q.new_empty(B, H, n, size, Dv)
    for i in range(n):
        fresh = U[:, :, i] - W[:, :, i] @ S  # (B, H, C, Dv): what the writes add beyond S
        out[:, :, i] = q_faded[:, :, i] @ S + Aqk[:, :, i] @ fresh
        S = S * fade_all[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ fresh
    return out.reshape(B, H, n * size, Dv)[:, :, :T], S


def _triangles(size: int, device) -> tuple[Tensor, Tensor]:
    ones = torch.ones(size, size, dtype=torch.bool, device=device)
    return ones.tril(-1), ones.tril()


def _pairs(q, k, k_beta, G_in, lower, on_or_below) -> tuple[Tensor, Tensor]:
    """Within each chunk, for token i and an earlier token j (faded from j to i):
    L[i, j] = beta_i k_i . k_j (strictly below the diagonal) and Aqk[i, j] = q_i . k_j (on or
    below it). A per-head fade is one factor per pair; a per-channel fade weighs each channel of
    the dot product: within a sub-chunk of SUB tokens every pair's (Dk,) fades are made (a few
    chunks at a time, so the (SUB, SUB, Dk) factors stay bounded); a pair across sub-chunks
    fades from j to the later sub-chunk's first token, then on to i, two factors of at most 1
    each (never a large one times a small one), so it is a matrix product."""
    if G_in.shape[-1] == 1:
        G = G_in[..., 0]
        fade = (G[..., :, None] - G[..., None, :]).masked_fill(~on_or_below, -torch.inf).exp()
        L = (k_beta @ k.transpose(-1, -2)) * fade * lower
        return L, (q @ k.transpose(-1, -2)) * fade
    B, H, n, C, Dk = k.shape
    L, Aqk = k.new_zeros(B, H, n, C, C), k.new_zeros(B, H, n, C, C)
    step = max(1, _PAIR_BUDGET // (B * H * SUB * SUB * Dk))
    for s in range(0, n, step):
        m = slice(s, s + step)
        G, qs, ks, kb = G_in[:, :, m], q[:, :, m], k[:, :, m], k_beta[:, :, m]
        for first in range(0, C, SUB):
            rows = slice(first, min(first + SUB, C))
            # pairs within the sub-chunk: every channel's fade from j to i, (m, c, c, Dk)
            Gd = G[..., rows, :]
            diff = (Gd[..., :, None, :] - Gd[..., None, :, :]).masked_fill(
                ~on_or_below[rows, rows, None], -torch.inf
            )
            fade = diff.exp()
            L[:, :, m, rows, rows] = (
                torch.einsum("bhmid,bhmjd,bhmijd->bhmij", kb[..., rows, :], ks[..., rows, :], fade)
                * lower[rows, rows]
            )
            Aqk[:, :, m, rows, rows] = torch.einsum(
                "bhmid,bhmjd,bhmijd->bhmij", qs[..., rows, :], ks[..., rows, :], fade
            )
            if first == 0:
                continue
            # earlier sub-chunks: the fade from j to i is the fade from j to the sub-chunk's
            # first token times the fade from there to i, each at most 1, so one product
            start = G[..., first : first + 1, :]  # (m, 1, Dk)
            to_i = (Gd - start).exp()
            from_j = ks[..., :first, :] * (start - G[..., :first, :]).exp()
            L[:, :, m, rows, :first] = (kb[..., rows, :] * to_i) @ from_j.transpose(-1, -2)
            Aqk[:, :, m, rows, :first] = (qs[..., rows, :] * to_i) @ from_j.transpose(-1, -2)
    return L, Aqk
