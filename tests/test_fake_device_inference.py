"""GPU readiness of inference checked on a CPU: generation with every way of choosing a token, the
pipelined decode at p = 2 and the text-generation server's request path, on fake accelerator
tensors (``megapipe/testing/fake_device.py``), where a host tensor or a host generator meeting a device
tensor fails as it would on a GPU, and the host's reads of the device are counted. Pipeline
messages go through a stubbed transport that records them; one on the host fails by name."""

import io
import json
import threading

import pytest
import torch

from fake_device_helpers import DEVICE_MISMATCH, V, model_config, pipeline_rank, stubbed_transport
from megapipe import fusions
from megapipe.testing.fake_device import FAKE_DEVICE, GeneratorDeviceMismatch, fake_accelerator
from megapipe.inference import SamplingParams, generate
from megapipe.data.tokenizer import build_tokenizer
from megapipe.inference.loading import LoadedModel
from megapipe.inference.sampling import apply_repetition_penalty, next_tokens
from megapipe.inference.request_queue import RequestQueue
from megapipe.inference.server import make_handler, run_next
from megapipe.inference.server_limits import ServerLimits
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.schedules.actions import parse_action
from megapipe.pipeline.p2p import StageP2P
from megapipe.pipeline.peer_messages import PeerMessages

pytestmark = pytest.mark.unit

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
NEW = 5
# Llama's pieces: RMSNorm, rotary positions, SwiGLU, grouped-query attention
LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, num_query_groups=2,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, max_position_embeddings=16)
CHOICES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "top-k": dict(top_k=5),
    "top-p": dict(top_p=0.9),
    "repetition-penalty": dict(temperature=0.0, repetition_penalty=1.3),
    "seeded-sampling": dict(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.3, seed=7),
}


def _generate(ps: ParallelState, params: SamplingParams, numbers=(), **options):
    """Generation of ``PROMPTS`` by this pipeline rank's stage of a small Llama on the fake device, the
    transport stubbed; the result, the shapes of the stage's outputs (one per forward), the times
    the host waited for the device while generating and the pipeline messages. Done flags never all read True, so a
    decode runs to the frame's end; ``numbers`` answer reads of device numbers (the headers)."""
    with fake_accelerator(booleans=False, numbers=numbers) as reads, stubbed_transport() as messages:
        fusions.select_backend("eager", FAKE_DEVICE)
        config = model_config("gpt", **LLAMA)
        ps.seed(1234, FAKE_DEVICE)
        chunks = build_model_chunks("gpt", config, ps, device=FAKE_DEVICE)
        forwards = []
        chunks[0].register_forward_hook(lambda module, args, out: forwards.append(tuple(out.shape)))
        built = reads.count  # (the weights' initial values were copied to the device)
        result = generate(chunks, ps, config, PROMPTS, params, **options)
    return result, forwards, reads.count - built, messages


# a request's waits: the frame's four tensors and the stop ids go to the device, and the answer
# (counts and tokens) comes back
PER_REQUEST = 4 + 1 + 2


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("choice", sorted(CHOICES))
def test_generation_runs_on_the_device_and_waits_for_it_per_request_only(choice, padding):
    """Prefill and decode with a KV cache, two microbatches, each way of choosing a token: all on fake
    device tensors, each row's generator on the device. Without stop tokens the host never waits
    for the device within the decode: three more tokens, the same waits."""
    waits = []
    lengths = [len(prompt) for prompt in PROMPTS]
    for new in (NEW, NEW + 3):
        params = SamplingParams(max_new_tokens=new, **CHOICES[choice])
        result, forwards, count, messages = _generate(ParallelState.single(), params, padding=padding,
                                                      microbatches=2)
        # each microbatch ran to the frame's end, from the longest prompt's end (left) or the shortest's
        assert len(forwards) == 2 * (new + (max(lengths) - min(lengths) if padding == "right" else 0))
        assert len(result) == len(PROMPTS) and messages == []
        waits.append(count)
    assert waits == [PER_REQUEST, PER_REQUEST]


def test_stop_tokens_read_the_done_flags_once_per_microbatch_step():
    """With stop tokens the first stage must learn whether a microbatch is over: one read of its
    done flags per step (after each step but the last, where the frame's end decides on the host)."""
    waits = []
    for new in (NEW, NEW + 3):
        params = SamplingParams(max_new_tokens=new, temperature=0.8, stop_tokens=(3, 4))
        _, forwards, count, _ = _generate(ParallelState.single(), params, microbatches=2)
        assert len(forwards) == 2 * new
        waits.append(count)
    assert waits == [PER_REQUEST + 2 * (NEW - 1), PER_REQUEST + 2 * (NEW + 2)]


def test_the_old_sampling_code_fails_on_the_fake_device():
    """What generation did before it kept its tensors on the device: the repetition penalty scattered
    the host's token history into the device's logits, and rows were sampled with host generators."""
    with fake_accelerator():
        logits = torch.randn(2, V, device=FAKE_DEVICE)
        history, seen = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool)
        with pytest.raises(RuntimeError, match=DEVICE_MISMATCH):
            apply_repetition_penalty(logits, history, seen, 1.3)
        on_device = history.to(FAKE_DEVICE), seen.to(FAKE_DEVICE)
        with pytest.raises(GeneratorDeviceMismatch, match="tensor on meta from a generator on cpu"):
            next_tokens(logits, *on_device, SamplingParams(temperature=0.9), [torch.Generator() for _ in range(2)])
        device_generators = [torch.Generator(device=FAKE_DEVICE) for _ in range(2)]
        assert next_tokens(logits, *on_device, SamplingParams(temperature=0.9), device_generators).device == FAKE_DEVICE


