"""Write docs/linear.md: linear and sparse attention in the article's words, with the numbers
of a trained toy (the bank preset with a Gated DeltaNet layer), computed here from the model.

    python docs/make_linear.py [OUTPUT [RUN]]   (default: docs/linear.md; RUN: a run folder
                                               of `qkv train --preset bank --layers
                                               linear,full`, trained there if it has no
                                               checkpoint)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import qkv
from qkv.data import bank_corpus
from qkv.nn.delta import DeltaConfig
from qkv.train.data import SENSE_WORDS

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--preset", "bank", "--layers", "linear,full", "--quiet"]
# a held-out frame (never trained on) with the cue before "bank", so the memory has read it
SENTENCES = {
    "river": "anna dreamed about the reeds beside the old bank .",
    "money": "anna dreamed about the loan beside the old bank .",
}
# transformers' Qwen3_5TextConfig defaults: 16 query/key heads and 32 value heads of 128 in
# a linear layer; a full layer keeps 4 key and value heads of 256 per token
QWEN = DeltaConfig(width=2048, heads=32, key_heads=16, key_size=128, value_size=128)
QWEN_KV_PER_TOKEN = 2 * 4 * 256


def trained(run: Path) -> Path:
    if not (run / "checkpoints").is_dir():
        command = [sys.executable, "-m", "qkv.cli", *TRAIN, "--out", str(run)]
        subprocess.run(command, check=True, cwd=REPO)
    return run


def records(model, tokenizer, text: str):
    """(tokens, the linear layer's record, the softmax layer's record, the sense predicted)."""
    encoded = tokenizer.encode(text)
    ids = torch.tensor([encoded.ids])
    with torch.inference_mode():
        out = model(ids, layers=[0, 1], logits=True)
    bank = encoded.tokens.index("bank")
    senses = {s: tokenizer.token_to_id(w) for s, w in SENSE_WORDS.items()}
    scores = {s: out.logits[0, bank, i].item() for s, i in senses.items()}
    return encoded.tokens, out.records[0], out.records[1], max(scores, key=scores.get)


def accuracy(model, tokenizer) -> dict[str, tuple[int, int]]:
    """Held-out sentences whose "bank" the model reads as its sense, with the cue before
    "bank" and after it: {where: (right, all)}."""
    senses = {s: tokenizer.token_to_id(w) for s, w in SENSE_WORDS.items()}
    found = {"before": [0, 0], "after": [0, 0]}
    for sentence in bank_corpus(256, split="heldout", seed=0):
        encoded = tokenizer.encode(sentence.text)
        with torch.inference_mode():
            logits = model(torch.tensor([encoded.ids]), logits=True).logits[0]
        bank, cue = encoded.tokens.index("bank"), encoded.tokens.index(sentence.cue)
        guess = max(senses, key=lambda s: logits[bank, senses[s]].item())
        where = found["before" if cue < bank else "after"]
        where[0] += guess == sentence.sense
        where[1] += 1
    return {k: (v[0], v[1]) for k, v in found.items()}


def table(tokens, linear, softmax) -> list[str]:
    """One row per word: each head's effective weight (the memory) and softmax weight, for
    the query "bank"."""
    bank = tokens.index("bank")
    memory = linear.weights()[0, :, bank]  # (H, T) float64
    weights = softmax.weights()[0, :, bank]
    heads = memory.shape[0]
    head = " | ".join(f"h{h}" for h in range(heads))
    rows = [
        f"| word | memory (layer 0): {head} | softmax (layer 1): {head} |",
        "|" + "---|" * (1 + 2 * heads),
    ]
    for j, token in enumerate(tokens):
        cells = [f"{memory[h, j].item():+.2f}" for h in range(heads)]
        cells += [f"{weights[h, j].item():.2f}" for h in range(heads)]
        rows.append(f"| {token} | " + " | ".join(cells) + " |")
    sums = [f"**{memory[h].sum().item():+.2f}**" for h in range(heads)]
    sums += [f"**{weights[h].sum().item():.2f}**" for h in range(heads)]
    rows.append("| *sum* | " + " | ".join(sums) + " |")
    return rows


def write(out: Path, run: Path) -> None:
    loaded = qkv.load(run)
    model, tokenizer, config = loaded.model, loaded.tokenizer, loaded.config
    delta = config.block.linear
    right = accuracy(model, tokenizer)
    parts = {}
    for sense, text in SENTENCES.items():
        tokens, linear, softmax, guess = records(model, tokenizer, text)
        check = (linear.weights().float() @ linear.v - linear.out).abs().max().item()
        parts[sense] = (tokens, linear, softmax, guess, check)
    tokens, linear, softmax, _, _ = parts["river"]
    bank, cue = tokens.index("bank"), tokens.index("reeds")
    memory = linear.weights()[0, :, bank]  # (H, T)
    weights = softmax.weights()[0, :, bank]
    head, word = divmod(int(memory.abs().argmax()), memory.shape[1])
    sums = memory.sum(-1)
    cue_top = int((weights.argmax(-1) == cue).sum())
    cue_memory_top = int((memory.abs().argmax(-1) == cue).sum())
    toy_state = delta.state_bytes
    toy_kv = 2 * config.block.width  # a softmax layer keeps a key and a value per token
    qwen_state = QWEN.state_bytes
    step = loaded.run and qkv.io.runs.step_of(qkv.io.runs.last_checkpoint(run))

    lines = PAGE.format(
        steps=step,
        before=f"{right['before'][0]} of {right['before'][1]}",
        after=f"{right['after'][0]} of {right['after'][1]}",
        heads=delta.heads,
        dk=delta.key_size,
        largest=f"{memory[head, word].item():+.2f}",
        largest_word=tokens[word],
        largest_head=head,
        cue_low=f"{memory[:, cue].min().item():+.2f}",
        cue_high=f"{memory[:, cue].max().item():+.2f}",
        negative=int((memory[:, : bank + 1] < 0).sum()),
        pairs=memory.shape[0] * (bank + 1),
        sum_low=f"{sums.min().item():+.2f}",
        sum_high=f"{sums.max().item():+.2f}",
        cue_top=cue_top,
        cue_memory_top=cue_memory_top,
        cue_softmax_low=f"{weights[:, cue].min().item():.2f}",
        cue_softmax_high=f"{weights[:, cue].max().item():.2f}",
        toy_state=f"{toy_state:,}",
        toy_even=f"{toy_state / toy_kv:.1f}",
        qwen_state=f"{qwen_state:,}",
        qwen_even=f"{qwen_state / QWEN_KV_PER_TOKEN:.0f}",
        qwen_ratio=f"{32768 * QWEN_KV_PER_TOKEN / qwen_state:.0f}",
    ).splitlines()
    at = lines.index("<!-- cache -->")
    lines[at : at + 1] = [
        f"| the toy (width 64, {delta.heads} heads) | {toy_state:,} numbers "
        f"({delta.heads * delta.key_size * delta.value_size:,} memory + "
        f"{delta.conv_width * (delta.conv - 1):,} convolution inputs) | {toy_kv:,} per word: "
        f"{config.max_positions * toy_kv:,} at {config.max_positions} words |",
        f"| Qwen3.5's defaults in transformers | {qwen_state:,} numbers | {QWEN_KV_PER_TOKEN:,} "
        f"per word (4 key and value heads of 256): {32768 * QWEN_KV_PER_TOKEN:,} at 32,768 "
        "words |",
    ]
    for sense, (tokens, linear, softmax, guess, check) in parts.items():
        at = lines.index(f"<!-- {sense} -->")
        rows = [f'"{SENTENCES[sense]}" (the model reads "bank" as **{guess}**):', "", *table(
            tokens, linear, softmax), "", f"weights @ values against the memory's own read "
            f"(the record's out): largest difference {check:.1e}."]  # fmt: skip
        lines[at : at + 1] = rows
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


PAGE = """# Linear and sparse attention: weights on the words without a softmax

