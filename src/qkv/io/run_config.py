"""A training run's config: three frozen dataclasses, read from TOML, overridable by key.

A run is described by what model to build (`ModelSpec`), what it reads (`DataSpec`) and
how it learns (`TrainSpec`). Every key has a dotted name (`model.width`, `train.lr`), the
same in the TOML file (`[model]` then `width = 256`) and on the command line
(`--set model.width=256`). A key that does not exist is an error that lists the close ones.
It lives in io beside `runs` (the run folder's layout): `qkv.load` reads a run's config,
`qkv.train` writes it, and io needs nothing of train.

>>> config = RunConfig().override(["model.width=96", "train.lr=1e-3"])
>>> config.model.width, config.train.lr
(96, 0.001)
>>> RunConfig().override(["train.lr8=1"])
Traceback (most recent call last):
...
ValueError: unknown config key 'train.lr8'; did you mean train.lr or train.min_lr or train.clip?
"""

from __future__ import annotations

import difflib
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

ARCHS = ("gpt2", "llama", "bert", "bart")  # the Hugging Face family each run exports as
OBJECTIVES = {"gpt2": "causal", "llama": "causal", "bert": "masked", "bart": "seq2seq"}
DATA_KINDS = ("text", "bank", "reverse", "swap", "copy")
SEEDS = (0, 2**64 - 1)  # what torch.manual_seed takes
LARGEST_INT = 2**63 - 1  # torch's int64: a larger size or count overflows inside torch


@dataclass(frozen=True)
class ModelSpec:
    """The model to build. `arch` decides the objective: gpt2/llama learn the next token,
    bert a masked token, bart to map a source sequence to a target."""

    arch: str = "gpt2"
    layers: int = 4
    heads: int = 4
    kv_heads: int | None = None  # llama only: grouped-query attention
    width: int = 128
    mlp: int | None = None  # the MLP's hidden size; None: 4 * width
    context: int = 128  # the longest sequence the model reads (its position table)
    dropout: float = 0.0
    backend: str = "auto"  # the attention backend
    # per layer, "full" (softmax attention) or "linear" (a Gated DeltaNet memory, read left
    # to right, with the heads' sizes); None: every layer is full. Not for bart, whose decoder
    # also attends to the encoder.
    layer_types: tuple[str, ...] | None = None

    def check(self) -> None:
        _one_of("model.arch", self.arch, ARCHS)
        for name in ("layers", "heads", "width", "context"):
            _positive(f"model.{name}", getattr(self, name))
        if self.width % self.heads:
            raise ValueError(
                f"model.width {self.width} is not divisible by model.heads {self.heads}"
            )
        if self.kv_heads is not None and (self.arch != "llama" or self.heads % self.kv_heads):
            raise ValueError("model.kv_heads needs arch 'llama' and must divide model.heads")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.layers:
                raise ValueError(f"model.layer_types names {len(self.layer_types)} layers, "
                                 f"model.layers is {self.layers}")  # fmt: skip
            for kind in self.layer_types:
                _one_of("model.layer_types", kind, ("full", "linear"))
            if self.arch == "bart" and "linear" in self.layer_types:
                raise ValueError(
                    "model.layer_types 'linear' needs arch gpt2, llama or bert: bart's decoder "
                    "also attends to the encoder's words, which a memory of its own text is not"
                )


