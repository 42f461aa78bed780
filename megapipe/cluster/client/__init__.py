"""What a training job holds of the cluster: its lease (progress reports, the order to stop)."""
