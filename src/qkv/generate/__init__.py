"""Generation: sampling with a KV cache, the fast decoding step, streaming text with stop
strings, and the weights each step reads.

- `sampling`: `Sampling`, how the next token is picked from the logits;
- `decode`: `decode_steps` (a decoder) and `seq2seq_steps` (an encoder-decoder), one new
  token per step for every sequence;
- `fast_step`: `FastStep`, one decoding step with few operations, held to `Decoder.forward`;
- `streaming`: tokens to text as it is made, cut at stop strings;
- `precision`: the model as loaded, or the copy that keeps a .gguf file's 4-bit matrices
  (`FourBits`; imported from its module: it reads files through `qkv.io`).

Generation sits below inspection: what is recorded while generating is kept by a callback
(`decode_steps(..., keep=...)`) that `qkv.inspect.generation` provides.
"""

from qkv.generate.decode import decode_steps, seq2seq_steps
from qkv.generate.fast_step import FastStep, fast_step_refusal
from qkv.generate.sampling import Sampling
from qkv.generate.streaming import Continuation, continuations, end_ids

__all__ = [
    "Continuation",
    "FastStep",
    "Sampling",
    "continuations",
    "decode_steps",
    "end_ids",
    "fast_step_refusal",
    "seq2seq_steps",
]
