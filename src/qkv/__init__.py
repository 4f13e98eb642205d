"""qkv: the transformer's self-attention mechanism, real, fast and inspectable.

>>> import torch, qkv
>>> q = k = v = torch.randn(1, 2, 5, 8)
>>> qkv.attend(q, k, v).shape
torch.Size([1, 2, 5, 8])
"""

from importlib.metadata import PackageNotFoundError, version

from qkv.attention import attend, explain_choice

try:
    __version__ = version("qkv")
except PackageNotFoundError:  # running from a source tree with PYTHONPATH=src
    __version__ = "0.0.0+source"

__all__ = [
    "Pretrained", "__version__", "ablate", "attend", "explain_choice", "heads", "hide", "lens",
    "load", "patch", "trace",
]  # fmt: skip

# interventions: "what if" asked of the model
_INTERVENTIONS = {"hide": "hide", "ablate": "ablate", "patch": "patch"}


def __getattr__(name: str):
    # `import qkv` needs only torch; loading pretrained models pulls in more, on first use
    if name in ("load", "Pretrained"):
        from qkv import pretrained

        return getattr(pretrained, name)
    if name == "trace":  # the article's steps for one word pair of a real model
        from qkv.inspect.trace import trace

        return trace
    if name in _INTERVENTIONS:
        from importlib import import_module

        return getattr(import_module(f"qkv.inspect.{_INTERVENTIONS[name]}"), name)
    if name == "lens":  # the logit lens and direct logit attribution (decoders)
        from qkv.inspect.lens import lens

        return lens
    if name == "heads":  # the census of heads
        from qkv.inspect.census import heads

        return heads
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")