<!-- written by docs/make_linear.py from a model it trains; do not edit by hand -->

The article's attention compares the query of a word with the key of every word, turns the
scores into weights with a softmax (each between 0 and 1, summing to 1) and adds up the
values by those weights. The models of 2026 keep that in a few layers only. In most of their
layers the query meets no key at all:

- **linear attention** (Qwen3.5's Gated DeltaNet, Kimi Linear's KDA): each head keeps a
  *memory*, a matrix of Dk x Dv numbers, and reads it with the query;
- **compressed sparse attention** (DeepSeek-V4): keys are compressed in blocks of words, and
  each query attends only to the compressed entries an indexer picks for it.

The article's question, *how much does the key word give the query word*, still has an exact
answer for both, and qkv shows it as weights on the words (`record.weights()`), so every
view that reads attention weights reads these too.

## The memory, in the article's words

A linear layer makes a query, a key and a value for every word, as the article's layers do
(through one matrix, then a short convolution over the last 4 words, the keys and queries
scaled to length 1). Then, word by word, in order:

1. every earlier memory **fades** by g (a number between 0 and 1 the layer computes from the
   word: one per head in Gated DeltaNet, one per key channel in KDA);
2. the memory is asked what it already holds under the word's **key**;
3. the difference between the word's **value** and that recall is **written** under the key,
   with a strength beta between 0 and 1 (the "delta rule": writing v under k replaces what
   k held, in full when beta is 1);
4. the word's **query** reads the memory: its output is the memory times the query.

No score, no softmax, and nothing grows with the text: the memory has the same size at the
first word and the ten-thousandth. `qkv.attention.linear.delta_rule` computes it three ways
(a loop over words in these words, a recurrence, and the chunked form of the papers, chunks
of 64 words each solved at once); they agree to float32's rounding. On the same inputs
transformers' own torch code gives the chunked form's output to the last bit for Gated
DeltaNet, and to float32's rounding for KDA (benchmarks/results/linear_attention.txt).

## Effective weights: signed, not summing to 1

The read of step 4 is still a sum of the values: what the memory returns for word t is
sum over j <= t of a_tj v_j, because every write is a value times numbers. The **effective
weight** a_tj of key word j for query word t is

    a_tj = beta_j k_j . [ M_(j+1) ... M_t q_t ],   M_i = g_i (I - beta_i k_i k_i^T)

