"""T5 (and T5 v1.1, flan-t5): a pre-norm encoder-decoder with no positions added to the
tokens. Each stack adds T5's relative position buckets to its self-attention scores (one
learned table, in the first layer, for every layer); scores are not scaled by 1/sqrt(D);
norms are RMS norms; nothing has a bias. The MLP is relu (T5) or gated tanh-gelu (v1.1).
The original T5 ties its LM head to the token matrix and scales the decoder's output by
d_model ** -0.5 before it; v1.1 has an LM head of its own and no scale."""

from __future__ import annotations

from qkv.io.families.checks import ConfigValueError, flag, real, whole
from qkv.io.families.common import ACTIVATIONS, Family, Layout, Weight, expand, fits, require
from qkv.models import EncoderDecoder, EncoderDecoderConfig
from qkv.nn import BlockConfig

# feed_forward_proj's activation (T5's ACT2FN name) -> qkv's MLP, plain and gated
GATED = {"gelu_new": "geglu_tanh", "gelu_pytorch_tanh": "geglu_tanh", "gelu": "geglu",
         "silu": "swiglu", "swish": "swiglu"}  # fmt: skip


def _mlp(hf: dict) -> str:
    """The MLP that feed_forward_proj names: "relu", "gated-gelu" (tanh-gelu, as T5's own
    code has it), "gated-silu", ..."""
    proj = hf.get("feed_forward_proj", "relu")
    if not isinstance(proj, str):
        raise ConfigValueError("feed_forward_proj", f"must be a name like 'relu', got {proj!r}")
    parts = proj.split("-")
    gated = len(parts) == 2 and parts[0] == "gated"
    if len(parts) > 2 or (len(parts) == 2 and not gated):
        raise ConfigValueError("feed_forward_proj", f"must be 'ACT' or 'gated-ACT', got {proj!r}")
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]  # T5's backward-compatible rule
    # transformers 5 writes what it derived; a config.json that disagrees is not one model
    for key, derived in (("dense_act_fn", act), ("is_gated_act", gated)):
        if hf.get(key, derived) != derived:
            raise ValueError(
                f"T5 checkpoints with {key}={hf[key]!r} and feed_forward_proj={proj!r} "
                f"(which gives {derived!r}) are not supported"
            )
    table = GATED if gated else ACTIVATIONS
    if act not in table:
        raise ValueError(
            f"T5 checkpoints with feed_forward_proj={proj!r} are not supported; supported: "
            f"{', '.join(sorted(ACTIVATIONS))}, gated-{', gated-'.join(sorted(GATED))}"
        )
    return table[act]


def _scaled(hf: dict) -> bool:
    """Whether the decoder's output is scaled by d_model ** -0.5 before the LM head:
    transformers 5 writes scale_decoder_outputs; older config.json files say it by
    tie_word_embeddings (v1.1: false, an LM head of its own, no scale)."""
    # read either way, so a wrong kind fails: transformers 5 then ties the head whatever it says
    tied = flag(hf, "tie_word_embeddings", True)
    if "scale_decoder_outputs" in hf:
        return flag(hf, "scale_decoder_outputs")
    return tied


def config(hf: dict) -> EncoderDecoderConfig:
    """A config.json -> the qkv config of the same encoder-decoder."""
    require(hf, "T5", is_decoder=(False,))
    width, heads = whole(hf, "d_model"), whole(hf, "num_heads")
    buckets = whole(hf, "relative_attention_num_buckets", 32, minimum=4)
    layers = whole(hf, "num_layers")
    scaled = _scaled(hf)
    return EncoderDecoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        encoder_layers=layers,
        decoder_layers=whole(hf, "num_decoder_layers", layers),
        # relative positions have no table to run out of: this is the length T5 was
        # trained on, which qkv reports as the context window
        max_positions=whole(hf, "n_positions", 512),
        position="relative",
        relative_buckets=buckets,
        relative_max_distance=whole(hf, "relative_attention_max_distance", 128),
        embed_scale=False,
        tie_embeddings=True,
        tie_lm_head=scaled,
        head_scale=width**-0.5 if scaled else None,
        block=BlockConfig(
            width=width,
            num_heads=heads,
            head_dim=whole(hf, "d_kv"),
            mlp_hidden=whole(hf, "d_ff"),
            mlp=_mlp(hf),
            norm="rmsnorm",
            norm_eps=real(hf, "layer_norm_epsilon", 1e-6, positive=True),
            norm_position="pre",
            bias=False,
            attn_scale=1.0,  # T5 folds the scale into its initialization
        ),
    )


# qkv's MLP -> feed_forward_proj and the activation transformers derives from it
PROJECTIONS = {
    "relu": ("relu", "relu"),
    "gelu": ("gelu", "gelu"),
    "gelu_tanh": ("gelu_new", "gelu_new"),
    "silu": ("silu", "silu"),
    "geglu_tanh": ("gated-gelu", "gelu_new"),
    "swiglu": ("gated-silu", "silu"),
}


