"""`torchrun --nproc-per-node 2` on the CPU (gloo): two processes, each with half of every
global batch, compute the losses one process computes on the whole batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, metrics, qkv_command, text_config, write_toml

import qkv


def torchrun(processes: int, *args: str) -> subprocess.CompletedProcess:
    """A real torchrun launch of `qkv ARGS` with `processes` local processes."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={processes}", "-m", "qkv.cli", *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    """The reference: one process, the whole global batch (8 sequences, 2 micro-batches)."""
    folder = tmp_path_factory.mktemp("single")
    config = text_config(corpus, train={"steps": 5, "accumulate": 2, "eval_every": 5,
                                        "checkpoint_every": 0})  # fmt: skip
    toml = write_toml(config, folder / "tiny.toml")
    done = qkv_command("train", str(toml), "--out", str(folder / "run"), "--quiet")
    assert done.returncode == 0, done.stderr
    return toml, metrics(folder / "run")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one_with_the_same_global_batch(single, parallel, tmp_path):
    toml, reference = single
    run = tmp_path / "run"
    done = torchrun(2, "train", str(toml), "--out", str(run), "--quiet",
                    "--set", f"train.parallel={parallel}")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # only rank 0 writes
    for mine, theirs in zip(records, reference, strict=True):
        assert abs(mine["loss"] - theirs["loss"]) < 1e-5, (mine, theirs)
        assert mine["lr"] == theirs["lr"]
    assert abs(records[-1]["val_loss"] - reference[-1]["val_loss"]) < 1e-5
    assert done.stdout.count("checkpoint:") == 1  # only rank 0 reports
    assert qkv.load(run).family.name == "gpt2"  # the gathered checkpoint loads
