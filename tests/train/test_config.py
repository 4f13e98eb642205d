"""Run configs: frozen, read from TOML, changed key by key, every value checked."""

from __future__ import annotations

import dataclasses

import pytest

from qkv.train import PRESETS, RunConfig, preset


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_round_trips_through_toml(name, tmp_path):
    config = preset(name).override(["model.kv_heads=none", "data.paths=['a.txt', 'b c.txt']"])
    (tmp_path / "run.toml").write_text(config.to_toml())
    assert RunConfig.from_toml(tmp_path / "run.toml") == config.check()


def test_values_are_parsed_and_checked_against_each_keys_type():
    config = RunConfig().override(
        ["train.lr=1e-3", "train.steps=7", "train.compile=true", "model.kv_heads=2",
         "data.paths=one.txt", "train.warmup=0", "model.arch=llama", "train.min_lr=0"]
    )  # fmt: skip
    assert (config.train.lr, config.train.steps, config.train.compile) == (1e-3, 7, True)
    assert config.model.kv_heads == 2 and config.data.paths == ("one.txt",)
    assert isinstance(config.train.min_lr, float)  # an int where a float is due is accepted
    with pytest.raises(ValueError, match=r"train.steps must be int, got 'many'"):
        RunConfig().override(["train.steps=many"])
    with pytest.raises(ValueError, match=r"train.compile must be bool, got 1"):
        RunConfig().override(["train.compile=1"])
    with pytest.raises(ValueError, match="--set takes key=value"):
        RunConfig().override(["train.lr"])
    with pytest.raises(ValueError, match=r"unknown section 'trian'; did you mean train\?"):
        RunConfig().override(["trian.lr=1"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().train.lr = 1.0


@pytest.mark.parametrize(
    "change,message",
    [
        ("model.arch=gpt3", "model.arch must be one of gpt2, llama, bert, bart"),
        ("model.width=102", "not divisible by model.heads"),
        ("model.kv_heads=3", "kv_heads needs arch 'llama'"),
        ("train.accumulate=3", "not divisible by train.accumulate"),
        ("train.min_lr=1", "min_lr <= train.lr"),
        ("train.parallel=zero", "train.parallel must be one of ddp, fsdp"),
        ("data.kind=reverse", "does not fit model.arch 'gpt2'"),
        ("data.mask_prob=1.5", "data.mask_prob must be in"),
        ("train.steps=-1", "train.steps must be >= 0"),
    ],
)
def test_a_value_out_of_range_is_one_clear_error(change, message):
    with pytest.raises(ValueError, match=message):
        RunConfig().override(["data.paths=x.txt", change]).check()


def test_a_text_run_needs_its_files():
    with pytest.raises(ValueError, match="needs data.paths"):
        RunConfig().check()
    with pytest.raises(ValueError, match="unknown preset 'bnak'; presets: bank, reverse, gpt"):
        preset("bnak")


def test_a_toml_file_with_an_unknown_key_names_the_file(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text("[train]\nstpes = 3\n")
    with pytest.raises(ValueError, match=r"x.toml: unknown config key 'train.stpes'; did you "
                                         r"mean train.steps or"):  # fmt: skip
        RunConfig.from_toml(path)
    path.write_text("[train\n")
    with pytest.raises(ValueError, match="is not valid TOML"):
        RunConfig.from_toml(path)
