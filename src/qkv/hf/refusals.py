"""What qkv's attention inside transformers refuses, and the one place each refusal is made.

transformers lets anyone register an attention function (`AttentionInterface`), but gives it
no say over which models it is given: a family whose attention is its own code (Bloom's and
MPT's ALiBi, Falcon's own paths) would load on "qkv" and run without it, on a mask built for
a kernel it never reaches. So qkv refuses by name, at load, each model class that
- computes its attention in its own code, not through `AttentionInterface` (transformers
  reads that from the class's source: `_can_set_attn_implementation`);
- chooses its attention classes from a table by the implementation's name (eager, sdpa);
- hands its attention an argument qkv does not compute (a sink logit, a position bias, chosen
  keys) or does not know to leave the scores alone: read from the keyword arguments of every
  `attention_interface(...)` call in its modeling code, with the same table a call is checked
  against;
- is marked by transformers as beyond sdpa (`_supports_sdpa = False`), since transformers
  builds qkv's mask as it builds sdpa's: unless the one reason is a soft-cap (Gemma 2), which
  qkv computes and sdpa does not.

`guard_loading` puts that check where every model's `__init__` (and `set_attn_implementation`)
asks transformers to check an attention implementation. Each call is checked again by its
arguments (`refuse_arguments`): the load-time reading of the code is a reading, the call is
what runs.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from collections.abc import Callable

from torch import nn
from transformers import PreTrainedModel

# keyword arguments that change the scores in a way qkv does not compute
REFUSED = {
    "s_aux": "attention sinks (s_aux) computed otherwise than gpt-oss's, one more logit in the "
    "softmax whose weight is dropped",
    "sinks": "attention sinks (a learned logit beside the keys)",
    "position_bias": "a position bias added to the scores (T5's relative positions)",
    "indices": "sparse attention over chosen keys (indices)",
    "block_indices": "block-sparse attention (block_indices)",
    "head_mask": "a head mask",
}
# keyword arguments `attention` reads
HANDLED = frozenset({"sliding_window", "softcap", "is_causal", "output_attentions"})
# (modeling module, attention class) whose eager attention puts its sinks (s_aux) in the
# softmax as qkv's `sinks` does, reporting the words' weights without the sink's: gpt-oss.
# Another family's sinks (Granite's scale the output after the softmax, DeepSeek-V4's come
# with compressed keys in the mask) are refused by name.
SINKS_AS_QKV = {"transformers.models.gpt_oss.modeling_gpt_oss": "GptOssAttention"}
# keyword arguments that leave the scores as the mask transformers built says (sdpa ignores
# them too: packed sequences are in that mask, built from position_ids)
HARMLESS = frozenset({
    "position_ids", "use_cache", "cache_position", "output_hidden_states",
    "output_router_logits", "num_items_in_batch", "return_dict", "cu_seq_lens_q",
    "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "deterministic",
})  # fmt: skip
# the interface's own parameters, which a modeling file may pass by name
PARAMETERS = frozenset({"query", "key", "value", "attention_mask", "scaling", "dropout"})
# attributes of a model's modules that say it computes what qkv does not
MODULE_REFUSALS = {
    "sinks": "attention sinks (a learned logit beside the keys)",
    "relative_attention_bias": "a relative position bias added to the scores",
}
# transformers' own tables by implementation name, where qkv's functions are registered
INTERFACES = frozenset({"ALL_ATTENTION_FUNCTIONS", "ALL_MASK_ATTENTION_FUNCTIONS"})
EAGER = "load this model with attn_implementation='eager'"


def argument_refusal(name: str) -> str | None:
    """What is wrong with an attention call's keyword argument `name`, or None.

    >>> argument_refusal("sliding_window") is None
    True
    >>> argument_refusal("position_bias")[:35]
    'a position bias added to the scores'
    >>> argument_refusal("alibi")[:52]
    "'alibi', which qkv does not know to leave the scores"
    """
    if name in REFUSED:
        return f"{REFUSED[name]}, which qkv's attention does not compute"
    if name in HANDLED or name in HARMLESS or name in PARAMETERS:
        return None
    return (
        f"{name!r}, which qkv does not know to leave the scores alone (qkv reads "
        f"{sorted(HANDLED)} and ignores {sorted(HARMLESS)})"
    )


def sinks_as_qkv(module: nn.Module) -> bool:
    """Whether `module` is an attention whose sinks qkv computes exactly (gpt-oss's)."""
    return SINKS_AS_QKV.get(type(module).__module__) == type(module).__name__


def refuse_arguments(module: nn.Module, kwargs: dict) -> None:
    """A call's keyword arguments, refused by name where qkv would not compute them."""
    for name, value in kwargs.items():
        if value is None or value is False or (name == "s_aux" and sinks_as_qkv(module)):
            continue
        wrong = argument_refusal(name)
        if wrong is not None:
            raise ValueError(f"{type(module).__name__}'s attention call passes {wrong}; {EAGER}")


def class_refusal(cls: type) -> str | None:
    """Why qkv's attention would not compute exactly what eager does in model class `cls`,
    read from the class and its modeling code; None where nothing is known against it."""
    name = cls.__name__
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        alibi = " (ALiBi position biases among them)" if "alibi" in _source(cls).lower() else ""
        return (
            f"{name} computes its attention in its own code{alibi}, not through transformers' "
            "AttentionInterface, so qkv's attention would not run in it"
        )
    passed, by_name = _read(cls.__module__)
    ours = {"s_aux"} if cls.__module__ in SINKS_AS_QKV else set()  # gpt-oss's: computed
    if by_name:
        return (
            f"{name}'s modeling code chooses attention classes by the implementation's name "
            "(config._attn_implementation), among which qkv is not"
        )
    for argument in sorted(passed - ours):
        wrong = argument_refusal(argument)
        if wrong is not None:
            return f"{name}'s attention is passed {wrong}"
    # sdpa lacks Gemma 2's soft-cap and gpt-oss's sinks, which qkv's attention takes
    if getattr(cls, "_supports_sdpa", True) is False and not ({"softcap"} | ours) & passed:
        return (
            f"transformers runs {name} on eager attention only (_supports_sdpa = False): its "
            "attention needs more than the mask transformers builds for sdpa and for qkv"
        )
    return None


def refuse_class(cls: type) -> None:
    """`class_refusal` as a ValueError."""
    wrong = class_refusal(cls)
    if wrong is not None:
        raise ValueError(f"attn_implementation='qkv' is refused: {wrong}; {EAGER}")


def guard_loading(registered: Callable[[str], bool]) -> None:
    """Refuse by name, as transformers checks the implementation a model is made with or
    switched to, a model class that qkv's attention would not compute exactly, where
    `registered(implementation)` says the implementation is qkv's. Installed once."""
    original = PreTrainedModel.get_correct_attn_implementation
    if getattr(original, "_qkv_guard", False):
        return

    @functools.wraps(original)
    def checked(self, requested_attention, is_init_check: bool = False):
        chosen = original(self, requested_attention, is_init_check)
        if registered(chosen):
            refuse_class(type(self))
        return chosen

    checked._qkv_guard = True
    PreTrainedModel.get_correct_attn_implementation = checked


def _source(cls: type) -> str:
    module = sys.modules.get(cls.__module__)
    try:
        return inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return ""


@functools.cache
def _read(module_name: str) -> tuple[frozenset[str], bool]:
    """What a modeling module and the models' modeling modules it imports from (where its
    attention class may live) say of their attention: the keyword arguments of every
    `attention_interface(...)` call, and whether a class is chosen by the implementation's
    name (`CLASSES[config._attn_implementation]`: a table with eager's and sdpa's, not qkv)."""
    passed: set[str] = set()
    by_name = False
    seen, todo = {module_name}, [module_name]
    while todo:
        name = todo.pop()
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.Call) and _called(node.func) == "attention_interface":
                passed.update(k.arg for k in node.keywords if k.arg is not None)
            elif isinstance(node, ast.Subscript) and _called(node.slice) == "_attn_implementation":
                by_name |= _called(node.value) not in INTERFACES
            elif isinstance(node, ast.ImportFrom) and node.level and node.module:
                imported = f"{name.rsplit('.', node.level)[0]}.{node.module}"
                if ".models." in imported and ".modeling_" in imported and imported not in seen:
                    seen.add(imported)
                    todo.append(imported)
    return frozenset(passed), by_name


@functools.cache
def _tree(module_name: str) -> ast.AST:
    """A loaded module's source, parsed (an empty module where its source cannot be read)."""
    module = sys.modules.get(module_name)
    try:
        return ast.parse(inspect.getsource(module)) if module is not None else ast.Module()
    except (OSError, TypeError, SyntaxError):
        return ast.Module()


def _called(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None
