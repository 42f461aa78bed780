"""Backends that start and stop the ranks of a job's allocation (the contract is in ``base.py``)."""
