"""CPU benchmark of the `hide` table (every layer x head), qkv vs TransformerLens-style hooks.

The question: how much does each (layer, head) carry "river" into "bank"? For each head,
hide the key word from the query word in that head alone and measure the change of the
query word's final vector (1 - cosine, the vectors of its tokens averaged first). The full
L x H table, on MiniLM (an encoder, 6 x 12) and SmolLM2 (a decoder, 30 x 9), for a short
and a longer text.

- qkv: `qkv.inspect.hide.hide(pretrained, text, key, query=query)` on the model's default
  backend ("auto"): one clean forward, then for each layer one batched run of its heads
  (one head hidden per row) that resumes from the clean residual stream at that layer; in a
  decoder only from the query word's position on (the earlier positions cannot see the
  change; their keys and values come from the clean run's cache).
- the peer, "TransformerLens-style": what a researcher does with hooks on `transformers`
  with eager attention: one clean forward, then for each (layer, head) a full forward in
  which that layer's attention pattern has the (query, key) pairs zeroed in that head and
  its rows renormalized (the edit TransformerLens makes at `hook_pattern`). It runs through
  transformers' own mechanism: an attention function registered in `AttentionInterface`
  (transformers' eager attention, plus the pattern edit in the chosen layer and head) under
  the name "hook_pattern", with transformers' eager mask registered under the same name in
  `AttentionMaskInterface`. Its models: transformers' BertModel from the embedded MiniLM
  folder, and LlamaModel (the causal LM's base: final vectors only, as qkv's table needs)
  from the embedded SmolLM2 GGUF file, both float32.

Both sides read the same token ids (qkv's tokenizer) and the same token spans of the two
words, so they answer the same question. Zeroing a pattern's entries and renormalizing its
row is the softmax over the remaining keys, which is what qkv's mask gives: the two tables
must agree, to < 1e-4 on MiniLM (the same checkpoint) and to < 1e-3 on SmolLM2 (qkv and
transformers each dequantize the GGUF file themselves and sum in other orders), else the
script exits non-zero.

Timing: one untimed call each (the one whose tables are compared) as warm-up, then the best
of --repeats calls timed with time.perf_counter; the peers are interleaved call by call (in a
rotating order) so drift in the machine affects them alike.

    python benchmarks/hide.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import sys
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

import qkv
from qkv.inspect.hide import hide
from qkv.inspect.runs import stack_of, word_span
from qkv.io.embedded import embedded_path
from qkv.models import Decoder
from timing import CORES, time_peers

# the key comes before the query, so that a decoder's query can see it
SHORT = "The river rose in the night, and by morning the bank was under water."
LONG = (
    "We walked for hours along the old towpath, past the mill, the lock and the row of "
    "cottages where the boatmen once lived. The water was high after a week of rain, brown "
    "and fast, carrying branches and leaves down towards the town. Children threw sticks "
    "from the bridge and raced to the other side to see whose came out first. By the "
    "afternoon the clouds had cleared, the fields steamed in the sun, and the river had "
    "begun to fall again, leaving a line of mud and reeds along the bank."
)
KEY, QUERY = "river", "bank"
BOUND = {"minilm": 1e-4, "smollm2": 1e-3}  # largest allowed |qkv - peer| in the table


# ---------------------------------------------------------------------------- the peer


@dataclass
class PatternEdit:
    """Which pattern entries the next forward zeroes: in `layer`, head `head`, the rows
    `queries` and the columns `keys` (token spans [start, end))."""

    layer: int
    head: int
    queries: slice
    keys: slice


EDIT: PatternEdit | None = None  # what a hook reads, as a TransformerLens hook closes over it


def hook_pattern_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """transformers' eager attention (BERT's and Llama's `eager_attention_forward`), with
    TransformerLens's `hook_pattern` edit where EDIT says: the pairs zeroed, rows renormalized.

    query: (B, H, T, D); key, value: (B, Hkv, T, D); returns (B, T, H, D) and the pattern.
    """
    groups = query.shape[1] // key.shape[1]  # grouped KV heads: Llama's repeat_kv
    key = key.repeat_interleave(groups, dim=1)  # (B, H, T, D)
    value = value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, T)
    if attention_mask is not None:
        scores = scores + attention_mask
    pattern = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if EDIT is not None and module.layer_idx == EDIT.layer:
        pattern[:, EDIT.head, EDIT.queries, EDIT.keys] = 0
        pattern = pattern / pattern.sum(-1, keepdim=True)
    out = torch.matmul(pattern, value).transpose(1, 2).contiguous()  # (B, T, H, D)
    return out, pattern


def register_hook_pattern() -> None:
    import transformers
    from transformers.masking_utils import eager_mask

    transformers.AttentionInterface.register("hook_pattern", hook_pattern_attention)
    transformers.AttentionMaskInterface.register("hook_pattern", eager_mask)


def peer_table(model, ids: torch.Tensor, key: slice, query: slice, L: int, H: int):
    """The (L, H) table the peer way: a clean forward, then L * H full forwards, each with
    one head's pattern edited. model: a transformers base model; ids (1, T)."""
    global EDIT
    effect = torch.empty(L, H, dtype=torch.float64)
    with torch.inference_mode():
        clean = model(ids).last_hidden_state[0, query].mean(0).double()  # (C,)
        try:
            for layer in range(L):
                for head in range(H):
                    EDIT = PatternEdit(layer, head, query, key)
                    states = model(ids).last_hidden_state[0, query].mean(0).double()
                    effect[layer, head] = 1 - F.cosine_similarity(clean, states, dim=0)
        finally:
            EDIT = None
    return effect