(with the query's scale; g_i is a number in Gated DeltaNet, a diagonal matrix of the
channels' fades in KDA): what j wrote, faded and partly overwritten by every later write,
then read by t's query. qkv computes every a_tj by running the memory on the rows of the
identity as values (the read is linear in the values, so the identity's rows come back as
the weights), never building a T x T x Dk x Dv tensor; `weights @ v` gives the layer's read
back to float32's rounding (1e-10 in float64).

These weights differ from the article's in two ways:

- **signed**: a later write under a similar key *subtracts* what it replaces, so a word can
  weigh less than nothing (a negative weight: its value is taken out of the read);
- **not summing to 1**: nothing normalizes them. A query that matches nothing in the memory
  reads little (weights near 0 everywhere); the layer's norm after the read rescales it.

## A trained toy: "bank" read through a memory

qkv's bank preset trains a small BERT to tell "bank" by river from "bank" by money: the
sentences name the sense once, with one cue word before or after "bank". With `--layers
linear,full` its first layer is a Gated DeltaNet memory ({heads} heads, Dk = Dv = {dk}) and
its second a softmax layer:

```
qkv train --preset bank --layers linear,full
```

Trained {steps} steps, it reads "bank" right in {before} held-out sentences whose cue comes
before "bank", and {after} whose cue comes after it (frames never trained on). A memory
reads left to right: at layer 0, "bank" has read only the words before it; the softmax layer
above sees every word, both ways.

The query "bank" in two held-out sentences, the weight of every word for it in each head:
the effective weights of the memory (layer 0) beside the softmax weights (layer 1).

<!-- river -->

<!-- money -->

What the numbers say, in the river sentence:

- the memory's weights for "bank" are small and signed: the largest is {largest} (head
  {largest_head}, on "{largest_word}"), {negative} of the {pairs} weights on "bank" and the
  words before it are negative, and each head's weights sum to between {sum_low} and
  {sum_high}, not 1. Small is not little: each head's read is RMS-normalized before the
  layer's output, so only their proportions count (a softmax would have made them sum to 1);
- the memory gives the cue "reeds" between {cue_low} and {cue_high}, its largest weight by
  size in {cue_memory_top} of its {heads} heads; the softmax layer gives the cue
  {cue_softmax_low} to {cue_softmax_high}, the most of any word in {cue_top} of its heads;
- the words after "bank" get exactly 0 from the memory: it has not read them yet. The
  softmax weights are all positive and each head's sum to 1.

In the money sentence every row of the memory changes a little, not only the cue's: a
word's effective weight depends on every write after it, the cue's among them (and the
convolution mixes each word's query, key and value with the 3 words before it).
`record.weights()` gives these numbers for any linear layer
(`qkv.attention.linear.effective_weights`), and `record.steps(head, query)` the memory's
work word by word (`qkv.attention.loop_memory`).

## The memory against a KV cache

A softmax layer decoding keeps every word's key and value (its KV cache); a linear layer
keeps its memory and the convolution's last 3 inputs, whatever the length
(`DeltaConfig.state_bytes`, numbers per sequence):

| | linear layer (memory) | softmax layer (KV cache) |
|---|---|---|
<!-- cache -->

The memory equals the cache at {toy_even} words in the toy and {qwen_even} words at Qwen3.5's
sizes; at 32,768 words a full layer's cache is {qwen_ratio} times a linear layer's memory.
This is what a linear layer buys (three of every four layers in Qwen3.5): its memory is
its whole cache.

## DeepSeek-V4: compressed and sparse attention

DeepSeek-V4's attention keeps the softmax but not every key:

- a **compressor** turns each block of m words (4 in CSA, 128 in HCA) into one compressed key
  and value entry, a weighted sum of the block's words with coefficients the compressor
  computes from them;
- a **lightning indexer** scores every compressed entry for each query and keeps the top k;
- the query's softmax runs over the entries kept, the last few words themselves (a sliding
  window) and a learned sink (an extra score with no value).

Its weights on the **words** follow from the same sum: a weight on a compressed entry spreads
over the words of its block by the compressor's coefficients (a word's weight is the entry's
weight times its coefficient), and the window's words keep their own weights. A word whose
block the indexer did not pick has weight exactly 0 for that query; the record says why (not
chosen by the indexer, its rank among the entries) rather than showing a small number.
qkv's DeepSeek-V4 layer (being built beside this page) keeps the indexer's choice, the
compressed entries, the window and the sink in its record, so these weights come from the
model's own numbers as the memory's do.

## Speed

benchmarks/linear_attention.py times the chunked form against transformers' own torch code
(its path without flash-linear-attention) at 1,024 and 4,096 words, with the peak memory of
each; the figures and the machine are in benchmarks/results/linear_attention.txt.
"""


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "linear.md"
    if len(sys.argv) > 2:
        write(out, trained(Path(sys.argv[2])))
        return
    with tempfile.TemporaryDirectory() as folder:
        write(out, trained(Path(folder) / "bank-linear"))


if __name__ == "__main__":
    main()
