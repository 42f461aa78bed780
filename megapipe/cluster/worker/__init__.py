"""A host's side of the cluster: the worker agent, a job's process tree and its CPU throttle."""
