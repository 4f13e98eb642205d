"""docs/walkthrough.md is what docs/make_walkthrough.py writes today: it cannot go stale. And
the runs it trains, checked for what the walkthrough says of them.

The walkthrough trains the bank preset as a user runs it (`qkv train --preset bank`, about
30 s here): on held-out sentence frames, "bank"'s last-layer vector tells the senses apart
and a head attends from "bank" to the word that tells the sense; before training (a run of
0 steps) neither. And the reverse preset on a third of its schedule at twice its learning
rate (its loss falls through 0.1 near step 200 either way; 1,200 steps put it at 0.0015,
these 400 at 0.007): the encoder-decoder reverses unseen sequences, and its
cross-attention is the anti-diagonal. A training run adds up the CPU's round-off, so the
outputs of those sections differ from one machine to another (their digits, and so which
head is strongest): their prose and commands are compared, and what they claim is asserted
on the runs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv.data import bank_corpus, seq2seq_corpus
from qkv.data.bank import _HELDOUT_FRAMES, FRAMES

REPO = Path(__file__).parents[1]
DOCS = REPO / "docs"
SECTIONS = ("The algorithm", "Normalization", "Learned by training", "Multiple heads",
            "Multiple layers", "Tokens", "Position embeddings", "Cross-attention",
            "Parallel computation", "Asked causally: hide a word",
            "Asked causally: hide the context", "Why does bank attend to river?",
            "SmolLM2's best induction head")  # fmt: skip
TRAINED = ("Learned by training", "Cross-attention")


def qkv_command(*args: str) -> subprocess.CompletedProcess:
    """`qkv ARGS` as the command line runs it, in this process (as the walkthrough runs its
    commands: a process each would import torch again, seconds a command)."""
    from typer.testing import CliRunner

    from qkv.cli import app

    done = CliRunner().invoke(app, list(args))
    if done.exception is not None and not isinstance(done.exception, SystemExit):
        raise done.exception
    return subprocess.CompletedProcess(args, done.exit_code, done.stdout, done.stderr)


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory) -> tuple[str, Path]:
    """The walkthrough written today, and the folder its commands ran in (runs/ under it)."""
    folder = tmp_path_factory.mktemp("walkthrough")
    out = folder / "walkthrough.md"
    subprocess.run([sys.executable, str(DOCS / "make_walkthrough.py"), str(out), str(folder)],
                   check=True, timeout=900)  # fmt: skip
    return out.read_text(), folder


@pytest.fixture(scope="module")
def bank_run(walkthrough) -> tuple[Path, str]:
    """The bank preset's run and what `qkv train` printed of it."""
    text, folder = walkthrough
    return folder / "runs" / "bank", _output(text, "qkv train --preset bank --out")


@pytest.fixture(scope="module")
def reverse_run(walkthrough) -> tuple[Path, str]:
    text, folder = walkthrough
    return folder / "runs" / "reverse", _output(text, "qkv train --preset reverse")


def _output(text: str, command: str) -> str:
    """What the walkthrough shows below `$ COMMAND...`, to its block's end."""
    block = text[text.index(f"$ {command}") :]
    return block[block.index("\n") + 1 : block.index("\n```")]


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## ", text, flags=re.M)
    return {part.split("\n", 1)[0]: part for part in parts[1:]}


def test_the_committed_walkthrough_is_the_real_output_of_today(walkthrough):
    fresh, _ = walkthrough
    committed = (DOCS / "walkthrough.md").read_text()
    # how many times longer the loop takes is the machine's: every other character is not
    ratios = re.compile(r"the loop takes [\d,]+x as long")
    assert ratios.search(committed), "the parallel computation section shows its ratios"
    texts = [_sections(ratios.sub("the loop takes Nx as long", t)) for t in (fresh, committed)]
    assert list(texts[0]) == list(texts[1]) == list(SECTIONS), (
        "run: python docs/make_walkthrough.py"
    )
    for title in SECTIONS:
        ours, theirs = (t[title] for t in texts)
        if title in TRAINED:  # a trained model's outputs are its machine's: prose and commands
            ours, theirs = _commands_only(ours), _commands_only(theirs)
        assert ours == theirs, f"{title}: run python docs/make_walkthrough.py"


def _commands_only(section: str) -> str:
    """The section with each command's output left out (every block keeps its `$` line)."""
    blocks = re.compile(r"^```\n(\$ [^\n]*)\n.*?^```$", flags=re.M | re.S)
    assert blocks.search(section), "a trained section shows its commands and their output"
    return blocks.sub(r"```\n\1\n(output)\n```", section)


