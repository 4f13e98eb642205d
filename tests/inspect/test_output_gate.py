"""An output gate between the heads and the output projection (Qwen3.5, Qwen3-Next): the record
keeps it, and the lens's head terms pass through it, so a layer's head terms add up to what its
attention really added to the stream."""

from __future__ import annotations

import torch

from qkv.inspect.lens import attribute_logit
from qkv.models.config import DecoderConfig
from qkv.models.decoder import Decoder
from qkv.nn import BlockConfig


def test_the_lens_reads_each_head_through_the_layers_output_gate():
    block = BlockConfig(width=16, num_heads=4, num_kv_heads=2, mlp="swiglu", norm="rmsnorm",
                        bias=False, output_gate=True)  # fmt: skip
    model = Decoder(DecoderConfig(vocab_size=30, num_layers=2, block=block, position="rotary"))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)
    model = model.double().eval().requires_grad_(False)
    ids = torch.randint(0, 30, (1, 9), generator=torch.Generator().manual_seed(1))
    out = model(ids, layers="all", hidden_states=True)
    record = out.records[1]
    assert record.output_gate is not None and record.output_gate.shape == record.out.shape
    found = attribute_logit(model, out, position=8, token_id=5)
    # apart: layer 1's attention output, made by the layer itself, read along the logit's
    # direction: the heads' terms must add up to it (the layer has no output bias)
    second = model.blocks[1]
    with torch.no_grad():
        attended, _ = second.attn(second.attn_norm(out.hidden_states[1]), causal=True)
    hidden = out.hidden_states[-1][0, 8]
    scale = torch.rsqrt(hidden.pow(2).mean() + model.norm.eps)
    direction = model.lm_head.weight[5] * model.norm.weight * scale
    want = float(attended[0, 8] @ direction)
    assert abs(float(found.heads[1].sum()) - want) < 1e-9
    ungated = float((second.attn.out.weight @ record.out[0, :, 8].reshape(-1)) @ direction)
    assert abs(ungated - want) > 1e-3  # without the gate the terms would be wrong
