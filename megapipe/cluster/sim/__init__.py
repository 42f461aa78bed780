"""Gavel under a simulated clock: traces, the event-driven simulator, its metrics and pictures."""
