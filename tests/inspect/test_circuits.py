"""qkv.circuits: each head's QK and OV circuits from the weights. Planted heads whose composition
is known rank first; singular values and composition scores equal a direct computation with
the full C x C matrices; the token tables equal the whole V x V tables, made from a real
forward's queries, keys and values; qk_by_distance equals the real score of two tokens placed
that far apart; what cannot be read from the weights is refused by name."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.inspect import circuit_tokens
from qkv.inspect.circuits import stack_circuits
from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig, LatentConfig
from variant_models import decoder, tiny

C, D = 32, 8


def _decoder(vocab: int = 40, layers: int = 3, seed: int = 0, **block) -> Decoder:
    """A random float64 decoder, its norms' gains (and shifts) random too, so that a fold
    that is missing or wrong shows."""
    config = DecoderConfig(
        vocab_size=vocab, num_layers=layers, position="rotary",
        block=BlockConfig(**{"width": C, "num_heads": 4, "head_dim": D, "bias": False,
                             "mlp_hidden": 16, "norm": "rmsnorm", **block}),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Decoder(config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(
                    0.5 + torch.rand_like(p) if name.endswith("weight") else torch.randn_like(p)
                )
            else:
                p.normal_(0, 0.3)
    return model


def _fold(norm, width: int) -> torch.Tensor:
    """The norm's linear part as a full (W, W) matrix: diag(gain) times the centering."""
    if norm is None:
        return torch.eye(width, dtype=torch.float64)
    gain = norm.weight.double() + (1.0 if getattr(norm, "plus_one", False) else 0.0)
    matrix = torch.diag(gain)
    if isinstance(norm, torch.nn.LayerNorm):
        matrix = matrix @ (torch.eye(width, dtype=torch.float64) - 1.0 / width)
    return matrix


def _direct(model: Decoder) -> dict[str, torch.Tensor]:
    """Every head's W_QK and W_OV as full (C, C) matrices, made the slow, plain way."""
    qk, ov = [], []
    for block in model.blocks:
        attn = block.attn
        H, Hkv = attn.num_heads, attn.num_kv_heads
        if hasattr(attn, "qkv"):
            Wq, Wk, Wv = attn.qkv.weight.double().split(attn.sizes)
        else:
            Wq, Wk, Wv = attn.q.weight.double(), attn.k.weight.double(), attn.v.weight.double()
        reading = _fold(block.attn_norm, C)
        Wq, Wk, Wv = Wq @ reading, Wk @ reading, Wv @ reading
        if attn.qk_norm == "full":
            Wq, Wk = _fold(attn.q_norm, H * D) @ Wq, _fold(attn.k_norm, Hkv * D) @ Wk
        Wo = _fold(block.attn_out_norm, C) @ attn.out.weight.double()
        for h in range(H):
            g = h // (H // Hkv)
            q, k, v = Wq[h * D : (h + 1) * D], Wk[g * D : (g + 1) * D], Wv[g * D : (g + 1) * D]
            if attn.qk_norm == "head":
                q, k = _fold(attn.q_norm, D) @ q, _fold(attn.k_norm, D) @ k
            qk.append(q.T @ k)  # (C, C): x_q^T W_QK x_k
            ov.append(Wo[:, h * D : (h + 1) * D] @ v)  # (C, C): W_OV x
    return {"qk": torch.stack(qk), "ov": torch.stack(ov)}


def _comp(A: torch.Tensor, B: torch.Tensor) -> float:
    return float((A @ B).norm() / (A.norm() * B.norm()))


VARIANTS = {
    "gqa": {"num_kv_heads": 2},
    "layernorm, fused, per-head QK-norm": {"norm": "layernorm", "fused_qkv": True,
                                           "qk_norm": "head", "num_kv_heads": 1},
    "sub-layer norm, QK-norm over all heads": {"sublayer_norm": True, "qk_norm": "full"},
}  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
def test_singular_values_and_composition_equal_the_full_matrices(variant):
    model = _decoder(**VARIANTS[variant])
    found = stack_circuits(model)
    with torch.no_grad():
        direct = _direct(model)
    assert found.names[:5] == ["L0.H0", "L0.H1", "L0.H2", "L0.H3", "L1.H0"]
    for i in range(len(found.names)):
        qk, ov = torch.linalg.svdvals(direct["qk"][i]), torch.linalg.svdvals(direct["ov"][i])
        torch.testing.assert_close(found.qk_singular[i], qk[:D], rtol=0, atol=1e-9 * float(qk[0]))
        torch.testing.assert_close(found.ov_singular[i], ov[:D], rtol=0, atol=1e-9 * float(ov[0]))
        assert qk[D:].abs().max() < 1e-9 * qk[0]  # rank D at most: the factors are all of it
    for kind in ("q", "k", "v"):
        scores = found.composition(kind)
        assert scores.shape == (3, 4, 3, 4)
        for s in range(len(found.names)):
            for r in range(len(found.names)):
                got = scores[found.layer[s], found.head[s], found.layer[r], found.head[r]]
                if found.layer[s] >= found.layer[r]:
                    assert got != got  # NaN: only earlier layers send
                    continue
                A = {"q": direct["qk"][r].T, "k": direct["qk"][r], "v": direct["ov"][r]}[kind]
                assert abs(float(got) - _comp(A, direct["ov"][s])) < 1e-9


