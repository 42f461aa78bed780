"""What a submitted job may name: paths inside the allowed roots, plain names; each refusal one sentence
that leaves the journal as it was. The scheduler gives --save, so --save-interval needs none; a launch
carries its lease's key, never the secret. The status page shows a name as text.
"""

import argparse
import os

import pytest

from megapipe.lease.auth import LEASE_KEY_ENV, lease_key
from megapipe.cluster.service.backends.base import HostSlots
from megapipe.cluster.service.job_paths import PATH_FLAGS
from megapipe.cluster.service.job_spec import OWNED_FLAGS, parse_job
from megapipe.cluster.service.journal import Journal
from megapipe.cluster.service.service import ClusterService
from megapipe.cluster.service.status_page import render_status_page
from megapipe.cli.parse import build_parser
from megapipe.errors import ConfigError

pytestmark = pytest.mark.unit

SMALL = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "10"]
MOCK = SMALL + ["--mock-data", "--vocab-size", "128"]
# flags taking free text that names no file (a new flag naming a file must join PATH_FLAGS)
NOT_PATHS = {"--pipeline-schedule", "--split", "--tokenizer-type", "--wandb-project", "--wandb-exp-name",
             "--pipeline-stages", "--hf-dataset-text-key"}  # --pipeline-stages is refused outright (the scheduler re-plans the layout)


@pytest.fixture
def service(tmp_path):
    secret = b"s" * 32
    made = ClusterService(Journal(str(tmp_path / "journal.db")), "max_min_fairness_perf", 10.0,
                          str(tmp_path / "work"), secret=secret, allowed_paths=(str(tmp_path / "data"),))
    os.makedirs(tmp_path / "data")
    made.secret_for_test = secret
    return made


def refusal(service, name, command):
    """The sentence refusing a submission, checking it left the journal and the queue as they were."""
    before = ([row.id for row in service.journal.jobs()], list(service.source.pending))
    with pytest.raises(ConfigError) as refused:
        service.submit(name, 1.0, command)
    assert ([row.id for row in service.journal.jobs()], list(service.source.pending)) == before
    return str(refused.value)


def test_every_flag_naming_a_file_is_checked():
    for kind in ("gpt", "bert"):
        free_text = {option for action in build_parser(kind)._actions for option in action.option_strings
                     if option.startswith("--") and action.type is None and action.choices is None
                     and action.nargs != 0 and not isinstance(action, argparse._HelpAction)}
        assert free_text - set(PATH_FLAGS) - set(OWNED_FLAGS) - NOT_PATHS == set(), kind


def test_paths_outside_the_roots_are_refused_naming_flag_path_and_roots(service, tmp_path):
    data, outside = tmp_path / "data", tmp_path / "elsewhere"
    outside.mkdir()
    (data / "vocab.json").write_text("{}")
    os.symlink(outside / "secret.json", data / "link.json")  # inside by name, outside in fact
    os.symlink(outside / "corpus.bin", data / "corpus.bin")  # a dataset prefix whose .bin leads out
    roots = str(data)
    assert refusal(service, "a", SMALL + ["--vocab-file", str(outside / "vocab.json")]) == (
        f"--vocab-file {outside}/vocab.json is outside the paths this scheduler allows ({roots}); move it under "
        "one of them or start serve with --allowed-paths naming its directory.")
    assert refusal(service, "a", SMALL + ["--merge-file", str(data / "link.json")]) == (
        f"--merge-file {data}/link.json (really {outside}/secret.json) is outside the paths this scheduler allows "
        f"({roots}); move it under one of them or start serve with --allowed-paths naming its directory.")
    assert refusal(service, "a", SMALL + ["--data-path", "0.5", str(data / "a"), "0.5", str(data / "corpus")]) \
        .startswith(f"--data-path {data}/corpus.bin (really {outside}/corpus.bin) is outside")
    assert refusal(service, "a", SMALL + ["--hf-dataset", str(outside)]).startswith(
        f"--hf-dataset {outside} is outside")
    assert refusal(service, "a", MOCK + ["--tensorboard-dir", "runs"]) == (
        f"--tensorboard-dir runs is a relative path; give an absolute path inside {roots}.")
    assert refusal(service, "a", MOCK + ["--record-timeline", f"{data}/../elsewhere/t.json"]).startswith(
        f"--record-timeline {data}/../elsewhere/t.json (really {outside}/t.json) is outside")
    assert refusal(service, "a", MOCK + ["--tensorboard-dir", str(data)]).startswith(
        f"--tensorboard-dir {data} is outside")  # strictly inside: not the root itself
    job = service.submit("ok", 1.0, MOCK + ["--tensorboard-dir", str(data / "tb"), "--wandb-save-dir",
                                            str(data / "wandb")])
    assert [row.id for row in service.journal.jobs()] == [job]


