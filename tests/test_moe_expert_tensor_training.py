"""Whole experts below the tensor size without expert parallelism (t = 2, ``--expert-tensor-parallel-size 1``,
e = 1) train as one process accumulating gradients does.

Each tensor rank holds every expert whole and dispatches half of the tokens, so each holds half of every
expert's gradient: the experts' gradients must be summed over the expert-data-parallel group, which spans
the t / etp shares of the tensor group and the d replicas. The harness of ``test_pipeline_training.py``
(the mixture-of-experts Llama, 3 steps of SGD with momentum, losses and every parameter within 1e-5) at
d = 2 for every sharding level and at p = 2 under 1F1B, in one world of 4 processes.
"""

import pytest

from test_context_parallel_training import LAYERS, sgd
from test_pipeline_training import assert_matches_reference, pipelined_run, reference_run
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed

LAYOUTS = [dict(p=1, d=2, sharding=level) for level in ("no_shard", "optim", "optim_grads_params")]
LAYOUTS.append(dict(p=2, d=1, sharding="no_shard"))


def check_layouts(rank, world_size):
    references = {d: reference_run("moe", d, num_layers=LAYERS) for d in (1, 2)}
    checked = []
    for case in LAYOUTS:
        what = f"t=2 etp=1 e=1 {case}"
        ps, losses, final = pipelined_run("moe", 2, case["p"], case["d"], "1f1b", 1, references[case["d"]][0],
                                          layout=dict(expert_tensor=1), optimizer=sgd(case["sharding"]),
                                          num_layers=LAYERS)
        assert (ps.ep_size, ps.etp_size, ps.expert_dp_size) == (1, 1, 2 * case["d"]), what
        assert_matches_reference(ps, losses, final, references[case["d"]], what)
        checked.append(what)
    return checked


def test_whole_experts_below_the_tensor_size_at_one_expert_rank_match_one_process():
    results = run_distributed(4, check_layouts, timeout=300)
    assert all(len(checked) == len(LAYOUTS) for checked in results)
