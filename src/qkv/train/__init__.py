"""Training from scratch: the query, key and value matrices are learned.

>>> from qkv.train import RunConfig, preset
>>> preset("bank").objective, preset("reverse").objective, RunConfig().objective
('masked', 'seq2seq', 'causal')
"""

from qkv.io.run_config import DataSpec, ModelSpec, RunConfig, TrainSpec
from qkv.train.loop import RunResult, train
from qkv.train.presets import PRESETS, preset

__all__ = [
    "PRESETS",
    "DataSpec",
    "ModelSpec",
    "RunConfig",
    "RunResult",
    "TrainSpec",
    "preset",
    "train",
]
