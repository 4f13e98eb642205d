"""Edge attribution: how much each sender's change reaches the metric through each receiver.

A sender writes into the residual stream: the embeddings, each head (its output projected by
its slice of W_O), each MLP. A receiver reads from it: each query head's query, key and value
(per query head: under grouped-query attention the shared key/value head is read through each
query head's own copy), each MLP, and the logits (the final norm's input). An edge's score is
the sender's change (clean - corrupted, (B, T, C)) dotted with the gradient of the metric by
the receiver's own input, which the corrupted run's backward gives for every receiver at once:

- a head's q, k, v: `Edit(q_input=, k_input=, v_input=)` zeros (B, T, H, C) that the head alone
  reads (`qkv.nn.edit`): their gradients are each head's own input gradients;
- an MLP: its input is resid_mid, which the MLP reads and the stream carries past it, so
  d metric / d resid_mid (the gradient by attn_out, which only joins there) less d metric /
  d resid_post (the path past the MLP) is the path through the MLP alone;
- the logits: d metric / d the last block's output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.nn.edit import Edit


def edge_names(num_layers: int, num_heads: int) -> tuple[list[str], list[str]]:
    """(senders, receivers) in the order of the edge grid's rows and columns:
    senders 'embed', then per layer 'L{l}.H{h}' and 'L{l}.mlp'; receivers per layer
    'L{l}.H{h}.q' (every head), then .k, then .v, then 'L{l}.mlp'; last 'logits'."""
    senders, receivers = ["embed"], []
    for n in range(num_layers):
        senders += [f"L{n}.H{h}" for h in range(num_heads)] + [f"L{n}.mlp"]
        receivers += [f"L{n}.H{h}.{x}" for x in "qkv" for h in range(num_heads)] + [f"L{n}.mlp"]
    return senders, [*receivers, "logits"]


def edge_mask(num_layers: int, num_heads: int) -> Tensor:
    """(senders, receivers) boolean: True where the sender writes before the receiver reads
    (a head of layer l reaches layer l's MLP and every later layer; an MLP, later layers)."""
    per_layer = num_heads + 1
    send_layer = torch.tensor([-1] + [n for n in range(num_layers) for _ in range(per_layer)])
    send_mlp = torch.tensor([False] + [h == num_heads for _ in range(num_layers)
                                       for h in range(per_layer)])  # fmt: skip
    width = 3 * num_heads + 1
    receive_layer = torch.tensor([n for n in range(num_layers) for _ in range(width)]
                                 + [num_layers])  # fmt: skip
    receive_mlp = torch.tensor([r == width - 1 for _ in range(num_layers) for r in range(width)]
                               + [False])  # fmt: skip
    later = receive_layer[None, :] > send_layer[:, None]
    same = (receive_layer[None, :] == send_layer[:, None]) & receive_mlp[None, :]
    return later | (same & ~send_mlp[:, None])


def input_taps(stack, B: int, T: int) -> tuple[dict[int, Edit], list[Tensor]]:
    """Edits adding zeros (B, T, H, C) with gradients to every head's q, k and v input, and the
    zeros in order (layer by layer, q, k, v)."""
    edits, taps = {}, []
    for n, block in enumerate(stack.blocks):
        H, C = block.attn.num_heads, stack.config.block.width
        q, k, v = (torch.zeros(B, T, H, C, requires_grad=True) for _ in range(3))
        edits[n] = Edit(q_input=q, k_input=k, v_input=v)
        taps += [q, k, v]
    return edits, taps


def senders_delta(stack, clean: dict, corrupt: dict) -> Tensor:
    """(B, senders, T, C): each sender's clean less corrupted write into the stream; clean and
    corrupt hold 'embed' (B, T, C) and per layer 'z' (B, H, T, D) and 'mlp_out' (B, T, C)."""
    parts = [(clean["embed"] - corrupt["embed"])[:, None]]  # (B, 1, T, C)
    for n, block in enumerate(stack.blocks):
        weight = block.attn.out.weight  # (C, H*D)
        z = clean[f"L{n}.z"] - corrupt[f"L{n}.z"]  # (B, H, T, D)
        per_head = weight.view(weight.shape[0], z.shape[1], z.shape[3]).to(z.dtype)  # (C, H, D)
        parts.append(torch.einsum("bhtd,chd->bhtc", z, per_head))  # (B, H, T, C)
        parts.append((clean[f"L{n}.mlp_out"] - corrupt[f"L{n}.mlp_out"])[:, None])
    return torch.cat(parts, dim=1)  # (B, senders, T, C)


def receivers_grad(taps: list[Tensor], grads: dict) -> list[Tensor]:
    """Per layer, (B, 3H + 1, T, C): each receiver's input gradient (q, k, v per head, then the
    MLP's), and last the logits' (B, 1, T, C); grads holds the taps' gradients ('tap{i}') and
    per layer 'attn_out' and 'resid_post'."""
    layers = len(taps) // 3
    found = []
    for n in range(layers):
        heads = [grads[f"tap{3 * n + i}"].permute(0, 2, 1, 3) for i in range(3)]  # (B, H, T, C)
        mlp = grads[f"L{n}.attn_out"] - grads[f"L{n}.resid_post"]  # through the MLP alone
        found.append(torch.cat([*heads, mlp[:, None]], dim=1))  # (B, 3H + 1, T, C)
    found.append(grads[f"L{layers - 1}.resid_post"][:, None])  # (B, 1, T, C)
    return found


def edge_scores(delta: Tensor, gradients: list[Tensor]) -> Tensor:
    """(B, senders, receivers): every sender's change dotted with every receiver's gradient,
    summed over positions, a layer of receivers at a time."""
    B, S = delta.shape[:2]
    flat = delta.reshape(B, S, -1)  # (B, S, T*C)
    columns = [flat @ g.reshape(B, g.shape[1], -1).transpose(1, 2) for g in gradients]
    return torch.cat(columns, dim=2)  # (B, S, receivers)
