"""Models are built on the meta device and filled from the checkpoint: nothing
process-wide changes while loading, and tied weights and computed buffers come back."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

import qkv.io.build
import qkv.models.decoder
from qkv.io.hf_folder import load_folder
from qkv.models import Decoder, DecoderConfig, EncoderDecoder, EncoderDecoderConfig
from qkv.nn import BlockConfig, RotaryEmbedding
from qkv.nn.position import SinusoidalPositions
from tiny_models import save_tiny

INITS = [name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")]
SMALL = DecoderConfig(vocab_size=50, num_layers=1, block=BlockConfig(width=16, num_heads=2))


def test_loading_leaves_torch_init_alone_and_a_model_built_meanwhile_is_initialized(
    tmp_path, monkeypatch
):
    """A second model is built on another thread from inside the load's own model
    construction and again inside its fill: both times it must come out initialized."""
    save_tiny("gpt2", tmp_path)
    originals = {name: getattr(nn.init, name) for name in INITS}
    torch.manual_seed(0)
    reference = Decoder(SMALL).state_dict()
    checks = []

    def build_elsewhere(where: str) -> None:
        replaced = [name for name, f in originals.items() if getattr(nn.init, name) is not f]
        built = {}

        def build():
            torch.manual_seed(0)
            built["model"] = Decoder(SMALL)

        thread = threading.Thread(target=build)
        thread.start()
        thread.join()
        state = built["model"].state_dict()
        equal = all(torch.equal(state[k], reference[k]) for k in reference)
        checks.append((where, replaced, equal))

    real_init, real_fill = qkv.models.decoder.init_weights, qkv.io.build.fill

    def init_weights(module):
        if threading.current_thread() is threading.main_thread() and not checks:
            build_elsewhere("build")
        real_init(module)

    def fill(*args):
        build_elsewhere("fill, before")
        real_fill(*args)
        build_elsewhere("fill, after")

    monkeypatch.setattr(qkv.models.decoder, "init_weights", init_weights)
    monkeypatch.setattr(qkv.io.build, "fill", fill)
    model, *_ = load_folder(tmp_path, torch.float32, None)
    assert [where for where, *_ in checks] == ["build", "fill, before", "fill, after"]
    assert checks == [(where, [], True) for where, *_ in checks]
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize(
    "name, tied",
    [
        ("gpt2", ["lm_head.weight"]),
        ("llama-tied", ["lm_head.weight"]),
        ("bart", ["decoder.embed.tokens.weight", "decoder.lm_head.weight"]),
    ],
)
def test_tied_weights_are_one_tensor_after_loading(name, tied, tmp_path):
    save_tiny(name, tmp_path)
    model, *_ = load_folder(tmp_path, torch.float32, None)
    tokens = model.encoder.embed.tokens.weight if name == "bart" else model.embed.tokens.weight
    assert all(model.get_parameter(other) is tokens for other in tied)


def test_rotary_frequencies_are_computed_again_after_building_on_meta(tmp_path):
    save_tiny("llama", tmp_path)
    model, _, config, _ = load_folder(tmp_path, torch.bfloat16, None)
    rotary = model.blocks[0].attn.rotary
    expected = RotaryEmbedding(config.block.head_size, base=config.rope_base).inv_freq
    assert rotary.inv_freq.device.type == "cpu"
    torch.testing.assert_close(rotary.inv_freq, expected.bfloat16(), rtol=0, atol=0)


def test_sinusoidal_positions_built_on_meta_reset_to_the_real_table():
    config = EncoderDecoderConfig(vocab_size=30, encoder_layers=1, decoder_layers=1,
                                  block=BlockConfig(width=8, num_heads=2))  # fmt: skip
    with torch.device("meta"):
        model = EncoderDecoder(config)
    positions = [m for m in model.modules() if isinstance(m, SinusoidalPositions)]
    assert positions and all(p.inv_freq.is_meta for p in positions)
    for p in positions:
        p.reset_buffers()
    torch.testing.assert_close(positions[0].inv_freq, SinusoidalPositions(8).inv_freq)
    assert positions[0](torch.tensor([0]))[0].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("name", ["llama", "bart"])  # rotary and learned positions
def test_building_on_meta_runs_no_python_reference_kernel(name, tmp_path):
    """On the meta device, random inits and arithmetic on Python scalars run through torch's
    Python reference kernels, whose first use imports torch._dynamo (~1.5 s on every `qkv`
    command that loads a model). A fresh process loads a checkpoint without importing it."""
    save_tiny(name, tmp_path)
    code = (
        "import sys, torch; from qkv.io.hf_folder import load_folder; "
        f"load_folder({str(tmp_path)!r}, torch.float32, None); "
        "print('torch._dynamo' in sys.modules)"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, check=True)  # fmt: skip
    assert found.stdout.strip() == "False"
