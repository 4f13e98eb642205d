"""Never silently wrong, key by key: every key of every config.json a family reads is either
read by its `config` (computed, or refused by name where qkv does not compute its value) or
declared inert (it changes no output).

The keys come from transformers' own config classes (`cls().to_dict()`), so a key that a
new transformers version adds fails here until a family says what it does with it.
"""

from __future__ import annotations

import pytest
import transformers

from qkv.io.families import FAMILIES

# The keys every PretrainedConfig has, classified once here rather than in each family.
COMMON = {
    "_name_or_path": "where the config was loaded from",
    "architectures": "the head class; a family reads it where it changes the model (BERT's MLM)",
    "chunk_size_feed_forward": "runs the MLP a chunk of tokens at a time: the same numbers",
    "dtype": "the dtype the weights were saved in; qkv loads in the dtype asked",
    "torch_dtype": "transformers 4's name of dtype",
    "id2label": "a classification head's labels; qkv builds no such head",
    "label2id": "a classification head's labels",
    "problem_type": "a classification head's loss",
    "is_encoder_decoder": "the family's model class decides the shape",
    "model_type": "chooses the family (family_for)",
    "output_attentions": "what transformers' forward returns; qkv returns records on request",
    "output_hidden_states": "what transformers' forward returns",
    "return_dict": "what transformers' forward returns",
    "transformers_version": "which transformers wrote the file",
}

# (family, key): why a read key of a number or a flag may take a string without a refusal
# that names it. Empty: every family refuses each such key by name.
WRONG_KIND_EXCEPTIONS: dict[tuple[str, str], str] = {}

PAIRS = [(f, name) for f in FAMILIES for name in f.config_classes]
IDS = [f"{f.name}-{name}" for f, name in PAIRS]


def default_config(name: str) -> dict:
    """transformers' default config.json of a config class, as a plain dict."""
    return getattr(transformers, name)().to_dict()


def family_keys(name: str) -> dict:
    """The default config's keys that are the family's own (not every config's)."""
    return {k: v for k, v in default_config(name).items() if k not in COMMON}


