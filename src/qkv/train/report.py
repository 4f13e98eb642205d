"""What a finished run learned: the bank probe, or exact match on held-out sequences."""

from __future__ import annotations

from qkv.data import seq2seq_corpus
from qkv.inspect.probe import probe
from qkv.io.run_config import RunConfig
from qkv.pretrained import load


def exact_match(pretrained, config: RunConfig) -> tuple[float, int]:
    """The share of the run's held-out examples whose greedy output is exactly the target."""
    d = config.data
    examples = seq2seq_corpus(d.kind, d.heldout, split="heldout", seed=config.train.seed,
                              symbols=d.symbols, min_length=d.min_length,
                              max_length=d.max_length)  # fmt: skip
    right = 0
    for start in range(0, len(examples), 128):
        chunk = examples[start : start + 128]
        outputs = pretrained.generate([e.source for e in chunk], d.max_length + 1)
        outputs = [outputs] if isinstance(outputs, str) else outputs
        right += sum(out.split() == e.target.split() for out, e in zip(outputs, chunk, strict=True))
    return right / len(examples), len(examples)


def summary(result, config: RunConfig) -> str:
    """Lines for the end of `qkv train`: losses, where the model is, and what it learned."""
    last = result.losses.get(result.steps)
    lines = [f"{result.run}: {result.steps} steps" + (f", loss {last:.4f}" if last else "")]
    lines[0] += f" ({result.seconds:.0f} s)" if result.losses else ""
    if result.val_losses:
        step = max(result.val_losses)
        lines[0] += f", validation loss {result.val_losses[step]:.4f} (step {step})"
    lines.append(f"checkpoint: {result.checkpoint} (qkv.load({str(result.run)!r}) reads it)")
    pretrained = load(result.run)
    if config.data.kind == "bank":
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
