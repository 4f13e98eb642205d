"""The mechanism: `attend(q, k, v, ...)` and its interchangeable backends.

`loop` is the article itself and the oracle; `eager` is the vectorized form that can
return the weights; `sdpa` is torch's fused function. `auto` picks the fastest that can
run the inputs, and `explain_choice` says which.
"""

from qkv.attention.eager import attention_weights
from qkv.attention.inputs import causal_mask
from qkv.attention.loop import PairStep, QuerySteps, steps
from qkv.attention.registry import (
    BACKENDS,
    Backend,
    Choice,
    attend,
    backend_names,
    explain_choice,
    register_backend,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "Choice",
    "PairStep",
    "QuerySteps",
    "attend",
    "attention_weights",
    "backend_names",
    "causal_mask",
    "explain_choice",
    "register_backend",
    "steps",
]
