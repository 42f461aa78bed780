"""Lease-aware training (``--cluster-lease``): renew before expiry, else save at the lease end and exit.

The training side alone, against a lease endpoint scripted by the test (the scheduler service's
side is covered end to end in test_cluster_service.py): short leases of 0.5 s that are renewed
until the job reaches a given iteration, then answered ``stop``. One job is trained in three
allocations: (t, p, d) = (2, 1, 1) until its first lease ends, the same layout again until the
second ends, then (1, 1, 2), resuming each time from the checkpoint the previous run saved when
its lease ended (resharded on load for the last one). Reference: the same job in (2, 1, 1),
uninterrupted. Iterations of the first two runs must equal it bit for bit (as printed, 7
digits): same layout, so the state restored from the checkpoint is the whole state. The last
run's must be within 1e-5 relative: another layout sums the same numbers in another order
(tensor-parallel matmul halves against whole matmuls, a data-parallel all-reduce of gradients),
which moves an fp32 loss of ~5.5 by ~1e-7; dropout is off since random states cannot follow a
change of layout.
"""

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from launch_helpers import forked_run
from megapipe.cluster.service.job_log import iteration_losses, run_alone
from megapipe.cluster.service.local_cluster import free_port

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]

JOB = ["pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
       "64", "--micro-batch-size", "4", "--global-batch-size", "16", "--mock-data", "--vocab-size", "256",
       "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--train-iters", "30"]
TENSOR_2 = ["--tensor-model-parallel-size", "2"]
LEASE_SECONDS = 0.5
RELATIVE = 1e-5


class ScriptedLeases:
    """Grants ``LEASE_SECONDS`` leases; lease n is answered ``stop`` once its job reports ``stop_at[n]``."""

    def __init__(self, stop_at: dict):
        self.stop_at, self.renewals, self.lock = stop_at, {}, threading.Lock()
        leases = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                report = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                lease = int(self.path.rsplit("/", 1)[1])
                with leases.lock:
                    if report.get("renew"):
                        leases.renewals[lease] = leases.renewals.get(lease, 0) + 1
                if report.get("iteration", 0) >= leases.stop_at.get(lease, float("inf")):
                    answer = {"stop": "the test's lease ended"}
                else:
                    answer = {"expires_in": LEASE_SECONDS}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def address(self, lease: int) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/leases/0/{lease}"


def run_allocations(leases: ScriptedLeases, owned: list, tmp_path) -> list[str]:
    """The job in (2, 1, 1) under leases 1 and 2, then in (1, 1, 2) under lease 3; their outputs."""
    layouts = [TENSOR_2, TENSOR_2, []]
    return [run_alone(JOB + layout + owned + ["--cluster-lease", leases.address(n)], 2, str(tmp_path), free_port(),
                      run=forked_run) for n, layout in enumerate(layouts, start=1)]


def test_lease_end_saves_and_the_next_allocation_resumes_exactly_or_resharded(tmp_path):
    leases = ScriptedLeases({1: 6, 2: 14})
    checkpoints = str(tmp_path / "checkpoints")
    owned = ["--save", checkpoints, "--load", checkpoints]
    with ThreadPoolExecutor(1) as pool:  # the reference trains beside the three allocations
        alone = pool.submit(run_alone, JOB + TENSOR_2, 2, str(tmp_path / "alone"), free_port(), run=forked_run)
        try:
            first, second, third = run_allocations(leases, owned, tmp_path)
        finally:
            leases.server.shutdown()
        reference = iteration_losses(alone.result())

    ends = [int(text.split("exiting on the end of the cluster lease at iteration ")[1].split()[0])
            for text in (first, second)]
    assert 6 <= ends[0] < ends[1] < 30 and ends[1] >= 14, ends  # nobody stopped before its lease ended
    assert leases.renewals.get(1, 0) > 0, "the first run never renewed its lease"  # it outlived several
    assert "written with (t, p, d) = (2, 1, 1)" in third and "exiting on" not in third
    same_layout = {**iteration_losses(first), **iteration_losses(second)}
    assert sorted(same_layout) == list(range(1, ends[1] + 1))
    assert all(same_layout[i] == reference[i] for i in same_layout)
    relaid = iteration_losses(third)
    assert sorted(relaid) == list(range(ends[1] + 1, 31))
    assert all(abs(float(relaid[i]) - float(reference[i])) <= RELATIVE * abs(float(reference[i])) for i in relaid)
