"""What a finished run learned: the bank probe, or exact match on held-out sequences."""

from __future__ import annotations

import torch

from qkv.models import EncoderDecoder
from qkv.train.config import RunConfig


@torch.no_grad()
def greedy_seq2seq(pretrained, sources: list[str], max_new_tokens: int | None = None) -> list[str]:
    """Each source's most likely target, one token at a time with a KV cache."""
    model, tokenizer = pretrained.model, pretrained.tokenizer
    if not isinstance(model, EncoderDecoder):
        raise ValueError(f"greedy_seq2seq needs an encoder-decoder; {pretrained.source} is not")
    ids, mask = tokenizer.encode_batch(sources, padding_side="right")
    limit = max_new_tokens or pretrained.context_window - 1
    encoded = model.encode(ids, source_mask=mask)
    cache = model.new_cache()
    eos = tokenizer.eos_id
    step = torch.full((len(sources), 1), eos, dtype=torch.long)  # the decoder's start token
    made: list[list[int]] = [[] for _ in sources]
    done = torch.zeros(len(sources), dtype=torch.bool)
    for _ in range(limit):
        logits = model(ids, step, source_mask=mask, encoded=encoded, cache=cache).logits
        step = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        for row, token in enumerate(step[:, 0].tolist()):
            if not done[row]:
                done[row] = token == eos
                if token != eos:
                    made[row].append(token)
        if done.all():
            break
    return [tokenizer.decode(row) for row in made]


def exact_match(pretrained, config: RunConfig) -> tuple[float, int]:
    """The share of the run's held-out examples whose greedy output is exactly the target."""
    from qkv.data import seq2seq_corpus

    d = config.data
    examples = seq2seq_corpus(d.kind, d.heldout, split="heldout", seed=config.train.seed,
                              symbols=d.symbols, min_length=d.min_length,
                              max_length=d.max_length)  # fmt: skip
    right = 0
    for start in range(0, len(examples), 128):
        chunk = examples[start : start + 128]
        outputs = greedy_seq2seq(pretrained, [e.source for e in chunk], d.max_length + 1)
        right += sum(out.split() == e.target.split() for out, e in zip(outputs, chunk, strict=True))
    return right / len(examples), len(examples)


def summary(result, config: RunConfig) -> str:
    """Lines for the end of `qkv train`: losses, where the model is, and what it learned."""
    from qkv import load

    last = result.losses.get(result.steps)
    lines = [f"{result.run}: {result.steps} steps" + (f", loss {last:.4f}" if last else "")]
    if result.val_losses:
        step = max(result.val_losses)
        lines[0] += f", validation loss {result.val_losses[step]:.4f} (step {step})"
    lines.append(f"checkpoint: {result.checkpoint} (qkv.load({str(result.run)!r}) reads it)")
    pretrained = load(result.run)
    if config.data.kind == "bank":
        from qkv.inspect.probe import probe

        found = probe(pretrained, "bank")
        layer, head, share = found.cue_head
        lines.append(
            f'"bank" on {len(found.sentences)} held-out sentences: nearest-centroid sense '
            f"accuracy {found.accuracy[0]:.1%} at the embeddings, {found.accuracy[-1]:.1%} "
            f"after the last layer; layer {layer} head {head} attends most to the word that "
            f"tells the sense in {share:.1%} of them"
        )
    elif config.objective == "seq2seq":
        share, n = exact_match(pretrained, config)
        lines.append(f"exact match on {n} held-out {config.data.kind} examples: {share:.1%}")
    return "\n".join(lines)