def load_peers() -> dict:
    """transformers' models of the two embedded checkpoints, on the hook_pattern attention."""
    import transformers

    register_hook_pattern()
    kwargs = {"dtype": torch.float32, "attn_implementation": "hook_pattern"}
    with contextlib.redirect_stderr(io.StringIO()):  # loading progress bars
        bert = transformers.AutoModel.from_pretrained(embedded_path("minilm"), **kwargs)
        gguf = embedded_path("smollm2")
        llama = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, **kwargs
        ).model  # the base model: final vectors after the final norm, no LM head
    return {"minilm": bert.eval(), "smollm2": llama.eval()}


# ---------------------------------------------------------------------------- timing


def backend_of(pretrained, T: int) -> str:
    """What "auto" runs a hide table on: a boolean mask per row, as `hide` gives it."""
    from qkv.attention import explain_choice

    stack = stack_of(pretrained)
    H, D = stack.config.block.num_heads, stack.blocks[0].attn.head_dim
    q = torch.zeros(H, H, T, D)
    mask = torch.ones(H, H, T, T, dtype=torch.bool)
    return explain_choice(q, q, q, mask=mask, causal=isinstance(stack, Decoder)).backend


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load() -> str:
    """The machine's load average over 1, 5 and 15 minutes (other work shares these cores)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the short text only, 1 repeat")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls each (3)")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    texts = {"short": SHORT} if args.quick else {"short": SHORT, "long": LONG}
    torch.set_num_threads(CORES)

    import transformers

    transformers.logging.set_verbosity_error()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"qkv {qkv.__version__}, {torch.get_num_threads()} threads, float32, "
        f"best of {repeats} interleaved calls after a warm-up"
    )
    print(f"{cpu_name()}, {os.cpu_count()} cores; load average at start: {load()}")
    print(f"key {KEY!r} hidden from query {QUERY!r}, the full L x H table")
    peers = load_peers()
    rows, failed = [], []
    for name, peer in peers.items():
        pretrained = qkv.load(name)
        stack = stack_of(pretrained)
        L, H = stack.config.num_layers, stack.config.block.num_heads
        for label, text in texts.items():
            encoded = pretrained.encode(text)
            ids = torch.tensor([encoded.ids])
            key = slice(*word_span(encoded, KEY, "the key word"))
            query = slice(*word_span(encoded, QUERY, "the query word"))
            fns = {
                "qkv": partial(hide, pretrained, text, KEY, query=QUERY),
                "peer": partial(peer_table, peer, ids, key, query, L, H),
            }
            # the same work: the tables are compared first, and these calls are the warm-up
            ours, theirs = fns["qkv"]().effect, fns["peer"]()
            gap = float((ours - theirs).abs().max())
            ok = gap < BOUND[name]
            if not ok:
                failed.append(f"{name} {label}: max |qkv - peer| {gap:.2e} >= {BOUND[name]}")
            seconds = time_peers(fns, repeats, warmup=0, statistic=min)  # the best of each
            rows.append((name, L, H, label, ids.shape[1], backend_of(pretrained, ids.shape[1]),
                         seconds["qkv"], seconds["peer"], gap, ok))  # fmt: skip
            print(f"  {name} {label} ({ids.shape[1]} tokens): done", file=sys.stderr)

    header = (
        f"{'model':>8} | {'L x H':>6} | {'text':>5} | {'tokens':>6} | {'qkv backend':>11} | "
        f"{'qkv s':>7} | {'peer s':>7} | {'speedup':>7} | {'max |diff|':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, L, H, label, T, backend, ours, theirs, gap, ok in rows:
        print(
            f"{name:>8} | {f'{L}x{H}':>6} | {label:>5} | {T:>6} | {backend:>11} | {ours:>7.2f} | "
            f"{theirs:>7.2f} | {theirs / ours:>6.1f}x | {gap:>10.1e}{'' if ok else ' FAIL'}"
        )
    print("speedup: peer seconds / qkv seconds; peer: 1 clean + L*H edited full forwards")
    print(f"tables agree (max |diff| < {BOUND}): {'PASS' if not failed else 'FAIL'}")
    print(f"load average at end: {load()}")
    for problem in failed:
        print(problem, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
