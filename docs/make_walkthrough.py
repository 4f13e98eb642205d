"""Write docs/walkthrough.md: the article, section by section, with qkv's real output.

Every block of output below a command (or a snippet of Python) is what it prints, run by this
script; tests/test_walkthrough.py runs it again and fails if the committed file differs, so
the walkthrough can never go stale.

    python docs/make_walkthrough.py [OUTPUT [RUNS]]   (default: docs/walkthrough.md; RUNS
                                                       keeps the training runs)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
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

# A section's commands run in one folder, in order: `qkv train` writes runs/NAME there and the
# commands after it read the run. Prose between commands is a string.
TRAINED = [
    (
        "Learned by training",
        '"The values of those three matrices are learned throughout training." qkv trains a '
        "small BERT from scratch (2 layers of 4 heads, 64 numbers wide) on generated sentences "
        "in which \"bank\" is the river's or the money's, told by one other word (river, shore, "
        "loan, ...). A run of 0 steps writes the model as it starts: random query, key and value "
        'matrices. "bank" after the last layer tells the senses apart no better than chance '
        "(its vector is the same token at another position), and no head looks at the word "
        "that tells the sense more than at the others.",
        [
            [
                "train",
                "--preset",
                "bank",
                "--set",
                "train.steps=0",
                "--out",
                "runs/bank-before",
                "--quiet",
            ],
            "The same run for its 1,500 steps (the same seed: the same matrices to start from). "
            "The held-out sentences are frames the training never saw:",
            ["train", "--preset", "bank", "--out", "runs/bank", "--quiet"],
            "Layer by layer, the trained model's attention has put the sense into \"bank\"'s "
            "vector:",
            ["probe", "bank", "--model", "runs/bank"],
        ],
    ),
]

CROSS_ATTENTION = [
    (
        "Cross-attention",
        "In cross-attention the query words come from one sequence (the decoder's) and the "
        "key and value words from another (the encoder's). qkv's `MultiHeadAttention` takes a "
        "`context` for this, `qkv.models.EncoderDecoder` uses it in every decoder block, and "
        "`qkv.load` reads BART checkpoints into it (tested against `transformers`). No "
        "pretrained encoder-decoder ships with qkv, so it trains one: the original "
        "transformer's shape (BART's: 2 layers, 4 heads, 128 wide) learning to reverse a "
        "sequence of symbols, here on a third of the preset's schedule at twice its rate:",
        [
            [
                "train",
                "--preset",
                "reverse",
                "--set",
                "train.steps=400",
                "--set",
                "train.lr=2e-3",
                "--set",
                "train.warmup=40",
                "--out",
                "runs/reverse",
                "--quiet",
            ],
            "The decoder reads the target after its start token (`</s> g f e ...`), and the "
            'row of "g" is where it writes the next word, "f": so "g" (a query from the target) '
            'should attend to "f" (a key from the source). `--target` takes the query word from '
            "the target and the key word from the source:",
            [
                "explain",
                "a b c d e f g",
                "--target",
                "g f e d c b a",
                "--query",
                "g",
                "--key",
                "f",
                "--model",
                "runs/reverse",
            ],
            '`qkv show "a b c d e f g" --target "g f e d c b a" --model runs/reverse --out '
            "cross.html` draws every head's cross-attention, target tokens down and source "
            "tokens across: in the head above, the anti-diagonal.",
        ],
    ),
]


@dataclass(frozen=True)
class Python:
    """A snippet of Python, run in its section's namespace (after the section's earlier
    snippets); the walkthrough shows the code, then what it printed."""

    code: str


# `qkv.why` in Python: its command `qkv why` shows the same (docs/why.md)
WHY = [
    (
        "Why does bank attend to river?",
        "The weights say how much; `qkv.why` says why. The stream entering a layer is a sum of "
        "parts (the token's embedding, its position's, each earlier head's output, each "
        "earlier MLP's), and with each norm's scale held at its value in this forward pass the "
        'query of "bank" and the key of "river" are sums over those parts: their score is a '
        "grid of terms, one per (query part, key part), that adds up to it exactly. MiniLM's "
        'layer 2 head 11 on a sentence where "river" comes just before "bank":',
        [
            Python(
                """\
import qkv

