"""CPU benchmark of training a GPT-2-shaped model: qkv's training loop vs transformers.

The "gpt" preset (6 layers, 6 heads, width 384, context 256, 8 sequences a step, AdamW with
decay on matrices and embeddings only, warmup then cosine decay, clipping at 1.0, float32)
learns from a generated English-like corpus of about 3 MB, through a byte-level BPE of 8192
tokens. Three peers run the same steps on the same batches:

- qkv: `qkv.train.train(config, run, quiet=True)`, the real loop; its speed is each step's
  tokens_per_s in run/metrics.jsonl (the loop times a step from building its batch to
  zeroing the gradients).
- transformers: `GPT2LMHeadModel` from the config.json qkv's run exports (GPT2Config,
  attn_implementation="sdpa", dropout 0, tied embeddings), with qkv's initial weights copied
  in, trained by a hand loop: the same `Batches` over the run's shards, the same AdamW
  groups, schedule and clipping, timed over the same span as qkv's loop. The loss is
  transformers' own, mean over the labels (passed as `shift_labels`: the batches are already
  shifted); `use_cache=False`, as a training loop should. Step 1's loss must equal qkv's
  within 1e-4: the same model reading the same data.
- qkv compiled: the same run with train.compile = True, from an empty compile cache in its
  first round. Its first step, which compiles, is reported apart.
- qkv bf16 and transformers bf16: the same runs in bfloat16 mixed precision, each under
  torch.autocast(cpu, bfloat16) (qkv's train.precision = "bf16"; the hand loop wraps its
  forward and loss the same way), where the CPU has bfloat16 instructions (--no-bf16 skips
  them). Their step 1 losses agree to bfloat16's rounding, not to 1e-4.

Timing: every run does WARMUP untimed steps, then --steps timed ones; tokens/s is the timed
steps' tokens over their seconds, summed over --rounds rounds. The peers take turns within a
round, the order reversed each round, so drift in the machine (other load, clock speed)
falls on each alike; the load average is printed, since a shared machine moves every number.

    python benchmarks/train.py [--steps N] [--rounds R] [--no-compile]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import qkv
from qkv.data import TokenShards
from qkv.io.checkpoint import export
from qkv.io.tokenizer import Tokenizer
from qkv.train import RunConfig, preset, train
from qkv.train.arch import build_model, hf_config
from qkv.train.batches import Batches
from timing import CORES

WARMUP = 3  # untimed steps at the start of every run
TARGET = 1.2  # qkv tokens/s over transformers', both in float32
TARGET_BF16 = 1.0  # the same, both in bfloat16 mixed precision


def write_corpus(path: Path, size: int = 3_000_000, seed: int = 0) -> None:
    """About `size` bytes of English-like prose: Zipf-distributed made-up words in sentences
    with capitals, commas and full stops, paragraphs between blank lines (the documents)."""
    rng = random.Random(seed)
    onsets = ["", *"bcdfghlmnprstvw", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sl",
              "st", "th", "tr"]  # fmt: skip
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "ou", "oo", "ie"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt"]
    words: set[str] = set()
    while len(words) < 30_000:
        syllables = rng.choice((1, 1, 1, 2, 2, 3))
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                          for _ in range(syllables)))  # fmt: skip
    ranked = sorted(words)
    rng.shuffle(ranked)
    cumulative = list(itertools.accumulate(1 / rank for rank in range(1, len(ranked) + 1)))
    paragraphs, written = [], 0
    while written < size:
        sentences = []
        for _ in range(rng.randint(2, 8)):
            chosen = rng.choices(ranked, cum_weights=cumulative, k=rng.randint(5, 25))
            text = " ".join(w + ("," if rng.random() < 0.08 else "") for w in chosen[:-1])
            text = f"{text} {chosen[-1]}{rng.choice('.....?!')}"
            sentences.append(text[0].upper() + text[1:])
        paragraphs.append(" ".join(sentences))
        written += len(paragraphs[-1]) + 2
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")


def run_qkv(config: RunConfig, run: Path) -> list[dict]:
    """Train with qkv's loop; each step's {"loss", "seconds"} from run/metrics.jsonl."""
    train(config, run, quiet=True)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [{"loss": r["loss"], "seconds": r["tokens"] / r["tokens_per_s"]} for r in records]


def run_transformers(config: RunConfig, qkv_run: Path, bf16: bool = False) -> list[dict]:
    """The same steps with GPT2LMHeadModel, over the tokenizer and shards of `qkv_run`;
    bf16: the forward and loss under bfloat16 autocast, as qkv's train.precision = "bf16"."""
    from contextlib import nullcontext

    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = Tokenizer.from_folder(qkv_run / "tokenizer")
    shards = [TokenShards(qkv_run / "data", split) for split in ("train", "val")]
    batches = Batches(config, tokenizer, *shards)
    hf = hf_config(config, tokenizer)
    model = GPT2LMHeadModel(GPT2Config(**hf, attn_implementation="sdpa"))
    ours, family, model_config = build_model(config, hf)  # qkv's initial weights
    missing, unexpected = model.load_state_dict(export(ours, family, model_config), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected, (missing, unexpected)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    t = config.train
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))

    def lr_factor(step: int) -> float:  # qkv's: linear warmup, then cosine decay to min_lr
        if step < t.warmup:
            return (step + 1) / (t.warmup + 1)
        progress = min(1.0, (step - t.warmup) / max(1, t.steps - t.warmup))
        low = t.min_lr / t.lr
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    records = []
    for step in range(t.steps):
        began = time.perf_counter()
        batch = batches.train(step, 0)
        with autocast:
            out = model(batch["input_ids"], labels=batch["labels"],
                        shift_labels=batch["labels"], use_cache=False)  # fmt: skip
        out.loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), t.clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss = float(out.loss.detach())
        records.append({"loss": loss, "seconds": time.perf_counter() - began})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each peer")
    parser.add_argument("--no-compile", action="store_true", help="skip qkv compiled")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 runs")
    args = parser.parse_args()
    import transformers
    from transformers.utils import logging

    from qkv.device import capability

    logging.set_verbosity_error()  # the warnings about attention_mask and loss_type
    torch.set_num_threads(CORES)
    started = time.perf_counter()
    cache = tempfile.TemporaryDirectory(prefix="qkv-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name  # compile from an empty cache
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"qkv {qkv.__version__}, {torch.get_num_threads()} threads; {WARMUP} warm-up "
        f"+ {args.steps} timed steps per run, {args.rounds} rounds, peers interleaved"
    )
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    bf16 = not args.no_bf16 and capability().bfloat16
    print(
        f"this CPU: {capability().describe()}; bfloat16 runs "
        f"{'included' if bf16 else 'skipped (no bfloat16 instructions, or --no-bf16)'}"
    )
    peers = ["qkv", "transformers"] + ([] if args.no_compile else ["qkv compiled"])
    peers += ["qkv bf16", "transformers bf16"] if bf16 else []
    records: dict[str, list[list[dict]]] = {peer: [] for peer in peers}
    with tempfile.TemporaryDirectory(prefix="qkv-bench-train-") as folder:
        corpus = Path(folder) / "corpus.txt"
        write_corpus(corpus)
        config = preset("gpt").updated({
            "data": {"paths": (str(corpus),)},
            "train": {"steps": WARMUP + args.steps, "eval_every": 0, "checkpoint_every": 0},
        })  # fmt: skip
        first_run = Path(folder) / "qkv-0"  # round 0 starts with it; transformers reads its
        for r in range(args.rounds):  # tokenizer and shards
            for peer in peers if r % 2 == 0 else peers[::-1]:
                if peer.startswith("transformers"):
                    records[peer].append(run_transformers(config, first_run, "bf16" in peer))
                else:
                    changed = config.updated({"train": {
                        "compile": peer == "qkv compiled",
                        "precision": "bf16" if "bf16" in peer else "float32",
                    }})  # fmt: skip
                    run = Path(folder) / f"{peer.replace(' ', '-')}-{r}"
                    records[peer].append(run_qkv(changed, run))
        vocab = json.loads((first_run / "data" / "shards.json").read_text())["vocab_size"]
        train_tokens = len(TokenShards(first_run / "data", "train"))

    tokens = config.train.batch_size * config.model.context
    m = config.model
    print(
        f"model: GPT-2, {m.layers} layers, {m.heads} heads, width {m.width}, context "
        f"{m.context}, vocab {vocab}; {config.train.batch_size} x {m.context} = {tokens} "
        f"tokens a step; corpus {train_tokens:,} training tokens\n"
    )
    rate, by_round, step_ms = {}, {}, {}
    for peer, runs in records.items():
        timed = [[step["seconds"] for step in run[WARMUP:]] for run in runs]
        every = [s for run in timed for s in run]
        rate[peer] = tokens * len(every) / sum(every)
        by_round[peer] = ", ".join(f"{tokens * len(run) / sum(run):.0f}" for run in timed)
        step_ms[peer] = 1e3 * statistics.median(every)
    wide = max(len("by round"), *(len(text) for text in by_round.values()))
    header = (
        f"{'':>17} | {'tokens/s':>8} | {'by round':>{wide}} | {'median ms/step':>14} | "
        f"{'step 1 loss':>11} | {'vs transformers':>15}"
    )
    print(header)
    print("-" * len(header))
    for peer in peers:
        ratio = rate[peer] / rate[_peer_of(peer)]
        print(
            f"{peer:>17} | {rate[peer]:>8.0f} | {by_round[peer]:>{wide}} | "
            f"{step_ms[peer]:>14.0f} | {records[peer][0][0]['loss']:>11.6f} | {ratio:>14.2f}x"
        )
    loss_1 = records["qkv"][0][0]["loss"]
    difference = max(abs(run[0]["loss"] - loss_1) for peer, runs in records.items()
                     if "bf16" not in peer for run in runs)  # fmt: skip
    last = [abs(a["loss"] - b["loss"]) for a, b in
            zip(records["qkv"][0], records["transformers"][0], strict=True)]  # fmt: skip
    print(
        f"\nsame model, same data: step 1 losses of all runs differ by at most {difference:.1e} "
        f"({'yes' if difference < 1e-4 else 'NO'}, within 1e-4); qkv's and transformers' "
        f"after {len(last)} steps by {last[-1]:.1e}"
    )
    if "qkv compiled" in rate:
        firsts = [f"{run[0]['seconds']:.1f}" for run in records["qkv compiled"]]
        print(
            f"qkv compiled: first step (compiling) {', '.join(firsts)} s by round, the first "
            f"with an empty compile cache; a later step {step_ms['qkv compiled'] / 1e3:.2f} s"
        )
    if bf16:
        a, b = records["qkv bf16"][0][0]["loss"], records["transformers bf16"][0][0]["loss"]
        print(f"bfloat16: step 1 losses {a:.6f} (qkv) and {b:.6f} (transformers), "
              f"{abs(a - b):.1e} apart; float32's {loss_1:.6f}")  # fmt: skip
    for peer in (p for p in peers if not p.startswith("transformers")):
        ratio = rate[peer] / rate[_peer_of(peer)]
        target = TARGET_BF16 if "bf16" in peer else TARGET
        verdict = "PASS" if ratio >= target else "MISS"
        print(f"{peer}/{_peer_of(peer)} tokens/s: {ratio:.3f}x; target >= {target}x -> "
              f"{verdict}")  # fmt: skip
    print(
        f"load average at end: {os.getloadavg()[0]:.2f}; "
        f"total {time.perf_counter() - started:.0f} s"
    )
    cache.cleanup()


def _peer_of(peer: str) -> str:
    """The transformers run a peer is set beside: the one in the same precision."""
    return "transformers bf16" if "bf16" in peer else "transformers"


if __name__ == "__main__":
    main()
