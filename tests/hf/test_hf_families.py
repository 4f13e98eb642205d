"""Every model type transformers registers, on qkv's attention: exact or refused at load.

For each model type with a causal LM or base model class that reads token ids, a tiny random
checkpoint is made from its own config class with small sizes; that one set of weights runs
on "eager" and, loaded with attn_implementation="qkv", either is refused while it is made (by
name, with the reason) or gives eager's outputs and every one of its attentions: a padded
batch of two and a single unpadded text (where a model that loses the causal mask shows it).
None may run silently: a qkv model that differs from eager, or that fails at its first call
instead of at load, fails the test. The types that cannot be built that small, need another
input than token ids, or whose eager pass fails on these inputs are counted, not checked.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import warnings
from dataclasses import dataclass

import pytest
import torch
import transformers as hf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_MAPPING_NAMES,
)

import qkv.hf  # noqa: F401  (registers attn_implementation="qkv")

# small sizes under every name a config uses for them; a config takes those it has
SIZES = dict(
    hidden_size=32, d_model=32, n_embd=32, embed_dim=32, dim=32, embedding_size=32,
    num_hidden_layers=2, n_layer=2, num_layers=2, n_layers=2, encoder_layers=2,
    decoder_layers=2, num_attention_heads=4, n_head=4, n_heads=4, num_heads=4,
    encoder_attention_heads=4, decoder_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=48, ffn_dim=48, n_inner=48, d_ff=48, encoder_ffn_dim=48,
    decoder_ffn_dim=48, ffn_hidden_size=48, vocab_size=99, n_words=99, src_vocab_size=99,
    tgt_vocab_size=99, entity_vocab_size=16, max_position_embeddings=64, n_positions=64,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=16,
    qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, rotary_dim=4, sliding_window=4,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
MAX_PARAMETERS = 10_000_000  # a config that stays larger than this is not tiny
T = 9
# what a qkv model must match eager to, relative to the output's largest value
TOLERANCE = 1e-4


@dataclass
class Outcome:
    kind: str  # exact, refused; or not checked: no text, not tiny, not buildable, eager fails;
    # or wrong: differs, fails at call, fails at load
    detail: str = ""


def tiny_config(config_class):
    """config_class with the small sizes it has, its sub-configs made small the same way."""
    defaults = config_class().to_dict()
    sizes = {name: value for name, value in SIZES.items() if name in defaults}
    if "layer_types" in defaults or "layers_block_type" in defaults:  # hybrids: room for
        for name in ("num_hidden_layers", "n_layer", "num_layers"):  # both kinds of layer
            if name in sizes:
                sizes[name] = 4
    if "qk_rope_head_dim" in defaults:  # latent attention: rotary on its own slice, and
        sizes["head_dim"] = sizes["qk_rope_head_dim"]  # a key for every query head
        if "num_key_value_heads" in sizes:
            sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    sections = re.search(r"'mrope_section': \[([0-9, ]+)\]", str(defaults))
    if sections:  # multimodal rotary: the head splits into its sections
        sizes["head_dim"] = 2 * sum(int(n) for n in sections.group(1).split(","))
    for name, sub in (getattr(config_class, "sub_configs", None) or {}).items():
        if isinstance(sub, type):
            with contextlib.suppress(Exception):  # or the sub-config keeps its defaults
                sizes[name] = tiny_config(sub)
    return config_class(**sizes)


def model_class(model_type: str):
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_MAPPING_NAMES[model_type]
    return getattr(hf, name[0] if isinstance(name, list | tuple) else name, None)


def first(output) -> torch.Tensor:
    """Logits, or the last hidden state of a model without a head."""
    return output[0]


def attentions(output) -> dict[str, tuple]:
    return {name: value for name, value in output.items()
            if name.endswith("attentions") and value is not None}  # fmt: skip


def differs(expected, got, valid: torch.Tensor | None) -> str | None:
    """Where a qkv output differs from eager's (only real tokens compared, by `valid` (B, T)),
    or None."""
    a, b = first(expected), first(got)
    if a.shape != b.shape:
        return f"output shapes {tuple(a.shape)} and {tuple(b.shape)}"
    rows = valid if valid is not None and a.shape[:2] == valid.shape else slice(None)
    worst = float((a - b).abs()[rows].max())
    if worst > TOLERANCE * max(1.0, float(a.abs().max())):
        return f"outputs {worst:.2e} from eager's"
    eager, ours = attentions(expected), attentions(got)
    if {n: len(v) for n, v in eager.items()} != {n: len(v) for n, v in ours.items()}:
        counts = {n: len(v) for n, v in ours.items()}
        return f"attentions {counts}, eager gives { ({n: len(v) for n, v in eager.items()}) }"
    for name, layers in eager.items():
        for layer, (x, y) in enumerate(zip(layers, ours[name], strict=True)):
            if x.shape != y.shape:
                return f"{name}[{layer}] of shape {tuple(y.shape)}, eager's {tuple(x.shape)}"
            queries = valid[:, None, :, None] if valid is not None and x.shape[-2] == T else True
            worst = float(((x - y).abs() * queries).max()) if x.dim() == 4 else 0.0
            if worst > TOLERANCE:
                return f"{name}[{layer}] {worst:.2e} from eager's"
    return None


def outcome(model_type: str) -> Outcome:
    cls = model_class(model_type)
    try:
        takes = inspect.signature(cls.forward).parameters if cls is not None else {}
    except ImportError as error:  # a package qkv's tests do not install (torchaudio, ...)
        return Outcome("not buildable", str(error).strip()[:200])
    if "input_ids" not in takes:
        return Outcome("no text")

    def decoder(ids):  # an encoder-decoder's decoder reads the same ids
        return {"decoder_input_ids": ids} if "decoder_input_ids" in takes else {}

    try:
        config = tiny_config(CONFIG_MAPPING[model_type])
        with torch.device("meta"):
            count = sum(p.numel() for p in cls(copy.deepcopy(config)).parameters())
        if count > MAX_PARAMETERS:
            return Outcome("not tiny", f"{count:,} parameters")
        torch.manual_seed(0)
        eager = cls._from_config(copy.deepcopy(config), attn_implementation="eager",
                                 experts_implementation="eager").eval()  # fmt: skip
    except Exception as error:  # its config does not shrink this way, or needs a package
        return Outcome("not buildable", f"{type(error).__name__}: {error}"[:200])
    try:
        ours = cls._from_config(copy.deepcopy(config), attn_implementation="qkv",
                                experts_implementation="eager").eval()  # fmt: skip
    except ValueError as error:
        said = str(error)
        if said.startswith("attn_implementation='qkv' is refused: ") and cls.__name__ in said:
            return Outcome("refused", said)
        return Outcome("fails at load", said[:300])
    except Exception as error:
        return Outcome("fails at load", f"{type(error).__name__}: {error}"[:300])
    torch.manual_seed(1)
    ids = torch.randint(3, 90, (2, T))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :3] = 0  # the second text padded by 3 on the left
    runs = [dict(input_ids=ids, attention_mask=mask), dict(input_ids=ids[:1])]
    try:
        with torch.no_grad():
            expected = [eager(**run, **decoder(run["input_ids"]), output_attentions=True,
                              use_cache=False) for run in runs]  # fmt: skip
    except Exception as error:
        return Outcome("eager fails", f"{type(error).__name__}: {error}"[:200])
    ours.load_state_dict(eager.state_dict())
    for run, want in zip(runs, expected, strict=True):
        try:
            with torch.no_grad():
                got = ours(**run, **decoder(run["input_ids"]), output_attentions=True,
                           use_cache=False)  # fmt: skip
        except Exception as error:
            return Outcome("fails at call", f"{type(error).__name__}: {error}"[:300])
        valid = run.get("attention_mask")
        wrong = differs(want, got, None if valid is None else valid.bool())
        if wrong is not None:
            padded = "padded batch" if valid is not None else "one text"
            return Outcome("differs", f"{padded}: {wrong}")
    return Outcome("exact")


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    types = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_MAPPING_NAMES))
    verbosity = hf.logging.get_verbosity()
    hf.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {model_type: outcome(model_type) for model_type in types}
    finally:
        hf.logging.set_verbosity(verbosity)


def test_every_model_type_is_exact_on_qkv_or_refused_at_load(outcomes):
    wrong = {t: f"{o.kind}: {o.detail}" for t, o in outcomes.items()
             if o.kind in ("differs", "fails at call", "fails at load")}  # fmt: skip
    assert not wrong, "\n".join(f"{t}: {why}" for t, why in sorted(wrong.items()))
    kinds = [o.kind for o in outcomes.values()]
    # what the sweep reaches (transformers 5.24: 157 exact, 78 refused): a sweep that builds
    # far fewer proves little, so a transformers that breaks the tiny configs fails here
    assert kinds.count("exact") >= 120 and kinds.count("refused") >= 60, {
        kind: kinds.count(kind) for kind in set(kinds)
    }


@pytest.mark.parametrize(("model_type", "reason"), [
    ("bloom", "in its own code (ALiBi position biases among them)"),
    ("mpt", "in its own code (ALiBi position biases among them)"),
    ("falcon", "in its own code"),
    ("t5", "a position bias added to the scores"),
    ("deepseek_v32", "sparse attention over chosen keys"),
    ("splinter", "eager attention only"),
    ("unlimited_ocr", "chooses attention classes by the implementation's name"),
])  # fmt: skip
def test_the_families_qkv_would_get_wrong_are_refused_with_the_reason(outcomes, model_type, reason):
    assert outcomes[model_type].kind == "refused", outcomes[model_type]
    assert reason in outcomes[model_type].detail


@pytest.mark.parametrize("model_type", [
    "llama", "gpt2", "gpt_bigcode", "opt", "gemma2", "mistral", "qwen3_moe", "bert", "bart",
    "layoutlm", "whisper", "deepseek_v3", "mixtral", "llama4_text", "gpt_oss",
])  # fmt: skip
def test_the_families_qkv_computes_are_exact(outcomes, model_type):
    assert outcomes[model_type].kind == "exact", outcomes[model_type]