def test_planted_compositions_rank_first():
    """L0.H0 writes dims 0:4 into 20:24, which L1.H2's key reads; L0.H1 writes into 24:28,
    which L1.H0's query reads; L0.H3 writes into 28:32, which L1.H1's value reads."""
    model = _decoder(layers=2, seed=1)
    eye = torch.eye(4, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2 and p is not model.embed.tokens.weight:
                p.mul_(0.02 / 0.3)
        a, b = model.blocks[0].attn, model.blocks[1].attn
        a.v.weight[0:4, 0:4] += eye
        a.out.weight[20:24, 0:4] += eye  # L0.H0: OV maps 0:4 to 20:24
        b.k.weight[2 * D : 2 * D + 4, 20:24] += eye  # L1.H2's key reads 20:24
        b.q.weight[2 * D : 2 * D + 4, 4:8] += eye
        a.v.weight[D : D + 4, 8:12] += eye
        a.out.weight[24:28, D : D + 4] += eye  # L0.H1: 8:12 to 24:28
        b.q.weight[0:4, 24:28] += eye  # L1.H0's query reads 24:28
        b.k.weight[0:4, 12:16] += eye
        a.v.weight[3 * D : 3 * D + 4, 16:20] += eye
        a.out.weight[28:32, 3 * D : 3 * D + 4] += eye  # L0.H3: 16:20 to 28:32
        b.v.weight[D : D + 4, 28:32] += eye  # L1.H1's value reads 28:32
        b.out.weight[0:4, D : D + 4] += eye
    found = stack_circuits(model)
    assert found.strongest("k", 1)[0][:2] == ("L0.H0", "L1.H2")
    assert found.strongest("q", 1)[0][:2] == ("L0.H1", "L1.H0")
    assert found.strongest("v", 1)[0][:2] == ("L0.H3", "L1.H1")
    top = found.strongest("k", 3)
    assert top[0][2] > 0.5 > top[1][2] and top[1][2] >= top[2][2]
    assert len(found.strongest("k", 1000)) == 16  # every (L0 sender, L1 receiver) pair


def _forward(model: Decoder, ids: torch.Tensor):
    """Layer 0's record of a forward: queries, keys and values after the model's own norm."""
    with torch.inference_mode():
        return model(ids, layers=[0]).records[0]


def test_token_tables_equal_the_whole_vocabulary_tables(monkeypatch):
    model = _decoder(num_kv_heads=2)
    V, h, g = 40, 3, 1
    monkeypatch.setattr(circuit_tokens, "_ROWS", 7)  # several blocks, the last one short
    head = stack_circuits(model).head_circuit(0, h, top=5)
    # each token alone at position 0 (no rotation there): its real query, key and value
    record = _forward(model, torch.arange(V)[:, None])
    q, k, v = record.q[:, h, 0], record.k[:, g, 0], record.v[:, g, 0]  # (V, D)
    table = record.scale * q @ k.T  # (V, V)
    best = table.flatten().topk(5)
    assert head.pair_ids == [(i // V, i % V) for i in best.indices.tolist()]
    scores = torch.tensor([s for _, _, s in head.pairs], dtype=torch.float64)
    torch.testing.assert_close(scores, best.values, rtol=0, atol=1e-9)
    with torch.inference_mode():
        written = v @ model.blocks[0].attn.out.weight[:, h * D : (h + 1) * D].T  # (V, C)
        U = model.lm_head.weight * model.norm.weight  # the final norm's gain folded
        copy = written @ U.T  # (V, V): token t attended to, token u's logit
    diagonal = copy.diagonal().topk(5)
    assert head.copied_ids == diagonal.indices.tolist()
    copied = torch.tensor([s for _, s in head.copied], dtype=torch.float64)
    torch.testing.assert_close(copied, diagonal.values, rtol=0, atol=1e-9)
    eig = torch.linalg.eigvals(copy)
    eig = eig[torch.argsort(eig.abs(), descending=True)][:D]  # the rest are 0: rank D

    def ordered(z):  # conjugate pairs share a size: order by real part, then imaginary
        return sorted(z.tolist(), key=lambda c: (round(c.real, 6), c.imag))

    for got, want in zip(ordered(head.eigenvalues), ordered(eig), strict=True):
        assert abs(got - want) < 1e-8 * float(eig.abs()[0])
    assert abs(head.copying - float(eig.sum().real / eig.abs().sum())) < 1e-9
    assert -1.0 <= head.copying <= 1.0
    assert head.to_dict()["pairs"][0]["ids"] == list(head.pair_ids[0])


@pytest.mark.parametrize("block", [{}, {"qk_norm": "head"}, {"qk_norm": "l2"}])
def test_qk_by_distance_is_the_real_score_of_two_tokens_that_far_apart(block):
    model = _decoder(num_kv_heads=2, **block)
    found = stack_circuits(model)
    query, key, h = 5, 11, 2
    distances = [0, 1, 3, 9]
    by_distance = found.qk_by_distance(0, h, query, key, distances)
    for d, got in zip(distances, by_distance.tolist(), strict=True):
        ids = torch.tensor([[key] + [0] * (d - 1) + [query]]) if d else torch.tensor([[query]])
        record = _forward(model, ids)
        if d == 0:
            real = record.scale * record.q[0, h, 0] @ _forward(model, torch.tensor([[key]])).k[
                0, h // 2, 0]  # fmt: skip
        else:
            real = record.scale * record.q[0, h, d] @ record.k[0, h // 2, 0]
        # Llama 4's L2 norm runs in float32 in the model itself (qkv.nn.attention.l2_norm)
        assert abs(got - float(real)) < (1e-6 if block.get("qk_norm") == "l2" else 1e-9)
    assert len(set(by_distance.tolist())) == len(distances)  # rotary: it does turn


def test_the_qk_table_is_the_circuit_at_distance_zero():
    model = _decoder()
    found = stack_circuits(model)
    head = found.head_circuit(1, 0, top=3)
    (a, b), score = head.pair_ids[0], head.pairs[0][2]
    assert abs(float(found.qk_by_distance(1, 0, a, b, [0])[0]) - score) < 1e-9
    assert float(found.qk_by_distance(1, 0, a, b, [4])[0]) != pytest.approx(score)


def test_linear_layers_are_skipped_and_named():
    from linear_models import linear_model  # a helper of the tests, as variant_models

    found = qkv.circuits(linear_model())
    assert found.skipped == [0, 1] and set(found.layer) == {2}
    with pytest.raises(ValueError, match="layer 0 of tiny is linear attention"):
        found.head_circuit(0, 0)
    assert found.strongest("k") == []  # one softmax layer: nothing earlier composes into it


def test_refusals_name_what_cannot_be_read_from_the_weights():
    gated = tiny(decoder(output_gate=True))
    with pytest.raises(ValueError, match="gates each head's output"):
        qkv.circuits(gated)
    latent = LatentConfig(32, 2, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                          v_head_dim=6)  # fmt: skip
    with pytest.raises(ValueError, match="latent attention"):
        qkv.circuits(tiny(decoder(latent=latent)))
    packed = tiny(decoder())
    packed.model.blocks[1].attn.k = torch.nn.Identity()  # stands for an Int4Linear: no matrix
    with pytest.raises(ValueError, match=r"layer 1 is packed \(int4\): load it without int4"):
        qkv.circuits(packed)
    packed.model.blocks[0].attn.out = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"layer 0 is packed \(int4\)"):
        qkv.circuits(packed)
    post = tiny(decoder(norm_position="post"))
    found = qkv.circuits(post)
    assert any("post-norm" in note for note in found.notes)
    with pytest.raises(ValueError, match="post-norm"):
        found.strongest("k")
    with pytest.raises(ValueError, match="kind must be"):
        qkv.circuits(tiny(decoder())).composition("x")
    with pytest.raises(ValueError, match="head 5 is out of range: layer 1 has 2 heads"):
        qkv.circuits(tiny(decoder())).head_circuit(1, 5)
    with pytest.raises(ValueError, match="top must be a whole number from 1 to 1000"):
        qkv.circuits(tiny(decoder())).head_circuit(1, 0, top=10**9)  # its candidates are held


def test_words_of_a_pretrained_model_are_its_tokens():
    found = qkv.circuits(tiny(decoder()))
    head = found.head_circuit(0, 1, top=2)
    assert all(isinstance(q, str) and isinstance(k, str) for q, k, _ in head.pairs)
    assert found.qk_by_distance(0, 1, "bank", "river", [2]).shape == (1,)
    assert found.to_dict(2)["strongest"]["v"][0]["sender"].startswith("L0.H")


def test_top_pairs_screened_in_float32_keep_the_float64_order_of_near_ties(monkeypatch):
    monkeypatch.setattr(circuit_tokens, "_ROWS", 5)
    torch.manual_seed(0)
    q = torch.randn(40, 8, dtype=torch.float64)
    # 30 keys that float32 cannot tell apart: only the float64 pass orders them
    k = torch.randn(1, 8, dtype=torch.float64) + 1e-10 * torch.randn(30, 8, dtype=torch.float64)
    ids, scores = circuit_tokens.top_pairs(q, k, 12)
    full = (q @ k.T).flatten().topk(12)
    assert ids == [(i // 30, i % 30) for i in full.indices.tolist()]
    assert max(abs(a - b) for a, b in zip(scores, full.values.tolist(), strict=True)) < 1e-12
