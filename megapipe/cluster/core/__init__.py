"""Gavel's core, independent of any clock: the cluster and its jobs, the throughput matrix, the
allocation problem and its policies, the round-based mechanism and the scheduling loop."""
