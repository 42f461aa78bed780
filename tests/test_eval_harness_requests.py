"""How the lm-evaluation-harness adapter turns texts into commands (``eval_harness.Requests``), with the
commands answered by a stand-in that records them: contexts and continuations split as lm_eval's
Hugging Face model splits them, an empty context read as end-of-text, inputs cut to the model's
positions, rolling windows that score every token once, batches answered in the given order, and
generations cut at their stop strings."""

from types import SimpleNamespace

import pytest

from megapipe.data.tokenizer.byte_level import ByteLevelTokenizer
from megapipe.errors import ConfigError
from megapipe.inference import eval_harness
from megapipe.inference.loading import LoadedModel

pytestmark = pytest.mark.unit

POSITIONS = 8
EOD = 256


class Recorder:
    """Answers commands as the model would in shape: a score of minus the continuation's length (so a
    text's rolling score counts its tokens), and ``reply`` as every generation's new tokens."""

    def __init__(self, reply: str = ""):
        self.commands, self.reply = [], reply

    def __call__(self, loaded, command):
        self.commands.append(command)
        if command[0] == "score":
            return [(-float(len(x)), len(c) % 2 == 0) for c, x in command[1]]
        return [list(self.reply.encode()) for _ in command[1]], False


@pytest.fixture
def requests(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(eval_harness, "lead", recorder)
    loaded = LoadedModel([], None, SimpleNamespace(max_position_embeddings=POSITIONS), ByteLevelTokenizer())
    return eval_harness.Requests(loaded, batch_size=2), recorder


def test_pairs_split_as_lm_eval_and_an_empty_context_is_end_of_text(requests):
    r, _ = requests
    assert r.pair("ab ", "c") == (list(b"ab"), list(b" c"))  # a context's last spaces go to the continuation
    assert r.pair("", "xy") == ([EOD], list(b"xy"))
    assert r.pair("  ", "xy") == ([EOD], list(b"  xy"))
    assert r.fit(list(b"0123456789"), list(b"ab")) == (list(b"456789"), list(b"ab"))
    assert r.fit([1], list(b"0123456789")) == ([list(b"0123456789")[2]], list(b"3456789"))


def test_scores_come_back_in_order_in_batches(requests):
    r, recorder = requests
    texts = [("a", "b" * k) for k in (1, 3, 2, 5, 4)]
    assert r.loglikelihood(texts) == [(-float(k), False) for k in (1, 3, 2, 5, 4)]
    assert [len(c[1]) for c in recorder.commands] == [2, 2, 1]  # batches of 2, longest first
    assert [len(x) for _, x in recorder.commands[0][1]] == [5, 4]


@pytest.mark.parametrize("length", [1, POSITIONS - 1, POSITIONS, 3 * POSITIONS + 2])
def test_rolling_windows_fill_the_model_and_score_every_token_once(requests, length):
    r, recorder = requests
    assert r.loglikelihood_rolling(["x" * length, "yy"]) == [-float(length), -2.0]
    pairs = [p for command in recorder.commands for p in command[1]]
    assert all(c and len(c) + len(x) <= POSITIONS for c, x in pairs)
    assert sum(c == [EOD] for c, _ in pairs) == 2  # each text's first window follows end-of-text


def test_generations_are_cut_at_stop_strings_and_prompts_fit(requests):
    r, recorder = requests
    recorder.reply = "ab.cd"
    args = {"until": ["."], "max_gen_toks": 5}
    assert r.generate_until([("0123456789", args), ("", args), ("z", {"until": "b", "max_gen_toks": 2})]) == \
        ["ab", "ab", "a"]
    (_, prompts, params), (_, other, other_params) = recorder.commands
    assert prompts == [list(b"789"), [EOD]] and params.max_new_tokens == 5 and params.greedy
    assert params.stop_tokens == (EOD,) and other == [list(b"z")] and other_params.max_new_tokens == 2


def test_too_many_new_tokens_is_one_sentence(requests):
    r, _ = requests
    with pytest.raises(ConfigError, match="set the task's max_gen_toks lower"):
        r.generate_until([("a", {"max_gen_toks": POSITIONS})])
