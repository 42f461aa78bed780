"""The isolated allocation: every job gets 1/n of each accelerator type (capped at all of its time)."""

from megapipe.cluster.core.policies.base import Policy


class Isolated(Policy):
    name = "isolated"
    heterogeneity_aware = False
    unpartitionable = "its allocation is a closed form, with no solve to split"

    def allocate(self, problem):
        return problem.isolated_share()
