"""The scheduler service end to end: real agents, real megapipe jobs, faults, bad input, the status page.

One cluster for the module: the scheduler (heterogeneity-aware LAS, 12 s rounds, lease renewals
on) and two hosts (network namespaces, ``testing/hosts.py``; skipped where they cannot be made),
each an agent with one fast and one slow CPU device (slow: half a CPU) running its jobs' ranks
inside its host.
Three small GPT jobs run to their targets while the status page is checked in headless
Chromium, an agent is killed mid-round (its one-device job resumes on the other host from its
checkpoint; the agent comes back later) and the scheduler is killed and restarted on its
journal. Then every job's per-iteration losses are compared with the same job trained alone,
uninterrupted, as submitted: bit for bit (as printed, 7 digits) while it ran in the submitted
layout, preemptions included, and within 1e-5 relative everywhere, which is what resharding
into another (t, p, d) keeps (the same sums in another order; dropout is off because random
states cannot follow a change of layout). The job submitted with tensor size 2 is re-planned
data-parallel by the scheduler, so its whole run is a re-layout of the submission.

The jobs' logs must never show two runs of a job at once. Bad input is one sentence each and
the service keeps running.
"""
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from launch_helpers import forked_run
from megapipe.cluster.service.job_log import continuity, iteration_layouts, iteration_losses, layout_key, leases, overlapping_runs, run_alone
from megapipe.lease.client import post_json
from megapipe.cluster.service.local_cluster import TOOL, LocalCluster, free_port
from megapipe.testing.hosts import NamespacesUnavailable, TestHosts

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "4", "--global-batch-size", "16", "--mock-data", "--vocab-size", "256",
         "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1", "--hidden-dropout", "0",
         "--attention-dropout", "0"]
JOBS = {"short": MODEL + ["--train-iters", "200"],
        "wide": MODEL + ["--train-iters", "100", "--tensor-model-parallel-size", "2"],  # its reference, as submitted,
        # is tensor-parallel over gloo: about five times the CPU of an iteration of the data-parallel re-layout
        "long": MODEL + ["--train-iters", "400", "--seed", "7"]}
LATE = MODEL + ["--train-iters", "600", "--seed", "9"]  # submitted later, so that a job runs when the scheduler dies
RELATIVE = 1e-5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        hosts = TestHosts(2)
    except NamespacesUnavailable as reason:
        pytest.skip(f"no test hosts: {reason}")
    cluster = LocalCluster(str(tmp_path_factory.mktemp("cluster")), "max_min_fairness_perf", 12,
                           {"host-a": "fast:1,slow:1", "host-b": "fast:1,slow:1"}, test_hosts=hosts)
    try:
        yield cluster.start()
    finally:
        cluster.close()
        hosts.close()


def test_bad_input_is_one_sentence_and_the_service_keeps_running(cluster):
    refused = cluster.submit("odd", ["pretrain_gpt.py", "--num-layers", "3", "--pipeline-model-parallel-size", "2"])
    assert refused["error"] == ("--num-layers 3 is not divisible by --pipeline-model-parallel-size 2; every stage "
                                "must hold the same number of layers.")
    unknown = subprocess.run([sys.executable, TOOL, "worker", "--scheduler", cluster.address, "--secret-file",
                              cluster.secret_file, "--devices", "tpu:1", "--host", "host-z"], capture_output=True,
                             text=True, timeout=120, env=cluster.env)
    assert unknown.returncode == 2
    assert unknown.stderr.strip() == ("error: worker host-z declares accelerator type 'tpu', which this scheduler "
                                      "does not know; declare one of fast, slow (or start serve with --worker-types "
                                      "listing it).")
    stranger = post_json(f"http://{cluster.address}/leases/99/1", {"iteration": 3, "renew": True}, timeout=30,
                         key=cluster.key)
    assert stranger == {"error": "job 99 is not known to this scheduler; run jobs through tools/cluster.py submit."}
    missing = f"{cluster.files}/no-corpus"  # inside the paths jobs may name, but not there
    broken = cluster.submit("broken", ["pretrain_gpt.py", "--data-path", missing, "--train-iters", "5"])
    cluster.wait_for(lambda: cluster.job(broken["id"])["state"] == "failed", 180, "the broken job to fail")
    failed = cluster.job(broken["id"])
    assert missing in failed["error"] and failed["allocation"] is None
    assert len(cluster.status()["workers"]) == 2 and cluster.scheduler.poll() is None


def _running_on(cluster, host, scale=None):
    """Jobs making progress with devices on ``host`` (of ``scale`` devices, if given)."""
    return [j for j in cluster.status()["jobs"] if j["state"] == "running" and j["iterations"] > 0 and
            any(slot[0] == host for slot in j["allocation"] or []) and scale in (None, j["devices"])]


def _finished(job: dict) -> bool:
    assert job["state"] != "failed", f"job {job['name']} failed: {job['error']}"
    return job["state"] == "done"


