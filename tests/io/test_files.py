"""Every file and folder qkv writes gets the user's usual permissions (0666 and 0777 less
the umask, not tempfile's private 0600 and 0700), and a write that fails half-way leaves
nothing behind: neither the target nor a staging file or folder."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from test_gguf import write_tiny

import qkv
from qkv.io.embedded import embedded_path
from qkv.io.files import read_lines, write_atomically, write_folder_atomically
from qkv.io.load import load_source
from tiny_models import save_tiny

UMASK = 0o027  # group may read, others nothing: distinct from both tempfile modes
FILE, FOLDER = 0o666 & ~UMASK, 0o777 & ~UMASK


@pytest.fixture
def umask():
    old = os.umask(UMASK)
    yield
    os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """The permission bits of root and of everything under it, by relative path."""
    paths = [root, *root.rglob("*")]
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in paths}


def expected(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): FOLDER if p.is_dir() else FILE for p in [root, *root.rglob("*")]
    }


def test_write_atomically_gives_a_file_the_users_permissions(tmp_path, umask):
    write_atomically(tmp_path / "a" / "notes.txt", lambda file: file.write(b"kept"))
    assert modes(tmp_path / "a") == {".": FOLDER, "notes.txt": FILE}
    assert (tmp_path / "a" / "notes.txt").read_bytes() == b"kept"


def test_a_file_write_failing_half_way_leaves_the_old_file_and_nothing_else(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_bytes(b"old")

    def fail(file):
        file.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, fail)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert target.read_bytes() == b"old"


def test_write_folder_atomically_gives_the_users_permissions(tmp_path, umask):
    def write(staging: Path) -> None:
        (staging / "a.txt").write_text("a")
        (staging / "inner").mkdir()
        (staging / "inner" / "b.bin").write_bytes(b"b")

    write_folder_atomically(tmp_path / "out", write)
    assert modes(tmp_path / "out") == {".": FOLDER, "a.txt": FILE, "inner": FOLDER,
                                       "inner/b.bin": FILE}  # fmt: skip


def test_a_folder_write_failing_half_way_leaves_nothing(tmp_path):
    def fail(staging: Path) -> None:
        (staging / "first.txt").write_text("written")
        raise RuntimeError("the second file failed")

    with pytest.raises(RuntimeError, match="second file"):
        write_folder_atomically(tmp_path / "out", fail)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_replaces_a_full_one_only_when_asked(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(ValueError, match="out exists and is not empty; choose a new folder"):
        write_folder_atomically(out, lambda staging: (staging / "new.txt").write_text("new"))
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    write_folder_atomically(out, lambda staging: (staging / "new.txt").write_text("new"),
                            replace=True)  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in out.iterdir()] == ["new.txt"]


def test_a_log_read_back_skips_a_line_torn_by_a_kill(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert read_lines(log) == ['{"step": 1}', '{"step": 2}']
    log.write_text('{"step": 1}\n')
    assert read_lines(log) == ['{"step": 1}']


# ---- each writer of qkv --------------------------------------------------------------------


def test_the_gguf_cache_gets_the_users_permissions(tmp_path, umask):
    from qkv.io.gguf import read_gguf

    write_tiny(tmp_path / "tiny.gguf")
    read_gguf(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    [cache] = (tmp_path / "cache").iterdir()
    assert cache.suffix == ".safetensors"
    assert modes(tmp_path / "cache") == expected(tmp_path / "cache")


def tiny_pretrained(folder: Path) -> qkv.Pretrained:
    save_tiny("gpt2", folder)
    for file in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(embedded_path("minilm") / file, folder / file)
    return qkv.load(folder)


def test_an_export_gets_the_users_permissions(tmp_path, umask):
    tiny_pretrained(tmp_path / "original").save(tmp_path / "exported")
    found = modes(tmp_path / "exported")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(found)
    assert found == expected(tmp_path / "exported")


def test_an_export_failing_half_way_leaves_nothing(tmp_path, monkeypatch):
    import qkv.io.hf_folder

    ours = tiny_pretrained(tmp_path / "original")

    def fail(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(qkv.io.hf_folder, "save_file", fail)  # where save_folder finds it
    with pytest.raises(OSError, match="disk full"):
        ours.save(tmp_path / "exported")
    assert [p.name for p in tmp_path.iterdir()] == ["original"]


def small_run():
    from qkv.data import word_tokenizer
    from qkv.io.run_config import RunConfig
    from qkv.train.arch import build_model, hf_config

    config = RunConfig().updated({"model": {"layers": 1, "heads": 2, "width": 16}})
    tokenizer = word_tokenizer(["river", "bank", "money"], style="gpt")
    hf = hf_config(config, tokenizer)
    model, family, model_config = build_model(config, hf)
    return model, family, model_config, hf, tokenizer


def test_a_training_checkpoint_gets_the_users_permissions(tmp_path, umask):
    from qkv.train import checkpoint

    model, family, model_config, hf, tokenizer = small_run()
    checkpoint.save(tmp_path, 2, model.state_dict(), model, family, model_config, hf,
                    tokenizer, {"step": 2}, keep=2)  # fmt: skip
    found = modes(tmp_path / "checkpoints")
    assert {"step-000002/trainer.pt", "step-000002/model.safetensors"} <= set(found)
    assert found == expected(tmp_path / "checkpoints")


def test_a_checkpoint_failing_half_way_leaves_the_last_one_and_no_staging(tmp_path, monkeypatch):
    from qkv.train import checkpoint

    model, family, model_config, hf, tokenizer = small_run()
    args = (model.state_dict(), model, family, model_config, hf, tokenizer)
    checkpoint.save(tmp_path, 2, *args, {"step": 2}, keep=2)

    def fail(obj, path):
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", fail)
    with pytest.raises(ValueError, match="No space left on device; the last checkpoint .step 2"):
        checkpoint.save(tmp_path, 4, *args, {"step": 4}, keep=2)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000002"]
    assert load_source(tmp_path / "checkpoints" / "step-000002").family.name == "gpt2"


def test_token_shards_get_the_users_permissions(tmp_path, umask):
    from qkv.data import train_tokenizer, write_shards

    text = tmp_path / "corpus.txt"
    text.write_text("the bank of the river\n\nthe bank lent money\n\nthe river ran\n")
    tokenizer = train_tokenizer([text], kind="char", vocab_size=40)
    write_shards([text], tokenizer, tmp_path / "shards", val_fraction=0.4)
    found = modes(tmp_path / "shards")
    assert {"shards.json", "train-00000.bin", "val-00000.bin"} <= set(found)
    assert found == expected(tmp_path / "shards")
