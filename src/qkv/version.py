"""qkv's version, as the installed package says, on the bottom floor so that every part can
name it (the server's `/api/models`, `qkv version`) without importing the facade above them."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("qkv")
except PackageNotFoundError:  # running from a source tree with PYTHONPATH=src
    __version__ = "0.0.0+source"