def hf_config(cfg: EncoderDecoderConfig) -> dict:
    """The config.json of a T5-shaped encoder-decoder (T5ForConditionalGeneration).

    >>> cfg = EncoderDecoderConfig(vocab_size=50, encoder_layers=2, decoder_layers=1,
    ...     position="relative", embed_scale=False, head_scale=16**-0.5,
    ...     block=BlockConfig(width=16, num_heads=4, head_dim=8, mlp_hidden=32, mlp="relu",
    ...     norm="rmsnorm", norm_eps=1e-6, bias=False, attn_scale=1.0))
    >>> hf = hf_config(cfg)
    >>> hf["d_kv"], hf["feed_forward_proj"], hf["tie_word_embeddings"], config(hf) == cfg
    (8, 'relu', True, True)
    """
    block = cfg.block
    scaled = cfg.tie_lm_head
    fits("T5", cfg, position="relative", type_vocab_size=0, embed_norm=False,
         embed_scale=False, has_final_norm=True, tie_embeddings=True, lm_head_bias=False,
         head_scale=block.width**-0.5 if scaled else None, block__norm="rmsnorm",
         block__norm_position="pre", block__bias=False, block__qkv_bias=None,
         block__fused_qkv=False, block__fused_mlp=False, block__sublayer_norm=False,
         block__parallel=False, block__attn_scale=1.0, block__softcap=None,
         block__window=None, block__qk_norm=None, block__kv_heads=block.num_heads)  # fmt: skip
    if block.mlp not in PROJECTIONS:
        raise ValueError(
            f"a T5 config.json cannot hold mlp={block.mlp!r}; it holds {', '.join(PROJECTIONS)}"
        )
    proj, act = PROJECTIONS[block.mlp]
    return {
        "model_type": "t5",
        "architectures": ["T5ForConditionalGeneration"],
        "vocab_size": cfg.vocab_size,
        "d_model": block.width,
        "d_kv": block.head_size,
        "d_ff": block.mlp_hidden or 4 * block.width,
        "num_layers": cfg.encoder_layers,
        "num_decoder_layers": cfg.decoder_layers,
        "num_heads": block.num_heads,
        "relative_attention_num_buckets": cfg.relative_buckets,
        "relative_attention_max_distance": cfg.relative_max_distance,
        "n_positions": cfg.max_positions,
        "layer_norm_epsilon": block.norm_eps,
        "feed_forward_proj": proj,
        "dense_act_fn": act,
        "is_gated_act": proj.startswith("gated-"),
        # both spellings: transformers 4 reads the scale from tie_word_embeddings
        "tie_word_embeddings": scaled,
        "scale_decoder_outputs": scaled,
        "dropout_rate": block.dropout,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,  # T5 starts decoding from the pad token
        "is_encoder_decoder": True,
    }


SHARED = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# a head of its own, even where it starts as a copy of the token matrix (not the same memory)
OWN = Layout(load=lambda t: t.clone())
BIAS_TABLE = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"


def _attention(q: str, h: str) -> list:
    return [(f"{q}.{a}.weight", f"{h}.{b}.weight") for a, b in
            [("q", "q"), ("k", "k"), ("v", "v"), ("out", "o")]]  # fmt: skip


def _stack(stack: str, cfg: EncoderDecoderConfig) -> list:
    """The templates of one stack: "encoder" or "decoder" (which cross-attends too).
    T5's blocks are lists of sub-layers: self-attention, cross-attention (decoder), MLP."""
    q, h = f"{stack}.blocks.{{}}", f"{stack}.block.{{}}.layer"
    templates = [(f"{q}.attn_norm.weight", f"{h}.0.layer_norm.weight"),
                 *_attention(f"{q}.attn", f"{h}.0.SelfAttention")]  # fmt: skip
    mlp = 1
    if stack == "decoder":
        templates += [(f"{q}.cross_norm.weight", f"{h}.1.layer_norm.weight"),
                      *_attention(f"{q}.cross_attn", f"{h}.1.EncDecAttention")]  # fmt: skip
        mlp = 2
    dense = f"{h}.{mlp}.DenseReluDense"
    if cfg.block.mlp in ("swiglu", "geglu", "geglu_tanh"):
        parts = [("gate", "wi_0"), ("up", "wi_1"), ("down", "wo")]
    else:
        parts = [("fc_in", "wi"), ("fc_out", "wo")]
    templates += [(f"{q}.mlp.{a}.weight", f"{dense}.{b}.weight") for a, b in parts]
    templates += [(f"{q}.mlp_norm.weight", f"{h}.{mlp}.layer_norm.weight"),
                  (f"{stack}.norm.weight", f"{stack}.final_layer_norm.weight"),
                  (f"{stack}.relative.table.weight", f"{stack}.{BIAS_TABLE}")]  # fmt: skip
    return templates


def weights(cfg: EncoderDecoderConfig) -> list[Weight]:
    if cfg.tie_lm_head:  # a checkpoint's lm_head.weight, if written, is the shared matrix
        shared = [("encoder.embed.tokens.weight", (*SHARED, "lm_head.weight"))]
    else:  # transformers ties a v1.1 head that the checkpoint does not hold: the same here
        shared = [("encoder.embed.tokens.weight", SHARED),
                  ("decoder.lm_head.weight", ("lm_head.weight", "shared.weight"), OWN)]  # fmt: skip
    return (expand(shared, 0) + expand(_stack("encoder", cfg), cfg.encoder_layers)
            + expand(_stack("decoder", cfg), cfg.decoder_layers))  # fmt: skip


FAMILY = Family(
    "t5",
    ("t5",),
    EncoderDecoder,
    config,
    hf_config,
    weights,
    # a table some checkpoints hold that T5 itself never reads (cross-attention has none)
    ignored=(r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight",),
    reads=(
        "vocab_size",
        "d_model",
        "d_kv",
        "d_ff",
        "num_layers",
        "num_decoder_layers",
        "num_heads",
        "relative_attention_num_buckets",
        "relative_attention_max_distance",
        "layer_norm_epsilon",
        "feed_forward_proj",
        "dense_act_fn",
        "is_gated_act",
        "scale_decoder_outputs",
        "tie_word_embeddings",
        "is_decoder",
        "n_positions",
    ),
    inert=(
        "dropout_rate",
        "initializer_factor",
        "use_cache",
        "pad_token_id",
        "eos_token_id",
        "decoder_start_token_id",
        "classifier_dropout",
        "is_encoder_decoder",
    ),
    config_classes=("T5Config",),
)