@dataclass(frozen=True)
class DataSpec:
    """What the model reads: text files, the generated "bank" corpus, or a toy
    sequence-to-sequence task (reverse, swap, copy)."""

    kind: str = "text"
    paths: tuple[str, ...] = ()  # text files (kind "text")
    tokenizer: str = "bpe"  # kind "text": bpe (byte-level), wordpiece or char
    vocab_size: int = 4096  # kind "text": the tokenizer's size
    val_fraction: float = 0.1  # kind "text": the share of documents held out
    examples: int = 20000  # generated kinds: training examples
    heldout: int = 512  # generated kinds: held-out examples (never-seen frames or sequences)
    mask_prob: float = 0.15  # masked objective: the share of tokens to predict
    # bank corpus, masked objective: "bank" is always a word to predict, and its target is
    # its sense spelled out (bank_river, bank_money), which only the cue can tell
    sense_targets: bool = True
    untold: float = 0.0  # bank corpus: the share of training sentences that do not tell
    min_length: int = 4  # seq2seq tasks: source lengths
    max_length: int = 12
    symbols: int = 16  # seq2seq tasks: the alphabet's size

    def check(self, model: ModelSpec) -> None:
        _one_of("data.kind", self.kind, DATA_KINDS)
        objective = OBJECTIVES[model.arch]
        seq2seq = self.kind in ("reverse", "swap", "copy")
        if seq2seq != (objective == "seq2seq"):
            raise ValueError(
                f"data.kind {self.kind!r} does not fit model.arch {model.arch!r}: the "
                "sequence-to-sequence tasks (reverse, swap, copy) train arch 'bart', and "
                "'bart' trains only on them"
            )
        if self.kind == "text" and not self.paths:
            raise ValueError("data.kind 'text' needs data.paths: the text files to learn from")
        _one_of("data.tokenizer", self.tokenizer, ("bpe", "wordpiece", "char"))
        for name in ("examples", "heldout", "vocab_size", "min_length", "symbols"):
            _positive(f"data.{name}", getattr(self, name))
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if not 0.0 < self.mask_prob < 1.0:
            raise ValueError(f"data.mask_prob must be in (0, 1), got {self.mask_prob}")
        if self.max_length < self.min_length:
            raise ValueError("data.max_length must be >= data.min_length")


