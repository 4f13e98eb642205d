"""Write docs/walkthrough.md: the article, section by section, with qkv's real output.

Every block of output below a command is what that command prints, run by this script;
tests/test_walkthrough.py runs it again and fails if the committed file differs, so the
walkthrough can never go stale.

    python docs/make_walkthrough.py [OUTPUT]   (default: docs/walkthrough.md)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SENTENCE = "The bank on the side of the river"

SECTIONS = [
    (
        "The algorithm",
        'The article follows one pair: "bank" is the query word (getting context), "river" '
        "the key word (giving context). `qkv explain` runs MiniLM (all-MiniLM-L6-v2) on the "
        "sentence and redoes the chosen head's work one step at a time with the `loop` "
        "backend, the article's algorithm written as a loop. It picks the layer and head "
        'where "bank" attends most to "river", and shows that the sum it gets is the '
        "model's own attention output.",
        ["explain", SENTENCE, "--query", "bank", "--key", "river"],
    ),
    (
        "Normalization",
        "Step 3 divides the dot product by the square root of the vector size, and step 4 "
        "applies softmax so one query's weights sum to 100%. In a later layer the same pair "
        "gets a different weight: the vectors entering it already carry context.",
        ["explain", SENTENCE, "--query", "bank", "--key", "river", "--layer", "5", "--head", "0"],
    ),
    (
        "Multiple heads",
        "Each head has its own query, key and value matrices and so its own pattern. "
        "`qkv show` draws all of them; here one head's weights as JSON, head 3 of layer 0 "
        "(the command prints every digit of float32; shown here to 4 significant digits, "
        "beyond which the last additions' order on a given CPU decides).",
        [
            "explain",
            SENTENCE,
            "--query",
            "bank",
            "--key",
            "river",
            "--layer",
            "0",
            "--head",
            "3",
            "--json",
        ],
    ),
    (
        "Multiple layers",
        'Layer after layer, context is added again. The sense probe follows "bank" through '
        "the layers in 8 river sentences and 8 money sentences: before attention every "
        '"bank" is the same token; after each layer the two senses drift apart.',
        ["probe", "bank"],
    ),
    (
        "Tokens",
        "Models read tokens, not words. MiniLM splits \"riverbank\" into two tokens, 'river' "
        "and '##bank'; qkv names a word by its text and uses its first token.",
        [
            "explain",
            "The riverbank flooded after the storm",
            "--query",
            "flooded",
            "--key",
            "riverbank",
        ],
    ),
    (
        "Position embeddings",
        "MiniLM adds a learned position vector to each token's vector. SmolLM2 (a decoder "
        "with rotary positions) instead turns each query and key vector by an angle that "
        "grows with its position; it is also causal (a word sees only the words before it) "
        "and shares each key/value head between three query heads. All three show here.",
        [
            "explain",
            SENTENCE,
            "--model",
            "smollm2",
            "--query",
            "river",
            "--key",
            "bank",
            "--layer",
            "12",
            "--head",
            "4",
        ],
    ),
]

CAUSAL = [
    (
        "Asked causally: hide a word",
        'Attention weights say how much "bank" looks at "river"; they do not say what "river" '
        'changes. `qkv hide` takes "river" away from "bank" (a mask, exactly as padding: the '
        "softmax renormalizes over the other words) in one head at a time, then in all of them, "
        'and measures how much the final vector of "bank" moves.',
        ["hide", SENTENCE, "--key", "river", "--query", "bank", "--top", "5"],
    ),
    (
        "Asked causally: hide the context",
        'The sense probe again, and then every other word hidden from "bank" in every layer '
        'and head: without its context, the two senses of "bank" no longer separate.',
        ["probe", "bank", "--hide-context"],
    ),
]

PARALLEL = [
    (
        "Parallel computation",
        "The article ends its algorithm with a note: every pair's dot product is independent of "
        "the others, so they can all be computed at once. qkv's `loop` backend is the article "
        "literally, one (query, key) pair at a time in float64; the fused backends compute "
        "every pair of every head in a few matrix products. Same answer, to float32's "
        "precision; the loop's cost grows much faster with the length (the ratios depend on "
        "the machine: tests/test_walkthrough.py compares this section without them).",
        ["backends", "--compare", "16,64,128"],
    ),
]

CROSS_ATTENTION = """## Cross-attention

In cross-attention the query words come from one sequence (the decoder's) and the key and
value words from another (the encoder's). qkv's `MultiHeadAttention` takes a `context` for
this, `qkv.models.EncoderDecoder` uses it in every decoder block, and `qkv.load` reads BART
checkpoints into it (tested against `transformers`). For such a model,
`qkv explain SOURCE --target TARGET --query WORD --key WORD --model FOLDER` takes the query
word from the target and the key word from the source. No pretrained encoder-decoder ships
with qkv, so there is no real output to show here; the tests trace a small random BART and
compare its weights with `transformers`' cross-attentions.
"""


def run(args: list[str]) -> str:
    env = dict(os.environ, COLUMNS="100")
    result = subprocess.run(
        [sys.executable, "-m", "qkv.cli", *args], capture_output=True, text=True, env=env,
        check=True, timeout=600,
    )  # fmt: skip
    return result.stdout.rstrip()


def four_digits(value):
    """Every float in a JSON value to 4 significant digits: the digits after those differ
    from one CPU to another (float32 sums in another order), and this file must not.

    >>> four_digits({"w": [0.36934924125671387, -1.2476122379302979e-05, 3], "n": "x"})
    {'w': [0.3693, -1.248e-05, 3], 'n': 'x'}
    """
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, list):
        return [four_digits(v) for v in value]
    if isinstance(value, dict):
        return {k: four_digits(v) for k, v in value.items()}
    return value


def shown(args: list[str]) -> str:
    return "qkv " + " ".join(f'"{a}"' if " " in a else a for a in args)


def sections(chosen) -> list[str]:
    parts = []
    for title, words, args in chosen:
        output = run(args)
        if "--json" in args:
            output = json.dumps(four_digits(json.loads(output)), ensure_ascii=False)
            if len(output) > 1500:
                output = output[:1500] + " ..."
        parts += [f"## {title}", "", words, "", "```", f"$ {shown(args)}", output, "```", ""]
    return parts


def walkthrough() -> str:
    parts = [
        "# The article, with a real model's numbers",
        "",
        "Each section of `shared/seed/self-attention-article.txt`, with the qkv command that "
        "shows it and that command's real output. Generated by `docs/make_walkthrough.py`; "
        "do not edit by hand.",
        "",
    ]
    parts += sections(SECTIONS)
    parts.append(CROSS_ATTENTION)
    parts += sections(PARALLEL + CAUSAL)
    return "\n".join(parts)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("walkthrough.md")
    text = walkthrough()
    temporary = out.with_name(out.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, out)


if __name__ == "__main__":
    main()