@pytest.fixture(scope="module")
def trace(cluster):
    return {name: cluster.submit(name, ["pretrain_gpt.py"] + flags)["id"] for name, flags in JOBS.items()}


def test_a_lost_agents_job_resumes_on_the_other_host(cluster, trace):
    early = lambda: [j for j in _running_on(cluster, "host-a", scale=1) if j["iterations"] < j["target_iters"] // 3]
    cluster.wait_for(early, 240, "a one-device job early on host-a")
    victim = early()[0]["id"]
    cluster.kill(cluster.agents["host-a"])  # the host's agent dies mid-round

    def resumed() -> bool:
        job = cluster.job(victim)
        return job["state"] == "done" or (job["state"] == "running" and job["iterations"] > 0 and
                                          all(s[0] == "host-b" for s in job["allocation"]))

    cluster.wait_for(resumed, 240, "the lost host's job to resume on host-b")
    assert "host-b" in leases(open(cluster.job(victim)["log"]).read())[-1][1]
    cluster.start_agent("host-a")


@pytest.fixture(scope="module")
def late(cluster, trace):
    return cluster.submit("late", ["pretrain_gpt.py"] + LATE)["id"]


def test_status_page_shows_the_running_trace(cluster, trace, late, tmp_path):
    cluster.wait_for(lambda: len(cluster.status()["workers"]) == 2 and cluster.job(late)["iterations"] > 0, 240,
                     "both hosts back and the late job making progress")
    deadline = time.monotonic() + 240
    while True:  # between a round's stops and relaunches no job may be running: render again until one is
        dom, picture = render_in_chromium(cluster.page_url(), tmp_path)
        if ">running</span>" in dom or time.monotonic() > deadline:
            break
    for name in list(trace) + ["late"]:
        assert f"<td>{name}</td>" in dom
    assert ">running</span>" in dom and ">failed</span>" in dom  # the broken job of the bad-input test
    assert "2 fast, 2 slow" in dom and "host-a" in dom and "job " in dom.split('id="placements"')[1]
    colours = {tuple(int(round(255 * c)) for c in pixel[:3]) for pixel in picture.reshape(-1, picture.shape[-1])}
    assert (0x15, 0x65, 0xc0) in colours, "no running-state badge (blue) in the screenshot"
    assert (0xc6, 0x28, 0x28) in colours, "no failed-state badge (red) in the screenshot"


def render_in_chromium(url: str, directory) -> tuple:
    """The page's DOM and a screenshot (as an RGB(A) array), from one run of headless Chromium."""
    import matplotlib.image

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Chromium is not installed; the status page test needs a real browser (apt-get install chromium, "
                    "as .ci/run does).")
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={directory / 'profile'}"]
    shot = directory / "status.png"
    dom = subprocess.run(flags + ["--window-size=1400,900", f"--screenshot={shot}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return dom, matplotlib.image.imread(str(shot))


def test_trace_survives_a_restarted_scheduler_and_keeps_its_losses(cluster, trace, late, tmp_path):
    cluster.wait_for(lambda: cluster.job(late)["state"] == "running" and cluster.job(late)["iterations"] > 0, 240,
                     "the late job running")
    cluster.kill(cluster.scheduler)  # the scheduler dies mid-round ...
    cluster.start_scheduler()  # ... and comes back on its journal
    trace = dict(trace, late=late)
    assert all(cluster.job(i)["state"] in ("queued", "running", "done") for i in trace.values())
    cluster.wait_for(lambda: all(_finished(cluster.job(i)) for i in trace.values()), 600, "every job to finish")

    submitted = {name: ["pretrain_gpt.py"] + flags for name, flags in dict(JOBS, late=LATE).items()}
    jobs = {name: cluster.job(job_id) for name, job_id in trace.items()}
    with ThreadPoolExecutor(len(jobs)) as pool:  # each job trained alone, uninterrupted, as submitted
        references = dict(zip(jobs, pool.map(
            lambda name: iteration_losses(run_alone(submitted[name], jobs[name]["devices"], str(tmp_path / name),
                                                    free_port(), run=forked_run)), jobs)))
    for name, job in jobs.items():
        log = open(job["log"]).read()
        assert job["iterations"] == job["target_iters"]
        assert overlapping_runs(log) == [], f"job {name} ran twice at once"
        found = continuity(log, references[name], submitted[name], job["devices"])
        assert found["complete"] and found["bit_exact_before"] and found["max_relative"] <= RELATIVE, (name, found)
        if job["devices"] == 1:  # one device has one layout: bit for bit across every preemption
            assert found["exact_until"] == job["target_iters"] + 1, (name, found)
    assert len(leases(open(jobs["late"]["log"]).read())) > 1, "the restarted scheduler did not re-place the late job"
    wide_layouts = set(iteration_layouts(open(jobs["wide"]["log"]).read()).values())
    assert layout_key(submitted["wide"], 2) not in wide_layouts, "the wide job was never re-laid-out"
