"""Encoder: the BERT-like stack, where every token attends to every token."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from qkv.models.config import (
    EncoderConfig,
    Layers,
    Rotaries,
    check_resume,
    check_stop,
    init_weights,
    key_padding,
    recorded_layers,
)
from qkv.nn import AttentionRecord, EncoderBlock
from qkv.nn.edit import Edits, check_edits
from qkv.nn.linear import project
from qkv.nn.mlps import ACTIVATIONS, GATED, Activation
from qkv.nn.position import positions_for


@dataclass
class EncoderOutput:
    hidden: Tensor  # (B, T, C) the contextualized vector of every token
    records: dict[int, AttentionRecord] = field(default_factory=dict)  # the layers asked
    # with hidden_states=True: the embeddings, then each block's output, (B, T, C) each
    hidden_states: list[Tensor] = field(default_factory=list)
    # with logits=True: the MLM head's scores (B, T, vocab) for the token at each position
    logits: Tensor | None = None


def padded_positions(input_ids: Tensor, padding: int) -> Tensor:
    """(B, T) RoBERTa's positions (fairseq's make_positions): real tokens count from
    padding + 1, skipping padding tokens, which sit at `padding` themselves.

    >>> import torch
    >>> padded_positions(torch.tensor([[5, 6, 1, 7, 1]]), padding=1).tolist()
    [[2, 3, 1, 4, 1]]
    """
    real = (input_ids != padding).long()  # (B, T)
    return real.cumsum(-1) * real + padding


class MaskedLMHead(nn.Module):
    """BERT's masked-language-model head: vectors (B, T, C) -> vocabulary logits (B, T, vocab).

    A dense layer C -> C, the activation, a LayerNorm, then a decoder C -> vocab whose matrix
    is the token embedding matrix (the encoder ties it) and whose bias is the head's own.
    bias, norm_bias: the dense layer's and the LayerNorm's biases (ModernBERT has neither).

    >>> import torch
    >>> head = MaskedLMHead(width=16, vocab_size=50, activation="gelu", norm_eps=1e-12)
    >>> head(torch.randn(2, 3, 16)).shape
    torch.Size([2, 3, 50])
    """

    def __init__(
        self,
        width: int,
        vocab_size: int,
        activation: Activation,
        norm_eps: float,
        *,
        bias: bool = True,
        norm_bias: bool = True,
    ):
        super().__init__()
        self.dense = nn.Linear(width, width, bias=bias)
        self.activation = ACTIVATIONS[activation]
        self.norm = nn.LayerNorm(width, eps=norm_eps, bias=norm_bias)
        self.decoder = nn.Linear(width, vocab_size)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(self.activation(project(self.dense, x)))  # (B, T, C)
        return project(self.decoder, h)  # (B, T, vocab)


class Encoder(nn.Module):
    """Token ids (B, T) -> contextualized vectors (B, T, C).

    >>> import torch
    >>> from qkv.nn import BlockConfig
    >>> cfg = EncoderConfig(vocab_size=50, num_layers=2, block=BlockConfig(width=16, num_heads=4))
    >>> out = Encoder(cfg)(torch.tensor([[1, 2, 3]]), layers=[1])
    >>> out.hidden.shape, out.records[1].weights([0]).shape  # (B, heads, T, T)
    (torch.Size([1, 3, 16]), torch.Size([1, 1, 3, 3]))

    With mlm_head=True it also scores every position over the vocabulary, as BERT's
    masked-language-model pretraining does:

    >>> from dataclasses import replace
    >>> mlm = Encoder(replace(cfg, mlm_head=True))
    >>> mlm(torch.tensor([[1, 2, 3]]), logits=True).logits.shape
    torch.Size([1, 3, 50])
    """

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.embed = config.embeddings()
        self.rotary = Rotaries(config)  # shared by every block: one rotation per forward
        self.relative = config.relative_bias(bidirectional=True)  # T5's, shared likewise
        self.blocks = nn.ModuleList(
            EncoderBlock(config.block_for(i), self.rotary.for_layer(i))
            for i in range(config.num_layers)
        )
        if not config.first_attn_norm:  # the embeddings' norm already normalized its input
            self.blocks[0].attn_norm = nn.Identity()
        self.norm = config.block.make_norm() if config.has_final_norm else None
        self.mlm: MaskedLMHead | None = None
        if config.mlm_head:
            block = config.block
            # a gated block's nonlinearity is its gate's (silu, gelu): the head's one uses it too
            activation = GATED.get(block.mlp, block.mlp)
            self.mlm = MaskedLMHead(
                block.width, config.vocab_size, activation, block.norm_eps,
                bias=block.bias, norm_bias=block.norm_bias,
            )  # fmt: skip
        self.apply(init_weights)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the token matrix with the MLM head's decoder, if there is a head."""
        if self.mlm is not None:
            self.mlm.decoder.weight = self.embed.tokens.weight

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        layers: Layers = None,
        hidden_states: bool = False,
        logits: bool = False,
        edits: Edits | None = None,
        resume: tuple[int, Tensor] | None = None,
        stop: int | None = None,
    ) -> EncoderOutput:
        """attention_mask (B, T): 1 for real tokens, 0 for padding, which no token attends to.

        layers: the layers whose AttentionRecord to return (indices, or "all").
        hidden_states: also return every layer's input and the last one's output.
        logits: also return the MLM head's logits (B, T, vocab); needs mlm_head=True.
        edits: {layer: Edit}, interventions in those layers (`qkv.nn.edit`).
        resume: (layer, x): start at that block with x (B, T, C) as its input, the blocks
          before it skipped (x is their output, e.g. an earlier run's hidden_states[layer]);
          hidden_states then starts at x.
        stop: run the blocks before this one only; the output is then the last one's, with
          no final norm and no logits.
        """
        if logits and self.mlm is None:
            raise ValueError(
                "logits=True needs the masked-language-model head: build the encoder with "
                "EncoderConfig(mlm_head=True), or load a BertForMaskedLM checkpoint"
            )
        wanted = recorded_layers(layers, self.config.num_layers)
        edits = check_edits(edits, self.config.num_layers)
        first, x = check_resume(resume, input_ids, self.config)
        last = check_stop(stop, first, len(self.blocks))
        if logits and stop is not None:
            raise ValueError("logits need every block: leave stop out")
        if self.config.position_padding is None:
            positions = positions_for(input_ids.shape[1], device=input_ids.device)  # (T,)
        else:
            positions = padded_positions(input_ids, self.config.position_padding)  # (B, T)
        if x is None:
            x = self.embed(input_ids, positions, token_type_ids)  # (B, T, C)
        rotations = self.rotary.rotations(positions, x.dtype)
        padding = key_padding(attention_mask)
        mask = None if padding is None else padding[:, None, None, :]  # (B, 1, 1, T)
        T = input_ids.shape[1]
        bias = None if self.relative is None else self.relative(T, T).to(x.dtype)  # (1, H, T, T)
        records: dict[int, AttentionRecord] = {}
        states = [x] if hidden_states else []
        for layer in range(first, last):
            rotation = self.rotary.rotation_for(rotations, layer)
            x, kept = self.blocks[layer](
                x, mask=mask, rotation=rotation, bias=bias, edit=edits.get(layer),
                record=layer in wanted,
            )  # fmt: skip
            if kept is not None:
                records[layer] = kept
            if hidden_states:
                states.append(x)
        if self.norm is not None and stop is None:
            x = self.norm(x)
        scores = self.mlm(x) if logits else None  # (B, T, vocab)
        return EncoderOutput(x, records, states, scores)