class Recording(dict):
    """A config.json that remembers which keys were looked at, and whether it was walked.

    A family that walks every key (a copy such as `dict(hf)`, `{**hf}` or `hf | {...}`,
    or a loop over the keys) hides which of them it reads, so a walk is noted, not taken
    as a look at every key: with `__iter__` overridden, CPython copies through `keys()`,
    which notes it. A family that needs other values on top of the file's reads through
    an overlay that looks keys up one by one (collections.ChainMap)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen: set[str] = set()
        self.walked = False

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def __iter__(self):
        self.walked = True
        return super().__iter__()

    def keys(self):
        self.walked = True
        return super().keys()

    def items(self):
        self.walked = True
        return super().items()

    def values(self):
        self.walked = True
        return super().values()


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_every_family_names_its_config_classes(family):
    assert family.config_classes, f"{family.name} names no transformers config class"
    for name in family.config_classes:
        assert hasattr(transformers, name), f"{family.name}: transformers has no {name}"


def test_every_common_key_is_classified():
    common = set(transformers.PretrainedConfig().to_dict())
    assert common <= set(COMMON), f"classify these keys in COMMON: {sorted(common - set(COMMON))}"


@pytest.mark.parametrize(("family", "name"), PAIRS, ids=IDS)
def test_every_key_is_read_or_inert(family, name):
    unknown = set(family_keys(name)) - set(family.reads) - set(family.inert)
    assert not unknown, (
        f"{family.name} says nothing of {name}'s keys {sorted(unknown)}: add each to "
        "`reads` (and read or refuse it in config) or to `inert` (it changes no output)"
    )


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_no_key_is_both_read_and_inert(family):
    assert not set(family.reads) & set(family.inert)


@pytest.mark.parametrize(("family", "name"), PAIRS, ids=IDS)
def test_the_default_config_is_read(family, name):
    # `qkv models` describes each family by what it computes for this config
    assert family.config(default_config(name)) is not None


@pytest.mark.parametrize(("family", "name"), PAIRS, ids=IDS)
def test_every_read_key_is_looked_at(family, name):
    hf = Recording(default_config(name))
    family.config(hf)
    assert not hf.walked, (
        f"{family.name}.config copies or walks its config.json, which hides the keys it "
        "reads: read them from the mapping itself (an overlay: collections.ChainMap)"
    )
    unread = [k for k in family.reads if dict.__contains__(hf, k) and k not in hf.seen]
    assert not unread, f"{family.name}.config never looks at {unread}, which `reads` lists"


@pytest.mark.parametrize(("family", "name"), PAIRS, ids=IDS)
def test_a_read_number_or_flag_of_the_wrong_kind_is_refused_by_name(family, name):
    defaults = default_config(name)
    keys = [k for k in family.reads if type(defaults.get(k)) in (int, float, bool)]
    silent = []
    for key in keys:
        if (family.name, key) in WRONG_KIND_EXCEPTIONS:
            continue
        try:
            family.config({**defaults, key: "x"})
        except ValueError as error:
            if key not in str(error):
                silent.append(f"{key} (refused as: {error})")
            continue
        silent.append(f"{key} (accepted)")
    assert not silent, f"{family.name} does not refuse a string by name for: {silent}"


@pytest.mark.parametrize(("family", "name"), PAIRS, ids=IDS)
def test_a_read_key_of_any_kind_is_refused_not_crashed_on(family, name):
    # a list where a name belongs once raised TypeError (unhashable) from a dict look-up
    defaults = default_config(name)
    crashed = []
    for key in family.reads:
        for wrong in ("x", [1], {"a": 1}, -3, True):
            try:
                family.config({**defaults, key: wrong})
            except ValueError:
                continue
            except Exception as error:  # any other kind is the failure
                crashed.append(f"{key}={wrong!r}: {type(error).__name__}: {error}")
    assert not crashed, f"{family.name} crashes instead of refusing: {crashed}"


def test_the_wrong_kind_test_can_fail():
    # a family whose config ignores a key it claims to read is caught
    from dataclasses import replace

    gpt2 = next(f for f in FAMILIES if f.name == "gpt2")

    def lax_config(hf):  # never looks at n_layer
        return gpt2.config({k: hf[k] for k in dict.keys(hf) if k != "n_layer"} | {"n_layer": 2})

    lax = replace(gpt2, config=lax_config)
    with pytest.raises(AssertionError, match="n_layer"):
        test_a_read_number_or_flag_of_the_wrong_kind_is_refused_by_name(lax, "GPT2Config")
    with pytest.raises(AssertionError, match="n_layer"):
        test_every_read_key_is_looked_at(lax, "GPT2Config")
    # a family that copies its config.json first cannot be told to read n_layer
    copying = replace(gpt2, config=lambda hf: gpt2.config({**hf}))
    with pytest.raises(AssertionError, match="copies or walks"):
        test_every_read_key_is_looked_at(copying, "GPT2Config")
    forgetful = replace(gpt2, inert=gpt2.inert[1:])
    with pytest.raises(AssertionError, match=gpt2.inert[0]):
        test_every_key_is_read_or_inert(forgetful, "GPT2Config")


@pytest.mark.parametrize(
    ("family", "key", "value"),
    [
        ("bert", "is_decoder", True),
        ("bert", "add_cross_attention", True),
        ("gpt2", "add_cross_attention", True),
        ("gpt2", "scale_attn_by_inverse_layer_idx", True),
        ("bart", "tie_word_embeddings", False),
    ],
)
def test_a_setting_qkv_does_not_compute_is_refused_by_name(family, key, value):
    chosen = next(f for f in FAMILIES if f.name == family)
    with pytest.raises(ValueError, match=key):
        chosen.config({**default_config(chosen.config_classes[0]), key: value})


# Rotary settings written two ways at once (an older key beside transformers 5's
# rope_parameters, as when a scaling is added to a newer file by hand): qkv must compute
# what transformers' own config makes of them, or refuse them by name.
ROPE_EDITS = {
    "an older base beside rope_parameters": {"rope_theta": 500000.0},
    "an older fraction beside rope_parameters": {"partial_rotary_factor": 0.5},
    "a scaling beside rope_parameters": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "the older keys alone": {"rope_parameters": None, "rope_theta": 500000.0,
                             "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "GPT-NeoX's older keys alone": {"rope_parameters": None, "rotary_emb_base": 500.0,
                                    "rotary_pct": 0.5},
    "ModernBERT's older keys alone": {"rope_parameters": None, "global_rope_theta": 5000.0,
                                      "local_rope_theta": 700.0},
    "Gemma 3's older keys alone": {"rope_parameters": None, "rope_theta": 5000.0,
                                   "rope_local_base_freq": 700.0},
}  # fmt: skip
ROTARY = [(f, n) for f, n in PAIRS if f.config(default_config(n)).position == "rotary"]


def rope_of_transformers(name: str, hf: dict) -> tuple:
    """(base, kind, factor, fraction turned) of the full layers, and the sliding layers'
    base (None where they have no own), as transformers' config reads `hf`."""
    given = getattr(transformers, name).from_dict(hf).rope_parameters
    # DeepSeek-V4 nests its sliding layers' rotary under "main" (qkv's rope_base)
    full = given.get("full_attention", given.get("main", given))
    local = given.get("sliding_attention")
    fraction = full.get("partial_rotary_factor", 1.0)
    return (float(full["rope_theta"]), full.get("rope_type", "default"), full.get("factor"),
            fraction, local and float(local["rope_theta"]))  # fmt: skip


def rope_of_qkv(cfg) -> tuple:
    s, D = cfg.rope_scaling, cfg.block.head_size
    local = cfg.local_rope_base if cfg.local_rope_base is not None else None
    return (cfg.rope_base, s.kind if s else "default", s.factor if s else None,
            (cfg.rope_dims or D) / D, local)  # fmt: skip


@pytest.mark.parametrize("edit", ROPE_EDITS.values(), ids=list(ROPE_EDITS))
@pytest.mark.parametrize(("family", "name"), ROTARY, ids=[f"{f.name}-{n}" for f, n in ROTARY])
def test_rotary_keys_written_two_ways_are_read_as_transformers_reads_them(family, name, edit):
    hf = {**default_config(name), **edit}
    try:
        want = rope_of_transformers(name, hf)
    except Exception:  # transformers' validators refuse it (errors of their own kinds): so
        with pytest.raises(ValueError):  # must qkv, not read it some way of its own
            family.config(hf)
        return
    try:
        cfg = family.config(hf)
    except ValueError:
        return  # refused by qkv: not silently wrong
    got = rope_of_qkv(cfg)
    if want[4] is None and got[4] == got[0]:  # sliding layers on the full base: no own base
        got = (*got[:4], None)
    if got[1] == "default":  # transformers keeps a default scaling's factor, which does nothing
        want = (*want[:2], None, *want[3:])
    assert got == pytest.approx(want), f"{family.name} reads {edit} as {got}, transformers {want}"
