"""What runs a schedule for real: the executor, the point-to-point transports, weight version
stores, the per-rank engine and the in-flight state of asynchronous pipelines."""