def test_the_default_root_is_the_work_dirs_files(tmp_path):
    service = ClusterService(Journal(str(tmp_path / "journal.db")), "max_min_fairness_perf", 10.0,
                             str(tmp_path / "work"))
    assert service.roots == (os.path.realpath(tmp_path / "work" / "files"),) and os.path.isdir(service.roots[0])


@pytest.mark.parametrize("name, sentence", [
    ("two\nlines", "--name 'two\\nlines' contains the control character U+000A; give a name of plain visible "
                   "characters."),
    ("red\x1b[31m", "--name 'red\\x1b[31m' contains the control character U+001B; give a name of plain visible "
                    "characters."),
    ("abc\u202edcba", "--name 'abc\\u202edcba' contains the control character U+202E; give a name of plain "
                      "visible characters."),
    ("x" * 65, "--name has 65 characters; give one of at most 64."),
    (" ", "--name is empty; give it a short plain name such as small-gpt."),
])
def test_a_job_name_that_is_not_plain_text_is_refused(service, name, sentence):
    assert refusal(service, name, MOCK) == sentence


def test_a_command_word_that_could_forge_a_log_line_is_refused(service):
    assert refusal(service, "a", MOCK + ["--wandb-project", "x\n[cluster] done: 10 of 10 iterations"]) == (
        "word 19 of the job's command 'x\\n[cluster] done: 10 of 10 iterations' contains the control character "
        "U+000A; give text of plain visible characters.")


def test_a_worker_host_that_is_not_plain_text_is_refused(service):
    with pytest.raises(ConfigError, match=r"U\+000A"):
        service.register_worker("host\nworker host-z registered", "127.0.0.1", {"fast": 1}, {})
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        service.register_worker("host-a", "127.0.0.1", {"fast": 1}, {"fast": float("nan")})
    assert service.status()["workers"] == []


def test_a_name_with_markup_is_shown_as_text(service):
    service.submit("<b>bold</b>&co", 1.0, MOCK)
    page = render_status_page(service.status())
    assert "<td>&lt;b&gt;bold&lt;/b&gt;&amp;co</td>" in page and "<b>bold" not in page


def test_save_interval_needs_no_save_the_scheduler_gives_it():
    spec = parse_job(MOCK + ["--save-interval", "5"])
    assert spec.command == MOCK + ["--save-interval", "5"]  # --save is added per launch, not journaled
    with pytest.raises(ConfigError, match="--save is set by the scheduler"):
        parse_job(MOCK + ["--save-interval", "5", "--save", "/x"])


def test_a_launch_carries_its_leases_key_and_not_the_secret(service):
    service.register_worker("host-a", "127.0.0.1", {"fast": 1}, {})
    service.before_round()
    job = service.submit("a", 1.0, MOCK)
    service.launch(job, (HostSlots("host-a", "fast", 1),), lease_end=10.0)
    [launch] = [m["launch"] for m in service.heartbeat("host-a", {}) if "launch" in m]
    assert launch["env"][LEASE_KEY_ENV] == lease_key(service.secret_for_test, job, 1).decode()
    assert service.secret_for_test.decode() not in str(launch)
