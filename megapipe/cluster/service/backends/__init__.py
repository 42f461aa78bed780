"""Backends that start and stop the ranks of a job's allocation: local worker agents, Slurm."""
