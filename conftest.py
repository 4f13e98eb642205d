"""Test-wide settings: no downloads, caches in a temporary folder, Triton's interpreter."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# Tests never download: a model that is not embedded or built locally must fail, not fetch.
os.environ["HF_HUB_OFFLINE"] = "1"
# The dequantized-GGUF cache goes to a folder of this test run, never the user's home, and
# goes away with the run (SmolLM2's alone is 0.5 GB: a machine's disk filled up with them).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="qkv-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
# Without a GPU, the `flash` backend's real Triton kernels run in Triton's CPU interpreter.
# Set before anything imports them: Triton reads it when a kernel is defined.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# `make test` runs two test processes on the machine's cores (pytest-xdist). Each one's torch,
# and each qkv command it starts, computing with every core would oversubscribe them: OpenMP's
# threads spin waiting for each other, and two training runs side by side took 264 s instead
# of 20 s on a 2-core machine. One thread per process.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def minilm():
    """The embedded MiniLM, loaded once for the whole run: tests only read it."""
    import qkv

    return qkv.load("minilm")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2 (its GGUF file dequantized, about 2.5 s), loaded once: read only."""
    import qkv

    return qkv.load("smollm2")


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own load of the embedded SmolLM2 GGUF file: (model, tokenizer).

    Slow (it dequantizes with numpy), so it is loaded once for every test that needs it.
    """
    import transformers

    from qkv.io.embedded import embedded_path

    path = embedded_path("smollm2")
    kwargs = {"gguf_file": path.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=torch.float32, attn_implementation="eager", **kwargs
    ).eval()
    return model, transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)


# `make test` runs the files in two processes (pytest-xdist, --dist loadfile: each file in one,
# so a module's fixtures are built once), each taking the next file when it is done with one.
# The slowest files go first, longest first, so that none of them starts last and runs on
# alone while the other process is idle. The order is measured (`pytest --durations=0`, each
# file's setup and calls summed; seconds on a 2-core Xeon, December 2026); a name that no
# longer exists is an error here rather than a file silently put back in the queue.
SLOWEST_FIRST = (
    "tests/test_walkthrough.py",  # 123 s: every command of the walkthrough; trains two runs
    "tests/hf/test_hf_families.py",  # 73 s: a tiny checkpoint of every model type
    "tests/attention/test_flash.py",  # 73 s: Triton's kernels in its CPU interpreter
    "tests/cli/test_hostile_cli.py",  # 70 s: a real `qkv` process per hostile input
    "tests/train/test_loop.py",  # 46 s
    "tests/io/test_gguf.py",  # 41 s: transformers' own load of SmolLM2 from GGUF
    "tests/test_pretrained.py",  # 39 s
    "tests/cli/test_interventions_cli.py",  # 32 s
    "tests/cli/test_show_cli.py",  # 28 s
    "tests/train/test_distributed.py",  # 23 s: real torchrun
    "tests/inspect/test_summaries.py",  # 23 s
    "tests/hf/test_hf.py",  # 21 s
)
_missing = [path for path in SLOWEST_FIRST if not (Path(__file__).parent / path).is_file()]
assert not _missing, f"conftest.SLOWEST_FIRST names files that do not exist: {_missing}"


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))
