"""Hostile input to `qkv train` (issue 14): every value it reads is checked where it enters,
a run that goes wrong stops with one line and keeps its last good checkpoint, and what a
failed or killed run leaves never blocks the next one."""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import REPO, metrics, tiny, write_toml

import qkv
from hostile import assert_one_line_error, leftovers, run_qkv
from qkv.io.files import write_atomically, write_folder_atomically
from qkv.io.runs import checkpoint_folder
from qkv.train import RunConfig, train
from qkv.train.checkpoint import checkpoints, step_of
from qkv.train.plot import read_metrics

ENV = {"PYTHONPATH": str(REPO / "src")}


def tinier(**train_keys) -> RunConfig:
    """A 1-layer GPT-2 on the bank sentences: a few steps take well under a second."""
    keys = {"steps": 4, "batch_size": 4, "checkpoint_every": 2, **train_keys}
    return tiny("gpt2", "bank", model={"layers": 1, "width": 16}, train=keys)


def strict_json(line: str) -> dict:
    """json.loads that refuses NaN and Infinity, as every reader but Python's does."""
    return json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line}"))


# ------------------------------------------------------------------ numbers in the config


FLOAT_KEYS = [k for k, v in RunConfig().flat().items() if isinstance(v, float)]


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e999"])
def test_every_float_key_refuses_a_value_that_is_not_finite(text, tmp_path):
    assert {"train.lr", "train.clip", "model.dropout", "data.mask_prob"} <= set(FLOAT_KEYS)
    for key in FLOAT_KEYS:
        with pytest.raises(ValueError, match=rf"^{key} must be a finite number, got -?(nan|inf)"):
            RunConfig().override([f"{key}={text}"]).check()
    # a TOML file and a config built in Python go through the same check
    (tmp_path / "run.toml").write_text(f"[train]\nclip = {text}\n")
    with pytest.raises(ValueError, match="train.clip must be a finite number"):
        RunConfig.from_toml(tmp_path / "run.toml").check()
    config = tinier()
    built = replace(config, train=replace(config.train, beta2=float(text)))
    with pytest.raises(ValueError, match="train.beta2 must be a finite number"):
        train(built, tmp_path / "run", quiet=True)
    assert not (tmp_path / "run").exists()


def test_lr_inf_on_the_command_line_is_one_line_and_trains_nothing(tmp_path):
    toml = write_toml(tinier(), tmp_path / "tiny.toml")
    result = run_qkv("train", toml, "--out", tmp_path / "run", "--set", "train.lr=inf",
                     "--quiet", env=ENV)  # fmt: skip
    assert_one_line_error(result, "train.lr must be a finite number, got inf")
    assert leftovers(tmp_path) == ["tiny.toml"]


def test_a_seed_torch_cannot_take_is_refused_with_the_range(tmp_path):
    assert RunConfig().override([f"train.seed={2**64 - 1}"]).train.seed == 2**64 - 1
    RunConfig().override([f"train.seed={2**64 - 1}", "data.paths=a.txt"]).check()
    for seed in (2**64, -1):
        with pytest.raises(ValueError, match=r"train.seed must be in 0..2\*\*64-1"):
            RunConfig().override([f"train.seed={seed}"]).check()
    with pytest.raises(ValueError, match=r"model.layers must be at most 2\*\*63-1"):
        RunConfig().override(["model.layers=99999999999999999999"]).check()
    toml = write_toml(tinier(), tmp_path / "tiny.toml")
    result = run_qkv("train", toml, "--out", tmp_path / "run", "--set",
                     "train.seed=99999999999999999999", "--quiet", env=ENV)  # fmt: skip
    assert_one_line_error(result, "train.seed must be in 0..2**64-1", "99999999999999999999")
    assert leftovers(tmp_path) == ["tiny.toml"]


# ------------------------------------------------------------------ a run that diverges


def test_a_diverging_run_stops_by_step_and_keeps_its_last_good_checkpoint(tmp_path):
    """lr 1e30 is finite, so the config takes it; the weights blow up within a few steps."""
    config = tinier(lr=1e30, min_lr=0, steps=40, warmup=20, checkpoint_every=1, keep=3,
                    eval_every=0, clip=0)  # fmt: skip
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"training diverged at step (\d+): ") as stopped:
        train(config, run, quiet=True)
    step = int(stopped.value.args[0].split("step ")[1].split(":")[0])
    assert 1 < step < 40, stopped.value
    records = [strict_json(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, step))
    assert all(math.isfinite(r["loss"]) for r in records)
    kept = checkpoints(run)
    assert step_of(kept[-1]) == step - 1
    assert f"the last checkpoint (step {step - 1}) is intact" in str(stopped.value)
    weights = qkv.load(run).model.state_dict()
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    # resumable: the resumed run reads it, and diverges again exactly where it did
    again = run_qkv("train", "--resume", "--out", run, "--quiet", env=ENV)
    assert_one_line_error(again, f"training diverged at step {step}: ",
                          f"the last checkpoint (step {step - 1}) is intact")  # fmt: skip
    assert [step_of(p) for p in checkpoints(run)] == [step_of(p) for p in kept]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [strict_json(line) for line in lines] == records


