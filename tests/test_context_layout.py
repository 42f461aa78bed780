"""Context parallelism in the rank layout: groups, Megatron's order and the flags' sentences.

The expected groups are built independently of ``RankLayout``: every rank of every small world
is given its coordinates by enumerating (p, d, c, t) in nested-loop order, tensor innermost
(Megatron's tp-cp-dp-pp), and ranks are grouped by the coordinates that must be equal.
"""

import itertools
import pathlib
import re

import pytest

from launch_helpers import REPO
from megapipe.cli.parse import parse_config
from megapipe.errors import ConfigError
from megapipe.layout.ranks import RankLayout

pytestmark = pytest.mark.unit

WORLDS = (1, 2, 4, 6, 8, 12, 16)


def factorizations(world: int):
    """Every (t, c, p, d) whose product is ``world``."""
    return [(t, c, p, world // (t * c * p)) for t, c, p in itertools.product(range(1, world + 1), repeat=3)
            if world % (t * c * p) == 0]


def coordinates(t: int, c: int, p: int, d: int) -> dict[int, tuple[int, int, int, int]]:
    """rank -> (t index, c index, d index, p index), by enumeration: no formula."""
    return {rank: (ti, ci, di, pi) for rank, (pi, di, ci, ti) in
            enumerate(itertools.product(range(p), range(d), range(c), range(t)))}


def grouped(coords: dict, same) -> list[list[int]]:
    """Ranks with equal ``same(coords)``, each group in ascending rank order."""
    groups: dict = {}
    for rank, where in sorted(coords.items()):
        groups.setdefault(same(*where), []).append(rank)
    return sorted(groups.values())


def is_partition(groups: list[list[int]], world: int) -> bool:
    return sorted(r for g in groups for r in g) == list(range(world))


@pytest.mark.parametrize("world", WORLDS)
def test_every_group_kind_partitions_the_world_in_megatrons_order(world):
    for t, c, p, d in factorizations(world):
        layout = RankLayout.for_world(world, t, p, context=c)
        assert (layout.data, layout.world_size, layout.degrees().context) == (d, world, c)
        coords = coordinates(t, c, p, d)
        for rank, (ti, ci, di, pi) in coords.items():
            assert layout.rank(ti, di, pi, ci) == rank == ti + t * (ci + c * (di + d * pi))
            assert tuple(layout.coords(rank)) == (ti, di, pi, ci) and layout.coords(rank).context == ci
        expected = {
            "tensor": grouped(coords, lambda ti, ci, di, pi: (ci, di, pi)),
            "context": grouped(coords, lambda ti, ci, di, pi: (ti, di, pi)),
            "data": grouped(coords, lambda ti, ci, di, pi: (ti, ci, pi)),
            "data_context": grouped(coords, lambda ti, ci, di, pi: (ti, pi)),
            "pipeline": grouped(coords, lambda ti, ci, di, pi: (ti, ci, di)),
            "model_parallel": grouped(coords, lambda ti, ci, di, pi: (ci, di)),
        }
        for name, groups in expected.items():
            built = getattr(layout, f"{name}_groups")()
            assert is_partition(built, world), (t, c, p, d, name)
            assert sorted(built) == groups, (t, c, p, d, name)
        for group in layout.context_groups():  # in context-index order
            assert [layout.coords(r).context for r in group] == list(range(c))
        for group in layout.data_context_groups():  # the union of the data groups of its context indices
            parts = [g for g in layout.data_groups() if g[0] in group]
            assert len(parts) == c and sorted(r for g in parts for r in g) == group
        assert layout.loss_rank() == layout.rank(0, 0, p - 1) and layout.coords(layout.loss_rank()).context == 0
        assert layout.context_a2a_groups() == layout.context_ring_groups() == []


@pytest.mark.parametrize("world", (4, 8, 12, 16))
def test_a2a_and_ring_subgroups_cut_every_context_group(world):
    for t, c, p, d in factorizations(world):
        for a2a in (a for a in range(1, c + 1) if c % a == 0):
            layout = RankLayout.for_world(world, t, p, context=c, hierarchical=(a2a, c // a2a))
            inner, ring = layout.context_a2a_groups(), layout.context_ring_groups()
            assert is_partition(inner, world) and is_partition(ring, world)
            for group in layout.context_groups():
                index = {rank: k for k, rank in enumerate(group)}
                mine = [g for g in inner if g[0] in index]  # runs of a2a consecutive context indices
                assert [[index[r] for r in g] for g in mine] == [list(range(b * a2a, (b + 1) * a2a))
                                                                 for b in range(c // a2a)]
                across = [g for g in ring if g[0] in index]  # one position of every run
                assert [[index[r] for r in g] for g in across] == [list(range(k, c, a2a)) for k in range(a2a)]


@pytest.mark.parametrize("world", (4, 8, 16))
def test_the_experts_fold_over_tensor_context_and_data_ranks(world):
    for t, c, p, d in factorizations(world):
        for e in (e for e in (1, 2, 4) if (c * d) % e == 0):
            layout = RankLayout.for_world(world, t, p, context=c, expert=e)
            stage = t * c * d
            for name in ("expert", "expert_tensor", "expert_data"):
                groups = getattr(layout, f"{name}_groups")()
                assert is_partition(groups, world)
                assert all(len({r // stage for r in g}) == 1 for g in groups)  # inside one stage
            if e == 1:  # every replica and context rank holds every expert: the dense gradient group
                assert sorted(layout.expert_data_groups()) == sorted(layout.data_context_groups())


def test_one_context_rank_changes_nothing():
    for world in WORLDS:
        for t, c, p, d in factorizations(world):
            if c == 1:
                layout = RankLayout.for_world(world, t, p)
                assert layout == RankLayout(t, p, d)
                assert layout.data_context_groups() == layout.data_groups()
                assert layout.context_groups() == [[r] for r in range(world)]


def error(argv, world=4) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config("gpt", argv, world_size=world)
    return str(caught.value)


NO_DROPOUT = ["--attention-dropout", "0"]


def test_each_bad_combination_is_one_sentence_naming_its_flags():
    sentences = {
        "--hierarchical-context-parallel-sizes applies only to --cp-comm-type a2a+p2p, not p2p; drop the sizes or "
        "use a2a+p2p.": ["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2"],
        "--hierarchical-context-parallel-sizes 2 1 must be two sizes, the all-to-all's and the ring's, whose product "
        "is --context-parallel-size 4.": ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                          "--hierarchical-context-parallel-sizes", "2", "1"],
        "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A R (the all-to-all size and the ring "
        "size, A x R = --context-parallel-size 4); add it.": ["--context-parallel-size", "4", "--cp-comm-type",
                                                              "a2a+p2p"],
        "--cp-comm-type a2a splits the attention heads over --context-parallel-size (4) ranks, but "
        "--num-attention-heads gives 6 per tensor-parallel rank, not divisible by 4; choose --num-attention-heads "
        "divisible by 4 x --tensor-model-parallel-size, or --cp-comm-type p2p.": [
            "--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "6",
            "--hidden-size", "48"],
        "--cp-comm-type a2a splits the attention heads over --context-parallel-size (4) ranks, but "
        "--num-query-groups gives 2 per tensor-parallel rank, not divisible by 4; choose --num-query-groups "
        "divisible by 4 x --tensor-model-parallel-size, or --cp-comm-type p2p.": [
            "--context-parallel-size", "4", "--cp-comm-type", "a2a", "--group-query-attention",
            "--num-query-groups", "2"],
        "world size 4 is not divisible by --tensor-model-parallel-size 1 x --context-parallel-size 3 x "
        "--pipeline-model-parallel-size 1; launch a multiple of 3 processes.": [
            "--context-parallel-size", "3", "--seq-length", "6"],
        "--attention-dropout 0.1 is not supported with --context-parallel-size 2 (each rank would draw its own "
        "dropout mask for its blocks of scores, so the model would depend on c); add --attention-dropout 0, as the "
        "documentation's context-parallel commands do.": ["--context-parallel-size", "2",
                                                          "--attention-dropout", "0.1"],
        "--seq-length 20 is not divisible by 2 x --context-parallel-size 4 (= 8): context parallelism splits each "
        "sequence into 2c equal chunks; choose a sequence length that is a multiple of 8.": [
            "--context-parallel-size", "4", "--seq-length", "20"],
    }
    for sentence, argv in sentences.items():
        assert error(NO_DROPOUT + argv if "--attention-dropout" not in argv else argv) == sentence
    assert error(NO_DROPOUT + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "4", "--seq-length",
                               "12", "--sequence-parallel"], world=8) == (
        "--seq-length 12 / --context-parallel-size 2 is not divisible by --tensor-model-parallel-size 4, which "
        "--sequence-parallel needs; choose a multiple of 16.")


def test_context_flags_parse_into_the_config():
    config = parse_config("gpt", NO_DROPOUT + ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                               "--hierarchical-context-parallel-sizes", "2", "2"], world_size=8)
    par = config.parallel
    assert (par.context_parallel_size, par.cp_comm_type, par.hierarchical_context_parallel_sizes) == (4, "a2a+p2p",
                                                                                                     (2, 2))
    assert parse_config("gpt", [], world_size=1).parallel.context_parallel_size == 1


@pytest.mark.unit
def test_every_documented_context_parallel_command_sets_no_attention_dropout_and_the_docs_say_why():
    """The default attention dropout is refused with c > 1, so a user copying any documented command
    must find --attention-dropout 0 in it, and the page must explain the refusal before its first one."""
    from docs_example_helpers import shell_blocks

    commands = 0
    for page in sorted(pathlib.Path(REPO, "docs").glob("*.md")) + [pathlib.Path(REPO, "README.md")]:
        text = page.read_text()
        for fence in shell_blocks(text):
            block = "\n".join(fence.body)
            if re.search(r"--context-parallel-size [2-9]", block) and "pretrain_" in block:
                commands += 1
                assert "--attention-dropout 0" in block, (page.name, fence.line)
                before = "\n".join(text.splitlines()[:fence.line])
                assert "needs `--attention-dropout 0`" in before.replace("\n", " "), (page.name, fence.line)
    assert commands >= 1
