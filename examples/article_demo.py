"""The article's steps on its own sentence: `attend` traced pair by pair, then a model.

Run with `make demo`. The matrices here are freshly initialized, not trained: this shows
the mechanism's arithmetic, not what a pretrained model has learned (that needs the
pretrained loaders, which come next). Words stand in for tokens, one vector each.
"""

from __future__ import annotations

import torch

from qkv.attention import attend, explain_choice, trace
from qkv.models import Encoder, EncoderConfig
from qkv.nn import BlockConfig

SENTENCE = ["The", "bank", "on", "the", "side", "of", "the", "river"]


def vector(t: torch.Tensor, n: int = 4) -> str:
    shown = ", ".join(f"{x:+.3f}" for x in t[:n].tolist())
    return f"[{shown}, ...] ({t.numel()} numbers)"


def main() -> None:
    torch.manual_seed(0)
    T, C, D = len(SENTENCE), 32, 8
    bank, river = SENTENCE.index("bank"), SENTENCE.index("river")
    embeddings = torch.randn(T, C)  # one vector per word
    query_matrix, key_matrix, value_matrix = (torch.randn(C, D) / C**0.5 for _ in range(3))

    print(f"Sentence: {' '.join(SENTENCE)}  ({T} words, {C} numbers each)\n")
    q = (embeddings @ query_matrix).view(1, 1, T, D)  # (B, H, T, D)
    k = (embeddings @ key_matrix).view(1, 1, T, D)
    v = (embeddings @ value_matrix).view(1, 1, T, D)

    one = trace(q, k, v)[bank]  # head 0, query word "bank"
    pair = one.pairs[river]
    print('Query word "bank", key word "river" (the loop backend, the article literally):')
    print(f"  1. query vector          {vector(one.query_vector)}")
    print(f"  2. key vector            {vector(pair.key_vector)}")
    print(f"  3. attention scalar      {pair.attention_scalar.item():+.4f}  (query . key)")
    print(f"  4. scaled scalar         {pair.scaled_scalar.item():+.4f}  (/ sqrt({D}))")
    print(f"     normalized weight     {pair.normalized_weight.item():.4f}  (softmax over all {T})")
    print(f"  5. value vector          {vector(pair.value_vector)}")
    print(f"  6. scaled value vector   {vector(pair.scaled_value_vector)}")
    print(f"  7. sum over all {T} words  {vector(one.contextualized)}\n")

    print('Every key word\'s weight for "bank" (they sum to 1):')
    for word, p in zip(SENTENCE, one.pairs, strict=True):
        weight = p.normalized_weight.item()
        print(f"  {word:>6}  {weight:.4f}  " + "#" * round(60 * weight))
    print(f"  sum     {one.weights.sum().item():.4f}\n")

    fused = attend(q, k, v)
    gap = (fused[0, 0, bank].double() - one.contextualized).abs().max().item()
    print(
        f"attend(q, k, v) runs on {explain_choice(q, k, v).backend!r}; "
        f"its vector for 'bank' differs from the loop's by {gap:.1e}\n"
    )

    vocab = {word.lower(): i for i, word in enumerate(dict.fromkeys(w.lower() for w in SENTENCE))}
    ids = torch.tensor([[vocab[w.lower()] for w in SENTENCE]])
    config = EncoderConfig(
        vocab_size=len(vocab), num_layers=6, block=BlockConfig(width=64, num_heads=8)
    )
    model = Encoder(config).eval()
    with torch.no_grad():
        out = model(ids, record=[(layer, 0) for layer in range(config.num_layers)])
    print(
        f"An untrained 6-layer, 8-head encoder ({sum(p.numel() for p in model.parameters()):,} "
        f"parameters) over the sentence: hidden {tuple(out.hidden.shape)}"
    )
    for (layer, head), weights in out.attentions.items():
        row = weights[0, bank]
        top = row.argmax().item()
        print(
            f"  layer {layer} head {head}: 'bank' attends most to {SENTENCE[top]!r} "
            f"({row[top].item():.3f}); to 'river' {row[river].item():.3f}"
        )


if __name__ == "__main__":
    main()