def test_an_update_that_overflows_the_weights_writes_no_checkpoint(tmp_path):
    """The loss of step 1 is finite (measured before the update); the weights after it are
    not, so its checkpoint is refused, and the new run, with no checkpoint, leaves nothing."""
    config = tinier(lr=1e300, checkpoint_every=1, eval_every=0)
    with pytest.raises(ValueError, match=r"diverged at step 1: the update made weights NaN or "
                                         r"infinite; .* last checkpoint \(none yet\)"):  # fmt: skip
        train(config, tmp_path / "run", quiet=True)
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------ metrics.jsonl


@pytest.mark.parametrize("torn", ['{"step": 5, "loss": 4.8', '{"step": 5, "loss": 4.8\n'])
def test_a_torn_last_metrics_line_is_dropped_and_the_run_goes_on(torn, tmp_path):
    """A write cut short: the part of the record that reached the disk, with or without its
    newline. Plotting and resuming both read past it."""
    config, run = tinier(), tmp_path / "run"
    train(config, run, quiet=True)
    with open(run / "metrics.jsonl", "a") as log:
        log.write(torn)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    result = train(config.override(["train.steps=6"]), run, resume=True, quiet=True)
    assert result.steps == 6
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]


def test_a_damaged_metrics_line_before_the_last_names_the_file_and_line(tmp_path):
    config, run = tinier(), tmp_path / "run"
    train(config, run, quiet=True)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    where = rf"{run / 'metrics.jsonl'} line 2 is not a metrics record"
    with pytest.raises(ValueError, match=where):
        train(config.override(["train.steps=6"]), run, resume=True, quiet=True)
    with pytest.raises(ValueError, match=where):
        read_metrics(run)


# ------------------------------------------------------------------ what a failed run leaves


def _killed_while_writing(write) -> None:
    """Run `write` in a forked child that SIGKILLs itself half-way: what a kill leaves."""
    child = os.fork()
    if child == 0:  # pragma: no cover - the child never returns
        try:
            write(lambda: os.kill(os.getpid(), signal.SIGKILL))
        finally:
            os._exit(1)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_a_resume_removes_what_kills_mid_write_left_and_nothing_else(tmp_path):
    """A real SIGKILL inside qkv's own atomic writers, as a kill during a checkpoint or a
    metrics rewrite leaves them: hidden staging folders and files of qkv's names."""
    config, run = tinier(), tmp_path / "run"
    train(config, run, quiet=True)

    def checkpoint(kill):
        def write(staging: Path) -> None:
            (staging / "model.safetensors").write_bytes(b"half")
            kill()

        write_folder_atomically(checkpoint_folder(run, 6), write)

    def metrics_rewrite(kill):
        write_atomically(run / "metrics.jsonl", lambda file: (file.write(b'{"st'), kill()))

    whole = set(leftovers(run))
    _killed_while_writing(checkpoint)
    _killed_while_writing(metrics_rewrite)
    staged = sorted(p for p in set(leftovers(run)) - whole if "." not in Path(p).parent.name)
    assert [Path(p).suffix for p in staged] == [".tmp", ".partial"], staged
    assert staged[1].startswith("checkpoints/.step-000006."), staged
    mine = ["checkpoints/.step-000002.notes", "checkpoints/step-keep", ".metrics.jsonl.bak"]
    for name in mine:
        (run / name).mkdir()

    assert train(config.override(["train.steps=6"]), run, resume=True, quiet=True).steps == 6
    after = leftovers(run)
    assert not [p for p in after if p.startswith(tuple(staged))], after
    assert all(name in after for name in mine)
    assert [step_of(p) for p in checkpoints(run)] == [4, 6]


def test_a_start_that_fails_leaves_nothing_and_the_same_out_works(tmp_path):
    too_short = tinier().override(["model.context=8"])  # the bank sentences do not fit
    toml = write_toml(too_short, tmp_path / "short.toml")
    out = tmp_path / "runs" / "short"
    failed = run_qkv("train", toml, "--out", out, "--quiet", env=ENV)
    assert_one_line_error(failed, "model.context 8 must be at least")
    assert leftovers(tmp_path) == ["short.toml"]  # runs/ was made by that call: gone too
    (tmp_path / "runs" / "other").mkdir(parents=True)  # another run starting beside it
    with pytest.raises(ValueError, match="model.context 8 must be at least"):
        train(too_short, tmp_path / "runs" / "new" / "short", quiet=True)
    assert leftovers(tmp_path / "runs") == ["other"]
    (tmp_path / "empty").mkdir()  # a folder the user made stays, empty as it was
    with pytest.raises(ValueError, match="model.context 8 must be at least"):
        train(too_short, tmp_path / "empty", quiet=True)
    assert leftovers(tmp_path / "empty") == []
    # the same --out now trains
    assert train(tinier(), out, quiet=True).steps == 4
    assert train(tinier(), tmp_path / "empty", quiet=True).steps == 4


@pytest.mark.parametrize("where", ["inside", "itself"])
def test_a_run_folder_that_cannot_be_written_is_one_line_naming_it(where, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    toml = write_toml(tinier(), tmp_path / "tiny.toml")
    out = locked / "run" if where == "inside" else locked
    locked.chmod(0o555)
    try:
        probe = run_qkv(command=["touch", str(locked / "probe")], as_user=True)
        assert probe.returncode == 1, "the child can still write a read-only folder"
        result = run_qkv("train", toml, "--out", out, "--quiet", env=ENV, as_user=True)
    finally:
        locked.chmod(0o755)
    assert_one_line_error(result, f"cannot write the run folder {out}: Permission denied")
    assert leftovers(locked) == []
