"""qkv: the transformer's self-attention mechanism, real, fast and inspectable.

>>> import torch, qkv
>>> q = k = v = torch.randn(1, 2, 5, 8)
>>> qkv.attend(q, k, v).shape
torch.Size([1, 2, 5, 8])
"""

from importlib import import_module

from qkv import views
from qkv.attention import attend, explain_choice
from qkv.version import __version__

__all__ = [
    "Pretrained", "__version__", "ablate", "atlas", "attend", "attribute", "cache", "circuits",
    "explain_choice", "heads", "hide", "lens", "load", "patch", "path_patch", "tour", "trace",
    "why",
]  # fmt: skip

# The public names past `attend`, each in the module that defines it: a model loaded with its
# tokenizer, the article's steps for one word pair (trace), the interventions that ask the
# model "what if" (hide, ablate, patch), the logit lens and the census of heads.
_DEFINED_IN = {
    "load": "qkv.pretrained", "Pretrained": "qkv.pretrained", "trace": "qkv.inspect.trace",
    "hide": "qkv.inspect.hide", "ablate": "qkv.inspect.ablate", "patch": "qkv.inspect.patch",
    "lens": "qkv.inspect.lens", "heads": "qkv.inspect.census", "why": "qkv.inspect.why",
    "circuits": "qkv.inspect.circuits", "cache": "qkv.inspect.cache",
    "attribute": "qkv.inspect.attribute", "path_patch": "qkv.inspect.path_patch",
    "atlas": "qkv.viz.atlas", "tour": "qkv.inspect.tour",
}  # fmt: skip

# How each result of qkv.inspect shows itself (`repr`, and `_repr_html_` in a notebook): the
# module of qkv.viz that draws each view. inspect sits below viz and cannot name it; this
# package sits above both (qkv.views says how the two meet).
views.DRAWN_BY.update(
    {name: "qkv.viz.notebook" for name in ("attentions", "generation", "probe", "trace")}
    | {name: "qkv.viz.notebook_interventions"
       for name in ("ablated", "census", "hidden", "lens", "patched")}
    | {"why": "qkv.viz.notebook_why", "circuits": "qkv.viz.notebook_circuits",
       "atlas": "qkv.viz.notebook_atlas", "attributed": "qkv.viz.notebook_attribute",
       "tour": "qkv.viz.notebook_tour"}
)  # fmt: skip


def __getattr__(name: str):
    # `import qkv` needs only torch: a model's loaders and tokenizers load on first use
    if name in _DEFINED_IN:
        return getattr(import_module(_DEFINED_IN[name]), name)
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")
