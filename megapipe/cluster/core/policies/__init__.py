"""Every scheduling policy by the original system's name; ``make_policy(name)`` builds one."""

from __future__ import annotations

from megapipe.cluster.core.policies.allox import AlloX
from megapipe.cluster.core.policies.base import Policy
from megapipe.cluster.core.policies.cost import MaxSumThroughput, MaxThroughputPerDollar
from megapipe.cluster.core.policies.fairness import MaxMinFairness
from megapipe.cluster.core.policies.finish_time import FinishTimeFairness
from megapipe.cluster.core.policies.gandiva import Gandiva
from megapipe.cluster.core.policies.isolated import Isolated
from megapipe.cluster.core.policies.makespan import MinTotalDuration
from megapipe.cluster.core.policies.ordering import Fifo, ShortestJobFirst
from megapipe.cluster.core.policies.water_filling import WaterFilling
from megapipe.errors import ConfigError

FACTORIES = {
    "max_min_fairness": lambda seed: MaxMinFairness(heterogeneity_aware=False),
    "max_min_fairness_perf": lambda seed: MaxMinFairness(),
    "max_min_fairness_packed": lambda seed: MaxMinFairness(space_sharing=True),
    "finish_time_fairness": lambda seed: FinishTimeFairness(heterogeneity_aware=False),
    "finish_time_fairness_perf": lambda seed: FinishTimeFairness(),
    "min_total_duration": lambda seed: MinTotalDuration(heterogeneity_aware=False),
    "min_total_duration_perf": lambda seed: MinTotalDuration(),
    "fifo": lambda seed: Fifo(heterogeneity_aware=False),
    "fifo_perf": lambda seed: Fifo(),
    "fifo_packed": lambda seed: Fifo(space_sharing=True),
    "shortest_job_first": lambda seed: ShortestJobFirst(heterogeneity_aware=False),
    "shortest_job_first_perf": lambda seed: ShortestJobFirst(),
    "max_sum_throughput_perf": lambda seed: MaxSumThroughput(),
    "max_sum_throughput_normalized_by_cost_perf": lambda seed: MaxThroughputPerDollar(),
    "max_sum_throughput_normalized_by_cost_perf_SLOs": lambda seed: MaxThroughputPerDollar(slos=True),
    "max_min_fairness_water_filling": lambda seed: WaterFilling(),
    "gandiva": lambda seed: Gandiva(seed),
    "allox": lambda seed: AlloX(),
    "isolated": lambda seed: Isolated(),
}
POLICY_NAMES = tuple(FACTORIES)


def make_policy(name: str, seed: int = 0, pop_partitions: int = 1) -> Policy:
    """The policy ``name``; with ``pop_partitions`` > 1, solved by POP over that many parts (pop.py)."""
    if name not in FACTORIES:
        raise ConfigError(f"--policy {name} is unknown; see --list-policies for the {len(FACTORIES)} names.")
    policy = FACTORIES[name](seed)
    if pop_partitions == 1:
        return policy
    from megapipe.cluster.core.policies.pop import Partitioned

    return Partitioned(policy, pop_partitions, seed)


__all__ = ["POLICY_NAMES", "Policy", "make_policy"]
