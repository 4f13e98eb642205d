"""The training loop on tiny models: it learns, checkpoints atomically, resumes exactly,
and refuses bad input with one clear line."""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, metrics, qkv_command, text_config, tiny, write_toml

import qkv
from qkv.train import train
from qkv.train.checkpoint import checkpoints, step_of
from qkv.train.loop import _param_groups


@pytest.fixture(scope="module")
def text_run(corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "text"
    config = text_config(corpus, train={"steps": 12, "checkpoint_every": 4, "keep": 2})
    return config, train(config, run, quiet=True)


def test_a_text_run_learns_and_logs_every_step(text_run):
    _, result = text_run
    records = metrics(result.run)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all({"loss", "lr", "tokens", "tokens_per_s"} <= set(r) for r in records)
    # 12 steps of a tiny GPT-2 on repetitive text: the loss falls well below its start
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6, 9, 12]
    assert result.losses == {r["step"]: r["loss"] for r in records}
    # every global batch is 8 sequences of 32 tokens
    assert {r["tokens"] for r in records} == {8 * 32}


def test_the_schedule_warms_up_then_decays_as_a_cosine(text_run):
    config, result = text_run
    t = config.train
    for record in metrics(result.run):
        # logged after the scheduler stepped: the rate of the step to come
        step = record["step"]
        if step < t.warmup:
            expected = t.lr * (step + 1) / (t.warmup + 1)
        else:
            progress = min(1.0, (step - t.warmup) / (t.steps - t.warmup))
            expected = t.min_lr + (t.lr - t.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
        assert record["lr"] == pytest.approx(expected, rel=1e-12)


def test_only_the_last_checkpoints_are_kept_each_a_model_folder(text_run):
    _, result = text_run
    kept = checkpoints(result.run)
    assert [step_of(p) for p in kept] == [8, 12]
    assert result.checkpoint == kept[-1]
    assert sorted(p.name for p in kept[-1].iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "trainer.pt",
    ]  # fmt: skip
    hidden = [p for p in (result.run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert hidden == []  # no staging folder left behind


def test_a_run_folder_loads_generates_and_exports_to_transformers(text_run, tmp_path):
    from transformers import AutoModelForCausalLM

    _, result = text_run
    pretrained = qkv.load(result.run)
    assert pretrained.run.model.width == 32 and pretrained.family.name == "gpt2"
    assert isinstance(pretrained.generate("the bank", 5), str)
    pretrained.save(tmp_path / "hf")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([pretrained.tokenizer.encode("anna saw the reeds near the bank .").ids])
    with torch.no_grad():
        mine = pretrained.model(ids).logits
        expected = theirs(ids).logits
    assert torch.allclose(mine, expected, atol=1e-5)


def test_weight_decay_skips_biases_and_norms():
    from qkv.models import Decoder, DecoderConfig
    from qkv.nn import BlockConfig

    model = Decoder(DecoderConfig(vocab_size=20, num_layers=1, block=BlockConfig(8, 2)))
    decay, no_decay = _param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.dim() == 2 for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} == {
        n for n, p in model.named_parameters() if p.dim() == 1
    }
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("arch,kind", [("bert", "bank"), ("gpt2", "bank"), ("bart", "swap"),
                                       ("llama", "bank")])  # fmt: skip
def test_every_objective_trains_and_reloads_equal(arch, kind, tmp_path):
    config = tiny(arch, kind, train={"steps": 4, "checkpoint_every": 0})
    result = train(config, tmp_path / "run", quiet=True)
    assert result.steps == 4 and all(math.isfinite(v) for v in result.losses.values())
    assert result.losses[4] < result.losses[1]
    pretrained = qkv.load(tmp_path / "run")
    assert pretrained.family.name == arch
    # resuming a finished run trains nothing and points at its last checkpoint
    again = train(config, tmp_path / "run", resume=True, quiet=True)
    assert again.steps == 4 and again.losses == {} and again.checkpoint == result.checkpoint


def _kill_at_random_step(args: list[str], run, lowest: int, highest: int) -> int:
    """Start `qkv train ARGS`, SIGKILL it once metrics.jsonl reaches a random step."""
    target = random.Random(os.getpid()).randint(lowest, highest)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    process = subprocess.Popen([sys.executable, "-m", "qkv.cli", *args], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            log = run / "metrics.jsonl"
            done = len(log.read_text().splitlines()) if log.exists() else 0
            if done >= target or process.poll() is not None:
                break
            time.sleep(0.01)
        assert process.poll() is None, "the run finished before it could be killed"
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    return target


def test_a_killed_run_resumes_bit_for_bit(corpus, tmp_path):
    """SIGKILL at a random step, resume from the last checkpoint: every loss, validation loss
    and learning rate equals an uninterrupted run's exactly (same CPU, same threads)."""
    config = text_config(
        corpus, train={"steps": 40, "checkpoint_every": 7, "accumulate": 2, "eval_every": 5},
        model={"dropout": 0.1},  # dropout draws from the generator the checkpoint saves
    )  # fmt: skip
    toml = write_toml(config, tmp_path / "tiny.toml")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert qkv_command("train", str(toml), "--out", str(whole), "--quiet").returncode == 0
    _kill_at_random_step(["train", str(toml), "--out", str(killed), "--quiet"], killed, 9, 33)
    assert checkpoints(killed), "killed before the first checkpoint"
    assert step_of(checkpoints(killed)[-1]) < 40
    resumed = qkv_command("train", "--resume", "--out", str(killed), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    for a, b in zip(metrics(whole), metrics(killed), strict=True):
        assert (a["step"], a["loss"], a.get("val_loss"), a["lr"]) == (
            b["step"], b["loss"], b.get("val_loss"), b["lr"]
        )  # fmt: skip
    mine = qkv.load(killed).model.state_dict()
    theirs = qkv.load(whole).model.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_a_run_of_0_steps_is_the_model_before_training_and_resumes_as_one_run(tmp_path):
    """train.steps=0 writes the initial weights as checkpoint 0 (what the walkthrough probes
    before training); resumed to N steps it is the run trained N steps from the start."""
    config = tiny("bert", "bank", train={"steps": 4, "checkpoint_every": 0, "eval_every": 2})
    whole = train(config, tmp_path / "whole", quiet=True)
    before = train(config.override(["train.steps=0"]), tmp_path / "before", quiet=True)
    assert before.steps == 0 and step_of(before.checkpoint) == 0 and before.losses == {}
    assert not (tmp_path / "before" / "metrics.jsonl").exists() or not metrics(tmp_path / "before")
    start = qkv.load(tmp_path / "before").model.state_dict()
    trained = qkv.load(tmp_path / "whole").model.state_dict()
    assert not all(torch.equal(start[k], trained[k]) for k in trained), "4 steps changed nothing"
    resumed = train(config, tmp_path / "before", resume=True, quiet=True)
    assert resumed.losses == whole.losses and resumed.val_losses == whole.val_losses
    after = qkv.load(tmp_path / "before").model.state_dict()
    assert all(torch.equal(after[k], trained[k]) for k in trained)
    with pytest.raises(ValueError, match=r"train\.steps must be >= 0, got -1"):
        config.override(["train.steps=-1"]).check()


# ---------------------------------------------------------------------------- bad input


def test_an_empty_corpus_is_one_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_text("   \n\n", encoding="utf-8")
    config = tiny("gpt2", "text", data={"paths": [str(tmp_path / "empty.txt")]})
    with pytest.raises(ValueError, match="empty"):
        train(config, tmp_path / "run", quiet=True)


def test_a_corpus_smaller_than_one_block_is_refused(tmp_path):
    (tmp_path / "small.txt").write_text("a few words\n\nand a few more\n", encoding="utf-8")
    config = tiny("gpt2", "text", data={"paths": [str(tmp_path / "small.txt")],
                                        "tokenizer": "char"})  # fmt: skip
    with pytest.raises(ValueError, match=r"fewer than one training block of 33"):
        train(config, tmp_path / "run", quiet=True)


def test_bytes_that_are_not_utf8_name_the_file_and_place(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_bytes(b"fine text\nmore\xff here\n")
    result = qkv_command("train", "--preset", "gpt", "--out", str(tmp_path / "run"),
                         "--set", f"data.paths=['{bad}']", "--quiet")  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0  # one line
    assert "notes.txt: byte 14 (line 2, column 5) is not UTF-8" in result.stderr


def test_an_unknown_config_key_lists_the_close_ones(tmp_path):
    result = qkv_command("train", "--preset", "bank", "--set", "train.lernrate=1",
                         "--out", str(tmp_path / "run"))  # fmt: skip
    assert result.returncode == 2
    assert "unknown config key 'train.lernrate'" in result.stderr
    toml = tmp_path / "bad.toml"
    toml.write_text("[model]\nwidht = 64\n")
    result = qkv_command("train", str(toml), "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "did you mean model.width" in result.stderr
    assert not (tmp_path / "run").exists()


def test_resuming_with_an_incompatible_config_is_refused(tmp_path):
    config = tiny("bert", "bank", train={"steps": 2, "checkpoint_every": 0})
    train(config, tmp_path / "run", quiet=True)
    wider = config.override(["model.width=64"])
    with pytest.raises(ValueError, match=r"model\.width: 32 -> 64"):
        train(wider, tmp_path / "run", resume=True, quiet=True)
    longer = config.override(["train.steps=3"])  # more steps are a compatible change
    assert train(longer, tmp_path / "run", resume=True, quiet=True).steps == 3
    with pytest.raises(ValueError, match="not empty"):
        train(config, tmp_path / "run", quiet=True)
    with pytest.raises(ValueError, match="no run to resume"):
        train(config, tmp_path / "elsewhere", resume=True, quiet=True)


def test_a_full_disk_keeps_the_last_checkpoint_intact(tmp_path):
    """A real write failure: the resumed process may write no file over 64 KB (RLIMIT_FSIZE,
    with SIGXFSZ ignored so writes fail with EFBIG instead of killing it), so its checkpoint
    cannot be written; the previous one must stay whole and loadable."""
    import resource

    config = tiny("bert", "bank", train={"steps": 2, "checkpoint_every": 0})
    toml = write_toml(config, tmp_path / "bank.toml")
    run = tmp_path / "run"
    assert qkv_command("train", str(toml), "--out", str(run), "--quiet").returncode == 0
    before = {p.name: p.read_bytes() for p in checkpoints(run)[-1].iterdir()}

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    result = qkv_command("train", "--resume", "--out", str(run), "--set", "train.steps=4",
                         "--quiet", preexec_fn=limit_file_size)  # fmt: skip
    assert result.returncode == 2
    assert "could not write checkpoint step 4" in result.stderr
    assert "the last checkpoint (step 2) is intact" in result.stderr
    assert [step_of(p) for p in checkpoints(run)] == [2]
    assert {p.name: p.read_bytes() for p in checkpoints(run)[-1].iterdir()} == before
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000002"]
    assert qkv.load(run).family.name == "bert"


def test_plot_draws_the_loss_curves(text_run, tmp_path):
    _, result = text_run
    out = qkv_command("plot", str(result.run), "--out", str(tmp_path / "loss.png"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = qkv_command("plot", str(tmp_path))
    assert bad.returncode == 2 and "no metrics.jsonl" in bad.stderr


def test_the_progress_bar_shows_loss_rate_speed_and_time_left(tmp_path):
    toml = write_toml(tiny("gpt2", "bank", train={"steps": 3, "checkpoint_every": 0}),
                      tmp_path / "tiny.toml")  # fmt: skip
    shown = qkv_command("train", str(toml), "--out", str(tmp_path / "a"))
    assert shown.returncode == 0, shown.stderr
    bar = shown.stdout.splitlines()[0]
    for part in ("3/3", "loss ", "lr ", "tok/s", "left"):
        assert part in bar, bar
    quiet = qkv_command("train", str(toml), "--out", str(tmp_path / "b"), "--quiet")
    assert quiet.returncode == 0 and "tok/s" not in quiet.stdout
    assert quiet.stdout.startswith(f"{tmp_path / 'b'}: 3 steps, loss ")
