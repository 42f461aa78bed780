"""Gavel as a service: submitted jobs, the durable journal, HTTP transport, the status page, rounds in
real time, re-planning per allocation and the backends that start a job's ranks."""