def _mirrored(messages):
    """The messages a peer must post for ``messages`` to match them one by one, in order."""
    swap = {"send": "recv", "recv": "send"}
    return [(swap[m.kind], m.shape, m.dtype) for m in messages]


def test_pipelined_decode_at_p2_each_stage_posts_what_the_other_expects():
    """Both stages of a p = 2 pipeline (two microbatches), one after the other with the transport
    stubbed: every message is on the device, and the last stage's messages mirror the first stage's
    one for one, in order. NCCL runs the messages of a pair of ranks in issue order, so any other
    order (the first stage sending its next microbatch before taking the answer the last stage sent
    first) would hang there."""
    stages = {}
    for rank in (0, 1):
        # the last stage reads the first stage's headers: microbatch j + 1 per step, round robin, then 0
        headers = [j + 1 for _ in range(NEW) for j in range(2)] + [0] if rank == 1 else []
        result, forwards, count, messages = _generate(pipeline_rank(rank, 2), SamplingParams(max_new_tokens=NEW,
                                                      temperature=0.9), numbers=headers)
        assert len(result) == len(PROMPTS) and len(forwards) == 2 * NEW
        assert all(m.device == FAKE_DEVICE and m.peer == 1 - rank for m in messages)
        stages[rank] = (messages, count)
    (first, first_waits), (last, last_waits) = stages[0], stages[1]
    assert _mirrored(first) == [(m.kind, m.shape, m.dtype) for m in last]
    # per microbatch step: a header and the hidden states down, the chosen tokens back; then the stop
    assert len(first) == 3 * 2 * NEW + 1
    # the first stage waits for the device per request only; the last stage also reads each header
    assert first_waits == PER_REQUEST and last_waits == PER_REQUEST + len(headers)


def test_a_host_tensor_sent_over_the_pipeline_fails_under_the_strict_transport(monkeypatch):
    """A tensor bound for another stage must be on the run's device (NCCL carries no host tensors):
    the strict transport of the training executor and generation's messages refuse one by name."""
    monkeypatch.setenv("MEGAPIPE_STRICT_TRANSPORT", "1")
    ps = pipeline_rank(0, 2)
    sentence = r"^the .* is on cpu but this run computes on meta; pipeline messages must be on the run's device"
    with fake_accelerator(), stubbed_transport(backend="gloo"):
        p2p = StageP2P(ps, (4, 2, 8), torch.float32, FAKE_DEVICE, scatter_gather=False, timeout=None)
        assert p2p.strict
        with pytest.raises(RuntimeError, match=sentence):
            p2p.post([(parse_action("SEND_F0.0>1"), torch.zeros(4, 2, 8))])
        p2p.post([(parse_action("SEND_F0.0>1"), torch.zeros(4, 2, 8, device=FAKE_DEVICE))])
        link = PeerMessages(ps, FAKE_DEVICE)
        assert link.strict
        with pytest.raises(RuntimeError, match=sentence):
            link.send(torch.tensor([1, 0, 0, 3]), 1, "step header")  # generation's old header, made on the host
        link.send_int(1, 1, "step header")


WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


class _Connection:
    """A client's socket as ``http.server`` uses it: the request to read, the reply written."""

    def __init__(self, request: bytes):
        self.request, self.reply = io.BytesIO(request), bytearray()

    def makefile(self, mode, *args):
        return self.request

    def settimeout(self, seconds):
        pass

    def sendall(self, data):
        self.reply += data


def _put(server: tuple, path: str, body, runs: bool = True) -> tuple[int, dict]:
    """The answer of the ``server`` (handler, queue, model) to one request, which its connection's thread
    queues and this thread runs (``run_next``, as the server's main thread), where the fake device is."""
    handler, jobs, loaded = server
    data = json.dumps(body).encode()
    request = f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data
    connection = _Connection(request)
    # handles the one request, then finds the stream closed
    thread = threading.Thread(target=handler, args=(connection, ("127.0.0.1", 0), None))
    thread.start()
    if runs:
        run_next(loaded, jobs)
    thread.join(60)
    head, _, payload = bytes(connection.reply).partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def test_server_request_path_runs_on_the_device_only(tmp_path):
    """``PUT /api`` and ``PUT /loglikelihood`` through the server's own handler (no network): parsing,
    checks, the broadcast to a world of one, generation or scoring on the device, the reply."""
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(WORDS)}, "unk_token": "the"}}))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    ps = ParallelState.single()
    with fake_accelerator(), stubbed_transport():
        fusions.select_backend("eager", FAKE_DEVICE)
        config = model_config("gpt", **LLAMA)
        loaded = LoadedModel(build_model_chunks("gpt", config, ps, device=FAKE_DEVICE), ps, config, tokenizer)
        jobs = RequestQueue(1)
        server = make_handler(loaded, ServerLimits(), jobs), jobs, loaded
        status, answer = _put(server, "/api", {"prompts": ["the cat sat", "a dog"], "tokens_to_generate": 3,
                                               "temperature": 0.9, "top_p": 0.9, "random_seed": 3})
        assert status == 200 and len(answer["tokens"]) == len(answer["text"]) == 2
        status, answer = _put(server, "/loglikelihood", {"requests": [["the cat", "sat on"], ["a", "dog"]]})
        assert status == 200 and len(answer["loglikelihoods"]) == 2
        status, answer = _put(server, "/api", {"prompts": ["the"], "top_k": -1}, runs=False)
        assert status == 400 and answer["error"].startswith("field 'top_k' is -1")
