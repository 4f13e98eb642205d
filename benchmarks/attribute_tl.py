"""CPU benchmark of attribution patching per head on SmolLM2: qkv vs TransformerLens 4.3.

The question: for 32 IOI-style pairs ("When Mary and John went to the store, John gave a
drink to" against the same with "Mary gave"), how much would patching each (layer, head)'s
output from the clean run into the corrupted run move log p(A) - log p(B)? Attribution
patching estimates every head at once: (clean z - corrupted z) . d metric / d z, the gradient
taken in the corrupted run, summed over positions and the head's D.

- qkv: `qkv.attribute(smollm2, cleans, corrupts, metrics)` (one clean forward and one
  forward + backward on the corrupted texts per right-padded batch of pairs; the gradient by
  each record's head outputs, autograd.grad: no parameter gradient).
- TransformerLens 4.3 (`TransformerBridge.boot_transformers`, HookedTransformer is gone in 4.x)
  over transformers' own load of the same GGUF file (as conftest.py's smollm2_hf), eager
  attention, float32: `run_with_cache` of hook_z on the clean batch, then a forward hook and a
  backward hook on every hook_z of the corrupted batch and `metric.backward()` (the recipe of
  Neel Nanda's attribution-patching notebook). Its parameters are frozen
  (requires_grad=False) and hook_embed's output made a leaf that requires grad, so its backward
  computes no parameter gradient either: the fastest TransformerLens way. Pairs of one token
  length go in one batch (no padding).
- qkv's edge attribution (`edges=True`: 301 senders x 841 receivers per pair, every head's
  q, k, v input per query head) against qkv's real patching (`qkv.patch`, one run per (layer,
  head) and per (layer, position)): real patching takes over a minute a pair here, so it runs
  on the first --patch-pairs pairs and the ratio is per pair.

Both sides read the same token ids (qkv's tokenizer). Timing: a warm-up call each, then
--rounds rounds, the peers' order alternating each round (`timing.time_peers`, median); edges
against real patching pair by pair, alternating who goes first.

    python benchmarks/attribute_tl.py [--rounds N] [--patch-pairs N]
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings

import torch

import qkv
from qkv.inspect.attribute import Faithfulness
from qkv.inspect.metrics import Metric
from qkv.io.embedded import embedded_path
from timing import machine, time_peers

TEMPLATES = (
    "When {A} and {B} went to the store, {S} gave a drink to",
    "When {A} and {B} went to the park, {S} gave a ball to",
    "After {A} and {B} went to the office, {S} handed a letter to",
    "Then, {A} and {B} had a long walk. {S} gave a ring to",
)
NAMES = (("Mary", "John"), ("Tom", "James"), ("Anna", "Sarah"), ("Paul", "Mike"),
         ("Lisa", "David"), ("Emma", "Alice"), ("Bob", "Kate"), ("Peter", "Jack"))  # fmt: skip


def ioi_pairs() -> tuple[list[str], list[str], list[str]]:
    """32 pairs: the clean text's subject is B (the answer A), the corrupted text's is A (the
    answer B); metric log p(A) - log p(B). The first is docs/patch.md's pair."""
    cleans, corrupts, metrics = [], [], []
    for template in TEMPLATES:
        for a, b in NAMES:
            cleans.append(template.format(A=a, B=b, S=b))
            corrupts.append(template.format(A=a, B=b, S=a))
            metrics.append(f"diff: {a}, {b}")
    return cleans, corrupts, metrics


