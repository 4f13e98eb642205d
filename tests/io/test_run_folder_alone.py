"""Data flows one way, at run time too: reading a training run's checkpoint through qkv.io
loads nothing of the floors above io. (tests/test_layering.py holds every package's imports to
its floor in the source; this is the same rule seen in `sys.modules`.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import qkv.io

IO = Path(qkv.io.__file__).parent
ABOVE = ("data", "generate", "embed", "inspect", "viz", "pretrained", "train", "hf", "serve", "cli")


def test_loading_a_run_folder_through_io_imports_nothing_above(tmp_path):
    """The run-time check: read a training run's checkpoint with qkv.io alone."""
    from qkv.data import word_tokenizer
    from qkv.io.hf_folder import save_folder
    from qkv.io.run_config import RunConfig
    from qkv.io.runs import CONFIG, checkpoint_folder
    from qkv.train.arch import build_model, hf_config

    config = RunConfig().updated({"model": {"layers": 1, "heads": 2, "width": 16}})
    tokenizer = word_tokenizer(["river", "bank", "money"], style="gpt")
    hf = hf_config(config, tokenizer)
    model, family, model_config = build_model(config, hf)
    save_folder(checkpoint_folder(tmp_path, 3), model, family, model_config, hf, tokenizer)
    (tmp_path / CONFIG).write_text(config.to_toml())
    code = (
        "import json, sys\n"
        "from qkv.io.load import load_source\n"
        f"loaded = load_source({str(tmp_path)!r})\n"
        "above = sorted(m for m in sys.modules if m.split('.')[:2][-1] in "
        f"{ABOVE!r} and m.startswith('qkv.'))\n"
        "print(json.dumps([loaded.family.name, str(loaded.run), above]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(IO.parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["gpt2", str(tmp_path), []]
