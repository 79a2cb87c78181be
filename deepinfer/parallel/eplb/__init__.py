"""Expert-parallel load balancing (EPLB): replicate hot experts and spread the replicas over ranks.

    policy.py    the three maps (phy2log [L, P], log2phy [L, E, maxcnt], logcnt [L, E]) and
                 the policies that fill them: rebalance_experts (DeepSeek's, hierarchical / global,
                 over summed loads), rebalance_experts_per_step (DeepInfer's, over a window of
                 per-step loads), initial_placement (the static default); rank_loads and
                 balance_ratio to score a placement; synthetic_loads for tests and perf
    recorder.py  ExpertLoadRecorder: per-step [L, E] routed-token counts in a device-side ring
                 of the last `window` steps

Pure torch; the policies run on the CPU. Weight moves between ranks live elsewhere.
"""

from deepinfer.parallel.eplb.policy import (
    balance_ratio,
    initial_placement,
    logical_maps,
    rank_loads,
    rebalance_experts,
    rebalance_experts_per_step,
    synthetic_loads,
)
from deepinfer.parallel.eplb.recorder import ExpertLoadRecorder

__all__ = [
    "ExpertLoadRecorder",
    "balance_ratio",
    "initial_placement",
    "logical_maps",
    "rank_loads",
    "rebalance_experts",
    "rebalance_experts_per_step",
    "synthetic_loads",
]