def load_transformer_lens():
    """TransformerLens's bridge over transformers' own load of the embedded GGUF file."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import transformers
    from transformer_lens.model_bridge import TransformerBridge

    path = embedded_path("smollm2")
    kwargs = {"gguf_file": path.name}
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=torch.float32, attn_implementation="eager", **kwargs
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
    bridge = TransformerBridge.boot_transformers(
        "HuggingFaceTB/SmolLM2-135M-Instruct", hf_model=hf, tokenizer=tokenizer, device="cpu",
        dtype=torch.float32,
    )  # fmt: skip
    for parameter in bridge.parameters():
        parameter.requires_grad_(False)
    return bridge


def tl_attribution(bridge, batches) -> torch.Tensor:
    """(N, L, H) attribution per head, TransformerLens's hooks; batches: (rows, clean ids
    (B, T), corrupted ids (B, T), answer ids (B, 2)) of pairs of one length."""
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    N = sum(len(rows) for rows, *_ in batches)
    out = torch.empty(N, L, H, dtype=torch.float64)
    acts, grads = {}, {}  # layer -> (B, T, H, D), filled by the hooks, batch by batch

    def is_z(name: str) -> bool:  # the bridge names hook_z's hook point attn.o.hook_in
        return name.endswith("attn.hook_z")

    def layer(hook) -> int:
        return int(hook.name.split(".")[1])

    def keep(act, hook):
        acts[layer(hook)] = act.detach().reshape(*act.shape[:2], H, -1)

    def keep_grad(grad, hook):
        grads[layer(hook)] = grad.detach().reshape(*grad.shape[:2], H, -1)

    def leaf(act, hook):  # parameters frozen: the gradient starts at the embeddings
        return act.detach().requires_grad_(True)

    for rows, clean, corrupt, answers in batches:
        with torch.no_grad():
            bridge.run_with_hooks(clean, fwd_hooks=[(is_z, keep)])
        clean_z = dict(acts)
        bridge.add_hook("hook_embed", leaf, "fwd")
        bridge.add_hook(is_z, keep, "fwd")
        bridge.add_hook(is_z, keep_grad, "bwd")
        try:
            logits = bridge(corrupt)  # (B, T, vocab)
            logprobs = logits[:, -1].log_softmax(-1)
            picked = logprobs.gather(1, answers)  # (B, 2)
            (picked[:, 0] - picked[:, 1]).sum().backward()
        finally:
            bridge.reset_hooks()
        for n in range(L):  # (B, T, H, D) -> (B, H)
            change = (clean_z[n] - acts[n]) * grads[n]
            out[rows, n] = change.sum((1, 3)).double()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--patch-pairs", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(machine())
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    smollm2 = qkv.load("smollm2")
    bridge = load_transformer_lens()
    cleans, corrupts, metrics = ioi_pairs()
    ids = [smollm2.encode(t).ids for t in cleans], [smollm2.encode(t).ids for t in corrupts]
    answers = [Metric.parse(m).ids(smollm2.tokenizer) for m in metrics]
    by_length: dict[int, list[int]] = {}
    for i, row in enumerate(ids[0]):
        by_length.setdefault(len(row), []).append(i)
    batches = [(rows, torch.tensor([ids[0][i] for i in rows]),
                torch.tensor([ids[1][i] for i in rows]), torch.tensor([answers[i] for i in rows]))
               for rows in by_length.values()]  # fmt: skip
    N = len(cleans)
    print(f"{N} IOI-style pairs of {sorted(by_length)} tokens; metric log p(A) - log p(B); "
          f"SmolLM2 30 layers x 9 heads (3 key/value heads), float32")  # fmt: skip

    def ours():
        return qkv.attribute(smollm2, cleans, corrupts, metrics)

    def theirs():
        return tl_attribution(bridge, batches)

    found, peer = ours(), theirs()
    difference = float((found.values["heads"] - peer).abs().max())
    scale = float(peer.abs().max())
    times = time_peers({"qkv": ours, "TransformerLens": theirs}, args.rounds, warmup=0)
    print("\nattribution patching per head, all 32 pairs (median of "
          f"{args.rounds} alternating rounds):")  # fmt: skip
    print(f"  qkv.attribute            {times['qkv']:8.2f} s")
    print(f"  TransformerLens 4.3      {times['TransformerLens']:8.2f} s")
    print(f"  speedup (TL / qkv)       {times['TransformerLens'] / times['qkv']:8.2f}x")
    print(
        f"  max |qkv - TL| over the 32 x 30 x 9 head attributions: {difference:.2e} "
        f"(largest |attribution| {scale:.3f})"
    )

    start = time.perf_counter()
    with_edges = qkv.attribute(smollm2, cleans, corrupts, metrics, edges=True)
    print(
        f"\nedge attribution, all 32 pairs: {time.perf_counter() - start:.2f} s "
        f"({len(with_edges.senders)} senders x {len(with_edges.receivers)} receivers per pair)"
    )

    # real patching takes minutes a pair: the first P pairs, each timed beside the edge
    # attribution of the same pair, the two alternating who goes first, so that the machine's
    # load falls on both alike
    P = min(args.patch_pairs, N)
    spent = {"edges": 0.0, "patch": 0.0}
    patched = []
    for i in range(P):

        def edges_of_pair(i=i):
            qkv.attribute(smollm2, cleans[i], corrupts[i], metrics[i], edges=True)

        def patch_of_pair(i=i):
            patched.append(qkv.patch(smollm2, cleans[i], corrupts[i], metrics[i]))

        order = [("edges", edges_of_pair), ("patch", patch_of_pair)]
        for name, call in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            call()
            spent[name] += time.perf_counter() - start
    print(f"the first {P} pairs, each alone, interleaved: real patching (qkv.patch: every "
          f"(layer, head) and (layer, position)) {spent['patch'] / P:.2f} s a pair, edge "
          f"attribution {spent['edges'] / P:.2f} s a pair")  # fmt: skip
    print(f"  edge attribution / real patching: {spent['edges'] / spent['patch']:.4f}")
    print(f"  head attribution (all 32 pairs, per pair) / real patching per pair: "
          f"{times['qkv'] / N / (spent['patch'] / P):.4f}")  # fmt: skip

    effects = torch.stack([p.heads - p.corrupt for p in patched])  # (P, L, H)
    print(f"\nfaithfulness: attribution's heads grid against real patching, first {P} pairs")
    steps = qkv.attribute(smollm2, cleans[:P], corrupts[:P], metrics[:P], steps=5)
    for i in range(P):
        one = Faithfulness.of(found.values["heads"][i], effects[i])
        ig = Faithfulness.of(steps.values["heads"][i], effects[i])
        print(f"  pair {i} ({metrics[i]}): Pearson {one.pearson:.3f}, Spearman "
              f"{one.spearman:.3f}, top-10 overlap {one.overlap:.1f}; EAP-IG (5 steps) "
              f"Pearson {ig.pearson:.3f}")  # fmt: skip
    mean = Faithfulness.of(found.values["heads"][:P].mean(0), effects.mean(0))
    ig = Faithfulness.of(steps.heads, effects.mean(0))
    print(f"  mean grid: Pearson {mean.pearson:.3f}, Spearman {mean.spearman:.3f}, top-10 "
          f"overlap {mean.overlap:.1f}; EAP-IG (5 steps) Pearson {ig.pearson:.3f}, Spearman "
          f"{ig.spearman:.3f}")  # fmt: skip
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
