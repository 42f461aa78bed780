"""Gavel: heterogeneity-aware cluster scheduling (seed 002, chapters 5 and 6).

A policy maps (throughput matrix, jobs, cluster) to an allocation matrix X; the round-based
mechanism turns X into per-round placements; the simulator drives the mechanism with a simulated
clock and throughput-derived progress, and the scheduler service (``service.py``, ``tools/cluster.py
serve``) drives the same mechanism with the wall clock and the progress its jobs report, running them
through worker agents or Slurm.
"""
