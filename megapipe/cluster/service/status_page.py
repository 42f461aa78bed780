"""The scheduler's status page: one self-refreshing HTML page, no scripts, no external files.

Jobs with their state (coloured: queued grey, running blue, done green, failed red; a queued job
that no worker type can hold says why), iterations
out of the target as a bar, allocation, measured throughput and JCT (so far, for unfinished
jobs); the workers by type; the current round's placements; the average JCT of the finished
jobs.
"""

from __future__ import annotations

from html import escape

from megapipe.cluster.core.cluster_spec import devices_text

STATE_COLOURS = {"queued": "#9e9e9e", "running": "#1565c0", "done": "#2e7d32", "failed": "#c62828",
                 "cancelled": "#6d4c41"}


def _allocation(slots) -> str:
    return ", ".join(f"{host}: {n} {worker_type}" for host, worker_type, n in slots) if slots else "-"


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _job_row(job: dict) -> str:
    fraction = min(1.0, job["iterations"] / max(job["target_iters"], 1))
    rates = ", ".join(f"{t}: {r:.2f} it/s" for t, r in sorted(job["throughput"].items())) or "-"
    error = f'<div class="error">{escape(job["error"])}</div>' if job["error"] else ""
    if job["waiting"]:
        error += f'<div class="waiting">cannot be placed: {escape(job["waiting"])}</div>'
    return (f'<tr id="job-{job["id"]}"><td>{job["id"]}</td><td>{escape(job["name"])}</td>'
            f'<td><span class="state" style="background:{STATE_COLOURS.get(job["state"], "#000")}">'
            f'{job["state"]}</span>{error}</td>'
            f'<td><div class="bar"><div style="width:{100 * fraction:.0f}%"></div></div>'
            f'{job["iterations"]} / {job["target_iters"]}</td>'
            f'<td>{escape(_allocation(job["allocation"]))}</td><td>{rates}</td>'
            f'<td>{_jct(job)}</td><td>{escape(job["log"])}</td></tr>')


def _jct(job: dict) -> str:
    """The JCT of a finished job; of another, the time since it was submitted."""
    if job["state"] == "done":
        return _seconds(job["jct"])
    if job["state"] in ("queued", "running"):
        return f'{job["elapsed"]:.1f} s so far'
    return "-"


def render_status_page(status: dict) -> str:
    jobs = "\n".join(_job_row(job) for job in status["jobs"]) or '<tr><td colspan="8">no jobs</td></tr>'
    types = devices_text(status["workers_by_type"]) or "none"
    workers = "\n".join(
        f'<tr><td>{escape(w["host"])}</td><td>{escape(devices_text(w["devices"]))}'
        f'</td><td>{escape(", ".join(f"{t}: {f:g} CPU" for t, f in sorted(w["throttle"].items())) or "-")}</td></tr>'
        for w in status["workers"])
    round_ = status["round"]
    placements = "\n".join(f"<li>job {j}: {escape(_allocation(slots))}</li>"
                           for j, slots in sorted(round_["placements"].items(), key=lambda kv: int(kv[0])))
    average = status["average_jct"]
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="2"><title>megapipe cluster</title>
<style>
body {{ font-family: sans-serif; margin: 1em; background: #fff; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: left; }}
.state {{ color: #fff; padding: 2px 8px; border-radius: 4px; }}
.bar {{ width: 120px; height: 10px; background: #eee; display: inline-block; margin-right: 6px; }}
.bar div {{ height: 10px; background: #1565c0; }}
.error {{ color: #c62828; font-size: smaller; }}
.waiting {{ color: #e65100; font-size: smaller; max-width: 40em; }}
</style></head><body>
<h1>megapipe cluster</h1>
<p id="summary">policy {escape(round_["policy"])}; round {round_["number"]} ({round_["seconds"]:g} s, ends in
{round_["ends_in"]:.1f} s; lease renewals {"on" if round_["renew_leases"] else "off"}); workers: {types};
average JCT of finished jobs: <b id="average-jct">{_seconds(average)}</b></p>
<h2>Jobs</h2>
<table id="jobs"><tr><th>id</th><th>name</th><th>state</th><th>iterations</th><th>allocation</th>
<th>throughput</th><th>JCT</th><th>log</th></tr>
{jobs}
</table>
<h2>Workers</h2>
<table id="workers"><tr><th>host</th><th>devices</th><th>CPU quota per device</th></tr>
{workers}
</table>
<h2>This round's placements</h2>
<ul id="placements">{placements or "<li>none</li>"}</ul>
</body></html>
"""