@dataclass(frozen=True)
class TrainSpec:
    """How the model learns: AdamW, warmup then cosine decay, clipping, accumulation."""

    steps: int = 1000  # 0 writes the initial weights as checkpoint 0: the model before training
    batch_size: int = 32  # sequences per optimizer step, over all processes together
    accumulate: int = 1  # micro-batches per step: batch_size / accumulate sequences at once
    lr: float = 3e-4
    min_lr: float = 3e-5  # where the cosine decay ends
    warmup: int = 100  # steps of linear warmup from 0
    weight_decay: float = 0.1  # on matrices and embeddings; never on biases and norms
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = 1.0  # the largest gradient norm; 0 turns clipping off
    seed: int = 0
    eval_every: int = 100  # steps between evaluations on the validation split; 0: never
    eval_batches: int = 4
    checkpoint_every: int = 500  # steps between checkpoints (one is always written at the end)
    keep: int = 2  # checkpoints kept; older ones are deleted
    compile: bool = False  # torch.compile the model
    precision: str = "auto"  # auto (bf16 autocast on a GPU, float32 on the CPU), float32, bf16
    parallel: str = "ddp"  # under torchrun: ddp (a copy per process) or fsdp (sharded)
    device: str = "auto"  # auto, cpu, cuda

    def check(self) -> None:
        for name in ("batch_size", "accumulate", "eval_batches", "keep"):
            _positive(f"train.{name}", getattr(self, name))
        for name in ("steps", "checkpoint_every", "eval_every", "warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.batch_size % self.accumulate:
            raise ValueError(
                f"train.batch_size {self.batch_size} is not divisible by train.accumulate "
                f"{self.accumulate}"
            )
        if self.lr <= 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= train.min_lr <= train.lr and lr > 0, got {self}")
        _one_of("train.precision", self.precision, ("auto", "float32", "bf16"))
        _one_of("train.parallel", self.parallel, ("ddp", "fsdp"))
        _one_of("train.device", self.device, ("auto", "cpu", "cuda"))


# Keys that may change when a run resumes: they do not change what was already learned.
RESUMABLE = {"train.steps", "train.eval_every", "train.eval_batches", "train.checkpoint_every",
             "train.keep", "train.compile", "train.device"}  # fmt: skip


@dataclass(frozen=True)
class RunConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    train: TrainSpec = field(default_factory=TrainSpec)

    def check(self) -> RunConfig:
        """Raise ValueError for any value out of range; return self."""
        _numbers_in_range(self.flat())
        self.model.check()
        self.data.check(self.model)
        self.train.check()
        return self

    @property
    def objective(self) -> str:
        return OBJECTIVES[self.model.arch]

    def flat(self) -> dict[str, Any]:
        """{"model.width": 128, ...}: every key with its value."""
        return {
            f"{section.name}.{f.name}": getattr(getattr(self, section.name), f.name)
            for section in fields(self)
            for f in fields(getattr(self, section.name))
        }

    def override(self, assignments: list[str]) -> RunConfig:
        """Apply "section.key=value" strings; values are parsed as TOML, or else as text."""
        values: dict[str, dict[str, Any]] = {}
        for assignment in assignments:
            key, sep, text = assignment.partition("=")
            if not sep:
                raise ValueError(f"--set takes key=value, e.g. train.lr=1e-3; got {assignment!r}")
            section, _, name = key.strip().partition(".")
            values.setdefault(section, {})[name] = _parse_value(text.strip())
        return self.updated(values)

    def updated(self, values: dict[str, Any]) -> RunConfig:
        """A copy with {section: {key: value}} applied, each value checked against its type."""
        known = self.flat()
        sections = {}
        for section, entries in values.items():
            if not isinstance(entries, dict) or section not in ("model", "data", "train"):
                raise ValueError(_unknown(section, known, "section"))
            current = getattr(self, section)
            types_ = typing.get_type_hints(type(current))
            changes = {}
            for name, value in entries.items():
                key = f"{section}.{name}"
                if key not in known:
                    raise ValueError(_unknown(key, known))
                changes[name] = _coerce(key, value, types_[name])
            sections[section] = replace(current, **changes)
        return replace(self, **sections)

    def to_toml(self) -> str:
        lines = []
        for section in fields(self):
            lines.append(f"[{section.name}]")
            spec = getattr(self, section.name)
            for f in fields(spec):
                value = getattr(spec, f.name)
                if value is not None:  # TOML has no null: an absent key means None
                    lines.append(f"{f.name} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)

    @classmethod
    def from_toml(cls, path: str | Path, base: RunConfig | None = None) -> RunConfig:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path} does not exist")
        try:
            values = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path} is not valid TOML: {error}") from None
        try:
            return (base or cls()).updated(values)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    def differences(self, other: RunConfig) -> list[str]:
        """Keys whose values differ, as "key: self -> other"."""
        mine, theirs = self.flat(), other.flat()
        return [f"{k}: {mine[k]!r} -> {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]


def _unknown(key: str, known: dict[str, Any], what: str = "config key") -> str:
    candidates = list(known) if what == "config key" else ["model", "data", "train"]
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else f"; known: {', '.join(candidates)}"
    return f"unknown {what} {key!r}{hint}"


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """`value` as the field's type (int, float, bool, str, tuple of str, or None-able)."""
    options = (
        typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    )
    none = value is None or (isinstance(value, str) and value.lower() == "none")
    if none and type(None) in options:
        return None
    for kind in options:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
        if typing.get_origin(kind) is tuple:
            items = [value] if isinstance(value, str) else value
            if isinstance(items, list | tuple) and all(isinstance(i, str) for i in items):
                return tuple(items)
    wanted = " or ".join(getattr(k, "__name__", str(k)) for k in options)
    raise ValueError(f"{key} must be {wanted}, got {value!r}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_string(v) for v in value) + "]"
    return repr(value)


def _toml_string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _numbers_in_range(flat: dict[str, Any]) -> None:
    """Every float finite (lr=inf trains NaN) and every int one torch can hold: checked here
    once, for every key, wherever the value came from (TOML, --set, Python)."""
    for key, value in flat.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number, got {value}")
        if key == "train.seed":
            low, high = SEEDS
            if not low <= value <= high:
                raise ValueError(f"train.seed must be in {low}..2**64-1 ({high}), got {value}")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > LARGEST_INT:
            raise ValueError(f"{key} must be at most 2**63-1 ({LARGEST_INT}), got {value}")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")


def _positive(key: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{key} must be >= 1, got {value}")