minilm = qkv.load("minilm")
why = qkv.why(minilm, "I sat by the river bank", "bank", "river", layer=2, head=11)
print(
    f"score {why.score:.2f} (weight {why.weight:.2f}); {len(why.parts_q)} parts a side, "
    f"{why.terms.numel()} terms summing to {why.total:.2f}"
)
for q, k, value in why.ranked(5):
    print(f"  {q:>8} x {k:<8} {value:+.2f}")
for side in ("query", "key"):
    print(f"by {side} part: " + ", ".join(f"{p} {v:+.2f}" for p, v in why.by_part(side)[:4]))
"""
            ),
            "The largest term is the two words' positions (6 and 5): this head is MiniLM's "
            "second previous-token head (after layer 0 head 2, `qkv heads`), and the learned "
            "positions alone make much of the score. One level further, a head's part of a word "
            'is what that head moved into it from other words: layer 0 head 2 put "river" '
            "into bank's query and \"the\" into river's key. And each top part is removed for "
            "real (its output zeroed at that word, the model rerun from its layer) beside the "
            "linear prediction; they differ because MiniLM's LayerNorms rescale what is left, "
            "and the later layers respond:",
            Python(
                """\
for c in why.carried:
    print(
        f"{c.side} {c.part} {c.value:+.2f}: "
        + ", ".join(f"{t!r} (weight {w:.2f}) {v:+.2f}" for t, i, w, v in c.words[:2])
    )
for c in why.checks:
    print(
        f"{c.side} {c.part} zeroed: score {c.real_score:.2f} (linear {c.predicted_score:.2f}), "
        f"weight {c.real_weight:.2f} (linear {c.predicted_weight:.2f})"
    )
"""
            ),
        ],
    ),
    (
        "SmolLM2's best induction head",
        'An induction head completes a repeat: having seen "A B" once, at the second "A" it '
        'attends to the "B" after the first. Its score needs the key "B" to know what came '
        "before it, which an earlier previous-token head can write into it. SmolLM2 on 50 "
        "random tokens repeated twice, every layer's weights read from its records:",
        [
            Python(
                """\
import torch

import qkv
from qkv.inspect.census import induction_ids, ordinary_ids

smollm2 = qkv.load("smollm2")
stack = smollm2.model  # a Decoder: 30 layers of 9 heads
n = 50  # 50 random tokens, then the same 50 again
ids = induction_ids(ordinary_ids(smollm2.tokenizer, stack.config.vocab_size), 1, n, seed=0)
with torch.inference_mode():
    records = stack(ids, layers="all").records  # every layer's q, k, v: weights on demand
k = torch.arange(n - 1)
induction, previous = {}, {}
for m, record in records.items():
    weights = record.weights()[0]  # (H, T, T)
    for h in range(weights.shape[0]):
        induction[m, h] = float(weights[h, n + k, k + 1].mean())  # x_k again -> x_k+1
        previous[m, h] = float(weights[h, k + 1, k].mean())  # first half: the token before
for name, scores in (("induction", induction), ("previous-token", previous)):
    top = sorted(scores, key=scores.get, reverse=True)[:3]
    print(f"{name:>14}: " + ", ".join(f"L{m}.H{h} {scores[m, h]:.2f}" for m, h in top))
"""
            ),
            "The score of the best one, taken apart at the second occurrence of a token (the "
            "query) and the token that followed its first occurrence (the key). Rotary "
            "positions split the score into content (both words turned as if at the same "
            "position) and position (the rest):",
            Python(
                """\
from qkv.inspect.why import stack_why

layer, head = max(induction, key=induction.get)
spell = [smollm2.tokenizer.id_to_token(i) for i in ids[0].tolist()]
query, key = n + 20, 21  # token 20 seen again; induction points at the token after it
print(f"query {query} {spell[query]!r} (= token 20 {spell[20]!r}), key {key} {spell[key]!r}")
why = stack_why(stack, ids, query, key, layer=layer, head=head, spell=spell, source="smollm2")
print(
    f"L{layer}.H{head}: score {why.score:.2f}, weight {why.weight:.2f}; "
    f"content {why.total - why.position:.2f}, position {why.position:.2f}"
)
for side in ("key", "query"):
    print(f"by {side} part: " + ", ".join(f"{p} {v:+.2f}" for p, v in why.by_part(side)[:4]))
for q, k, value in why.ranked(3):
    print(f"  {q:>7} x {k:<7} {value:+.2f}")
