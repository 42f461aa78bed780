"""Fault-tolerant data-parallel replicas (``--fault-tolerant-replicas``): a lost replica costs one step, not a restart.

The lighthouse (``lighthouse.py``) decides each step which replicas train (``quorum.py``); each replica's
ranks reduce their gradients with the same ranks of the other replicas over a process group made for that
quorum, and a replica that joins receives the training state from a live one (``group.py``).
"""
