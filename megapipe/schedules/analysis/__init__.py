"""What a schedule costs: the discrete-event simulator, timelines (simulated or recorded) and
their pictures."""
