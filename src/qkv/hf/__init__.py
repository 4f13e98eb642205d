"""qkv inside `transformers`: an attention implementation that keeps the weights.

Importing this module registers `attn_implementation="qkv"` with transformers'
`AttentionInterface` (and its mask function with `AttentionMaskInterface`), so that any model
transformers loads runs every attention layer through `qkv.attend`, on the fastest backend
for the device, and still answers `output_attentions=True`: each layer's weights recomputed
from the q and k the kernel received (and its log-sum-exp where it has one), equal to eager's.

    import qkv.hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="qkv")
    # a model qkv would not compute exactly is refused by name as it loads;
    qkv.hf.check(model)                                   # and here, before its first forward
    model(ids, output_attentions=True).attentions         # every layer's (B, H, T, T)
    with qkv.hf.keep(model, layers=[0, 5], heads=[2]) as kept:
        model(ids, output_attentions=True)                # only those: kept.weights[5]
    seen = qkv.hf.inspect(model, tokenizer).attentions("The bank of the river")

`import qkv` does not import this module (nor transformers): it is imported by name.
"""

from qkv.hf.backend import NAME, Kept, attention, check, keep, register
from qkv.hf.inspected import Inspected, inspect, load

__all__ = ["NAME", "Inspected", "Kept", "attention", "check", "inspect", "keep", "load",
           "register"]  # fmt: skip

register()