"""
            ),
            "The key's largest part by far is layer 16 head 0's, the strongest previous-token "
            "head: it carried the token before the key, which is the query's own token, into "
            "the key (\u0120 is a space before a token). The query's largest is layer 0's MLP, "
            "the first thing written into the query word after its embedding. The "
            "checks agree that both matter and disagree on how much: zeroing the query's layer "
            "0 MLP takes the weight to 0, but zeroing layer 16 head 0 at the key leaves about "
            "half of it, where the linear prediction leaves none: the rerun recomputes layers "
            "16 to 18, where layer 17 head 8 also carried the query's token into the key, and "
            "RMSNorm's scale grows as a large part goes (the check does not say which does "
            "more):",
            Python(
                """\
for c in why.carried:
    print(
        f"{c.side} {c.part} {c.value:+.2f}: "
        + ", ".join(f"{t!r} at {i} (weight {w:.2f}) {v:+.2f}" for t, i, w, v in c.words[:2])
    )
for c in why.checks:
    print(
        f"{c.side} {c.part} zeroed: score {c.real_score:.2f} (linear {c.predicted_score:.2f}), "
        f"weight {c.real_weight:.2f} (linear {c.predicted_weight:.2f})"
    )
"""
            ),
        ],
    ),
]


def run(args: list[str], folder: Path) -> str:
    """What `qkv ARGS` prints, run in `folder`: the command line's own code, in this process
    (a process of its own for each of the walkthrough's 17 commands would import torch and
    load a model 17 times, a minute of the test that reruns this script)."""
    from typer.testing import CliRunner

    from qkv.cli import app

    previous = os.getcwd()
    os.chdir(folder)
    try:
        result = CliRunner().invoke(app, args, env={"COLUMNS": "100"}, catch_exceptions=False)
    finally:
        os.chdir(previous)
    if result.exit_code != 0:
        raise SystemExit(f"{shown(args)} exited {result.exit_code}:\n{result.stderr}")
    return result.stdout.rstrip()


def run_python(code: str, namespace: dict) -> str:
    """What `code` prints, run in `namespace` in this process."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "<walkthrough>", "exec"), namespace)
    return printed.getvalue().rstrip()


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


def sections(chosen, folder: Path) -> list[str]:
    """Each (title, words, commands) as markdown: commands is one command's arguments or a
    list of commands and prose, run in order in `folder`."""
    parts = []
    for title, words, commands in chosen:
        parts += [f"## {title}", "", words, ""]
        namespace: dict = {}  # a section's snippets share theirs, from the first on
        for item in [commands] if isinstance(commands[0], str) else commands:
            if isinstance(item, str):
                parts += [item, ""]
                continue
            if isinstance(item, Python):
                printed = run_python(item.code, namespace)
                parts += ["```python", item.code.rstrip(), "```", "", "```", printed, "```", ""]
                continue
            output = run(item, folder)
            if "--json" in item:
                output = json.dumps(four_digits(json.loads(output)), ensure_ascii=False)
                if len(output) > 1500:
                    output = output[:1500] + " ..."
            parts += ["```", f"$ {shown(item)}", output, "```", ""]
    return parts


def walkthrough(folder: Path) -> str:
    """The walkthrough's text; the training runs are written under `folder`/runs."""
    parts = [
        "# The article, with a real model's numbers",
        "",
        "Each section of [the article](article.txt), with the qkv command (or "
        "the Python) that shows it and its real output. Generated by `docs/make_walkthrough.py`; "
        "do not edit by hand. The sections that train a model show one run on a 2-core CPU: "
        "its seconds are that machine's, and its other digits can differ on another CPU "
        "(training adds up its round-off); tests/test_walkthrough.py checks what they claim.",
        "",
    ]
    parts += sections(SECTIONS[:2] + TRAINED + SECTIONS[2:], folder)
    parts += sections(CROSS_ATTENTION + PARALLEL + CAUSAL + WHY, folder)
    return "\n".join(parts)


def main() -> None:
    """python docs/make_walkthrough.py [OUTPUT [RUNS]]: RUNS keeps the training runs (by
    default they are written to a temporary folder and deleted)."""
    here = Path(__file__).with_name("walkthrough.md")
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else here
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(temporary)
        folder.mkdir(parents=True, exist_ok=True)
        text = walkthrough(folder.resolve())
    staging = out.with_name(out.name + ".tmp")
    staging.write_text(text)
    os.replace(staging, out)


if __name__ == "__main__":
    main()
