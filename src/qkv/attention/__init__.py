"""The mechanism: `attend(q, k, v, ...)` and its interchangeable backends.

`loop` is the article itself and the oracle; `eager` is the vectorized form that can
return the weights; `sdpa` is torch's fused function; `flash` is qkv's own Triton kernel.
`auto` picks the fastest that can run the inputs, and `explain_choice` says which. Layers
call `attend`, or `attend_for_record` where a record also needs the log-sum-exp or the
weights made with the output; never a backend directly.
"""

from qkv.attention.eager import attention_weights
from qkv.attention.inputs import causal_mask
from qkv.attention.loop import PairStep, QuerySteps, steps
from qkv.attention.registry import (
    BACKENDS,
    Attended,
    Backend,
    Choice,
    attend,
    attend_for_record,
    backend_names,
    explain_choice,
    register_backend,
)

__all__ = [
    "BACKENDS",
    "Attended",
    "Backend",
    "Choice",
    "PairStep",
    "QuerySteps",
    "attend",
    "attend_for_record",
    "attention_weights",
    "backend_names",
    "causal_mask",
    "explain_choice",
    "register_backend",
    "steps",
]