def test_before_training_bank_is_no_sense_and_no_head_looks_at_its_cue(walkthrough):
    _, folder = walkthrough
    done = qkv_command("probe", "bank", "--model", str(folder / "runs" / "bank-before"),
                       "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert max(found["accuracy"]) <= 0.65, found["accuracy"]  # chance: 8 frames, 2 senses
    assert found["cue_head"]["share"] <= 0.3, found["cue_attention"]  # about 1 of 7 words
    assert "runs/bank-before: 0 steps" in _output(walkthrough[0], "qkv train --preset bank --set")


def test_bank_senses_separate_through_attention_on_unseen_frames(bank_run):
    run, _ = bank_run
    done = qkv_command("probe", "bank", "--model", str(run), "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    heldout = bank_corpus(256, split="heldout", seed=0)
    assert found["sentences"] == [s.text for s in heldout]
    assert found["labels"] == [s.sense for s in heldout] and found["cues"] == [
        s.cue for s in heldout
    ]
    assert {s.frame for s in heldout} <= set(range(len(FRAMES) - len(_HELDOUT_FRAMES), len(FRAMES)))
    embeddings, last = found["accuracy"][0], found["accuracy"][-1]
    assert last >= 0.95, found["accuracy"]
    assert 0.3 <= embeddings <= 0.65, found["accuracy"]  # chance: one token, any position
    assert found["cue_head"]["share"] >= 0.8, found["cue_attention"]
    cue = torch.tensor(found["cue_attention"])
    assert found["cue_head"]["share"] == float(cue.max())


def test_bank_training_reports_what_it_learned(bank_run):
    run, stdout = bank_run
    assert stdout.startswith("runs/bank: 1500 steps, loss ")  # run in the folder above runs/
    assert "checkpoint: runs/bank/checkpoints/step-001500 " in stdout
    assert (run / "checkpoints" / "step-001500" / "model.safetensors").is_file()
    assert "after the last layer" in stdout and "attends most to the word that tells" in stdout


def test_a_bank_run_explains_shows_and_exports(bank_run, tmp_path):
    from transformers import AutoModelForMaskedLM

    run, _ = bank_run
    sentence = bank_corpus(2, split="heldout", seed=5)[0]
    done = qkv_command("explain", sentence.text, "--query", "bank", "--key", sentence.cue,
                       "--model", str(run), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    traced = json.loads(done.stdout)
    assert traced["tokens"][traced["key_index"]] == sentence.cue
    assert abs(sum(traced["weights"]) - 1.0) < 1e-5
    assert torch.allclose(torch.tensor(traced["contextualized"]),
                          torch.tensor(traced["model_output"]), atol=1e-5)  # fmt: skip
    page = qkv_command(
        "show", sentence.text, "--model", str(run), "--out", str(tmp_path / "a.html")
    )
    assert page.returncode == 0 and (tmp_path / "a.html").stat().st_size > 0

    pretrained = qkv.load(run)
    pretrained.save(tmp_path / "hf")
    theirs = AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    ids, mask = pretrained.tokenizer.encode_batch([sentence.text, "the bank ."])
    with torch.no_grad():
        mine = pretrained.model(ids, attention_mask=mask, logits=True).logits
        expected = theirs(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.allclose(mine[real], expected[real], atol=1e-4)


def test_reverse_reaches_exact_match_on_unseen_sequences(reverse_run):
    run, stdout = reverse_run
    assert "exact match on 512 held-out reverse examples" in stdout
    pretrained = qkv.load(run)
    examples = seq2seq_corpus("reverse", 200, split="heldout", seed=0)
    outputs = pretrained.generate([e.source for e in examples], 13)
    right = sum(o.split() == e.target.split() for o, e in zip(outputs, examples, strict=True))
    assert right / len(examples) >= 0.99
    done = qkv_command("generate", "a b c d e f g", "--model", str(run))
    assert done.returncode == 0 and done.stdout == "g f e d c b a\n", done.stderr


def test_reverse_cross_attention_is_the_anti_diagonal(reverse_run, tmp_path):
    run, _ = reverse_run
    pretrained = qkv.load(run)
    examples = seq2seq_corpus("reverse", 50, split="heldout", seed=0)
    hits = None
    for example in examples:
        seen = pretrained.attentions(example.source, target=example.target)
        n = len(example.source.split())
        # decoder row i (the start token, then target words) writes target word i, which
        # copies source word n-1-i: source token 1 + n-1-i after <s>
        rows = seen.weights[:, :, :n].argmax(-1)  # (L, H, n)
        expected = torch.tensor([n - i for i in range(n)])
        share = (rows == expected).float().mean(-1)  # (L, H)
        hits = share if hits is None else hits + share
    best = float(hits.max()) / len(examples)
    assert best >= 0.95, hits / len(examples)
    out = tmp_path / "cross.png"
    source = examples[0].source
    done = qkv_command("show", source, "--target", " ".join(reversed(source.split())),
                       "--model", str(run), "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_probe_reads_labels_and_cues_from_a_file(bank_run, tmp_path):
    run, _ = bank_run
    chosen = bank_corpus(8, split="heldout", seed=9)
    lines = [f"{s.sense}\t{s.cue}\t{s.text}" for s in chosen]
    (tmp_path / "s.tsv").write_text("\n".join(lines) + "\n")
    done = qkv_command("probe", "bank", "--model", str(run), "--sentences",
                       str(tmp_path / "s.tsv"), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["cues"] == [s.cue for s in chosen] and found["labels"] == [s.sense for s in chosen]
    assert len(found["cue_attention"]) == 2 and len(found["cue_attention"][0]) == 4


def test_a_reverse_run_exports_to_transformers_with_equal_logits(reverse_run, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    run, _ = reverse_run
    pretrained = qkv.load(run)
    pretrained.save(tmp_path / "hf")
    theirs = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    source = torch.tensor([pretrained.tokenizer.encode("a b c d e").ids])
    target, _, _ = pretrained.decoder_input("e d c b a")
    with torch.no_grad():
        mine = pretrained.model(source, target).logits
        expected = theirs(input_ids=source, decoder_input_ids=target).logits
    assert torch.allclose(mine, expected, atol=1e-4)
    assert (
        theirs.generate(source, max_new_tokens=8, num_beams=1, do_sample=False)[0].tolist()[1:6]
        == pretrained.tokenizer.encode("e d c b a", add_special_tokens=False).ids
    )
