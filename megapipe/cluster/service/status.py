"""The service's status: jobs, workers by type, the current round's placements and JCTs.

What ``tools/cluster.py status`` prints and the status page shows: the journal's rows with what
the service knows of each job in memory (live iterations, measured rates, costs, why it waits),
taken under the service's lock and then read without it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from megapipe.cluster.service.placeable import unplaceable_reason

if TYPE_CHECKING:
    from megapipe.cluster.service.service import ClusterService

# the units of the status's figures whose names do not say them (readers of the JSON keep their keys)
STATUS_UNITS = {"jct": "seconds", "elapsed": "seconds", "average_jct": "seconds", "throughput": "iterations/s",
                "round.seconds": "seconds", "round.ends_in": "seconds"}


def service_status(service: "ClusterService") -> dict:
    """Jobs, workers by type, the current round's placements and JCTs (what ``status`` and the page show)."""
    with service.lock:
        known = {job_id: _in_memory(record) for job_id, record in service.jobs.items()}
        placements = {str(j): [[s.host, s.worker_type, s.devices] for s in hosts]
                      for j, hosts in service.placements().items()}
        round_info = {"number": service.round_start.number, "seconds": service.round_seconds,
                      "ends_in": max(0.0, service.round_start.end - service.clock.now()), "placements": placements,
                      "renew_leases": service.renew_leases, "policy": service.policy_name}
        hosts, throttles = dict(service.workers.hosts), service.workers.throttles()
        by_type = service.workers.devices_by_type()
    jobs = []
    now = time.time()
    for row in service.journal.jobs():
        iteration, rates, costs, stragglers = known.get(row.id, (None, {}, None, []))
        waiting = unplaceable_reason(row.scale_factor, by_type) if row.state == "queued" else None
        jobs.append({
            "id": row.id, "name": row.name, "state": row.state, "priority": row.priority,
            "iterations": row.iterations if iteration is None else iteration, "target_iters": row.target_iters,
            "devices": row.scale_factor, "allocation": row.allocation, "log": row.log_path,
            "jct": row.jct, "elapsed": (row.finished or now) - row.submitted, "error": row.error,
            "throughput": rates or row.throughputs,
            "overhead_seconds": row.overhead, "fixed_seconds": row.fixed, "leases": row.lease,
            "relayouts": row.relayouts, "costs": costs, "waiting": waiting, "stragglers": stragglers})
    done = [j["jct"] for j in jobs if j["state"] == "done"]
    return {"units": STATUS_UNITS, "jobs": jobs, "round": round_info,
            "average_jct": sum(done) / len(done) if done else None,
            "workers": [{"host": host, "devices": devices,
                         "throttle": {t: f for t, f in throttles.items() if t in devices and f < 1}}
                        for host, devices in sorted(hosts.items())],
            "workers_by_type": by_type}


def _in_memory(record) -> tuple:
    """A copy of what status shows of a record: its run's iteration (None when not running), rates, costs and the
    ranks its run last reported as stragglers."""
    costs = record.costs
    if costs is not None:
        costs = dict(costs, restarts=list(costs["restarts"]), stops=list(costs["stops"]))
    run = record.run
    return (None if run is None else run.iteration), dict(record.rates), costs, ([] if run is None else
                                                                                  list(run.stragglers))
