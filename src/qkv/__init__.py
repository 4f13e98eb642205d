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

__all__ = ["__version__", "attend", "explain_choice"]
