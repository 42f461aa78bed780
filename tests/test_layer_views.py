"""The QKV split by views and the embedding without its transposing copy: the same numbers, fewer copies.

References are the previous code, written out here: q, k and v taken from the QKV projection by indexing
(whose backward zero-fills a full-size buffer for each and adds the three), and embeddings looked up as
[b, s, h] and then transposed by a copy. Outputs and every gradient must be equal bit for bit (fp32, dropout
on) for GPT, BERT and Llama layers, with qk-norms of both scopes and partial RoPE. On the fake device, with the
attention kernels a GPU runs (flash, cuDNN), the attention block and the embedding copy nothing in the forward
pass: the kernels' output is [s, b, heads, d] ordered, so the output projection reads a view.
"""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megapipe import fusions
from megapipe.config import ModelConfig
from megapipe.models import transformer
from megapipe.models.embedding import Embedding
from megapipe.parallel.state import ParallelState
from megapipe.testing.fake_device import FAKE_DEVICE, fake_accelerator
from model_families import family_config

pytestmark = pytest.mark.unit

SEQ, MICRO, VOCAB = 16, 3, 20  # a small vocabulary: tokens repeat, so gradient rows meet in the tables
LAYERS = {"gpt": ("gpt", {}), "bert": ("bert", {}), "llama": ("llama", {}),
          "llama-one-head-per-group": ("llama", dict(num_query_groups=4)),
          "llama-partial-rope": ("llama", dict(rotary_percent=0.5)),
          "llama-qk-norm": ("llama", dict(qk_layernorm=True)),
          "llama-qk-norm-projection": ("llama", dict(qk_layernorm=True, qk_layernorm_scope="projection"))}


def config(name: str) -> ModelConfig:
    kind, extra = LAYERS[name]
    sizes = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB,
                 hidden_dropout=0.1, attention_dropout=0.1)
    return family_config(kind, **{**sizes, **extra})


def indexed_attention(self, x, attention_mask, causal, rotary=None, kv_cache=None):
    """The previous ``SelfAttention.forward``: q, k, v by indexing the grouped projection."""
    qkv = self.qkv(x)
    s, b = qkv.shape[0], qkv.shape[1]
    n, d = self.heads_per_group, self.config.head_dim
    grouped = qkv.view(s, b, self.local_groups, n + 2, d)
    q = grouped[:, :, :, :n].reshape(s, b, self.local_heads, d).permute(1, 2, 0, 3)
    k, v = (grouped[:, :, :, n + i].permute(1, 2, 0, 3) for i in (0, 1))
    if self.q_norm is not None:
        q, k = (indexed_qk_norm(self, t, norm) for t, norm in ((q, self.q_norm), (k, self.k_norm)))
    if rotary is not None:
        q, k = (fusions.apply_rope(t, *rotary, fused=self.config.apply_rope_fusion) for t in (q, k))
    context = self.core_attention(q, k, v, attention_mask, causal)
    return self.dense(context.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * d))


def indexed_qk_norm(self, x, norm):
    if self.config.qk_layernorm_scope == "head":
        return norm(x)
    b, heads, s, d = x.shape
    return norm(x.transpose(1, 2).reshape(b, s, heads * d)).view(b, s, heads, d).transpose(1, 2)


def layer_run(cfg, attention_forward=None):
    """Outputs, input gradients and weight gradients of two forward/backward passes of one layer."""
    ps = ParallelState.single()
    ps.seed(3, torch.device("cpu"))
    layer = transformer.TransformerLayer(cfg, ps, 0, seed=7).train()
    rotary = (fusions.rotary_tables(torch.arange(SEQ).unsqueeze(0), cfg.rotary_dim, cfg.rotary_base)
              if cfg.position_embedding_type == "rope" else None)
    g = torch.Generator().manual_seed(1)
    results = []
    forward = attention_forward or transformer.SelfAttention.forward
    with mock.patch.object(transformer.SelfAttention, "forward", forward):
        for _ in range(2):
            x = torch.randn(SEQ, MICRO, cfg.hidden_size, generator=g, requires_grad=True)
            out = layer(x, None, True, rotary)
            out.backward(torch.randn(out.shape, generator=g))
            results += [out.detach(), x.grad]
    return results + [p.grad for p in layer.parameters()]


def assert_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", list(LAYERS))
def test_qkv_views_give_the_indexing_numbers(name):
    cfg = config(name)
    assert_equal(layer_run(cfg), layer_run(cfg, indexed_attention))


class Ops(TorchDispatchMode):
    """The aten operators that run inside it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_qkv_backward_concatenates_once(name):
    """One concatenation of the q, k, v gradients; no zero-filled buffers to add up."""
    cfg = config(name)
    ps = ParallelState.single()
    ps.seed(3, torch.device("cpu"))
    attention = transformer.SelfAttention(cfg, ps, "attention", 7, False).train()
    rotary = (fusions.rotary_tables(torch.arange(SEQ).unsqueeze(0), cfg.rotary_dim, cfg.rotary_base)
              if cfg.position_embedding_type == "rope" else None)
    out, _ = attention(torch.randn(SEQ, MICRO, cfg.hidden_size), None, True, rotary)
    with Ops() as ops:
        out.sum().backward()
    assert ops.names.count("cat") == 1 + 2 * (rotary is not None)  # RoPE's rotate-half of q and k
    assert not {"slice_backward", "select_backward", "zeros", "zero_", "new_zeros"} & set(ops.names)


def flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **options):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]


def cudnn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **options):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, dropout_p, is_causal, False,
                                                              scale=scale)[0]


@pytest.mark.parametrize("kernel", [flash, cudnn], ids=["flash", "cudnn"])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_attention_block_copies_nothing_with_the_gpu_kernels(name, kernel):
    """Fake device, the kernel a GPU takes (patched in: the fake device's own choice is the math kernel)."""
    cfg = config(name)
    with fake_accelerator(), mock.patch.object(F, "scaled_dot_product_attention", kernel):
        ps = ParallelState.single()
        ps.seed(3, FAKE_DEVICE)
        attention = transformer.SelfAttention(cfg, ps, "attention", 7, False, device=FAKE_DEVICE).train()
        x = torch.randn(SEQ, MICRO, cfg.hidden_size, device=FAKE_DEVICE, requires_grad=True)
        rotary = (fusions.rotary_tables(torch.arange(SEQ, device=FAKE_DEVICE).unsqueeze(0), cfg.rotary_dim,
                                        cfg.rotary_base) if cfg.position_embedding_type == "rope" else None)
        with Ops() as ops:
            attention(x, None, True, rotary)
    assert not {"clone", "copy_", "contiguous"} & set(ops.names), ops.names


def transposed_embedding(self, tokens, position_ids=None, tokentype_ids=None):
    """The previous lookup: [b, s, h] rows, summed, then a transposing copy (dropout as ``Embedding``'s)."""
    x = F.embedding(tokens, self.word_embeddings.weight)
    if self.position_embeddings is not None:
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1]).unsqueeze(0)
        x = x + self.position_embeddings(position_ids)
    if self.tokentype_embeddings is not None:
        x = x + self.tokentype_embeddings(torch.zeros_like(tokens) if tokentype_ids is None else tokentype_ids)
    x = x.transpose(0, 1).contiguous()
    if self.norm is not None:
        x = self.norm(x)
    return F.dropout(x, self.config.hidden_dropout, self.training)


def embedding_run(kind, positions, forward=None):
    cfg = family_config(kind, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB,
                        hidden_dropout=0.1)
    ps = ParallelState.single()
    ps.seed(3, torch.device("cpu"))
    embedding = Embedding(cfg, ps, seed=5, sequence_parallel=False).train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    types = torch.randint(0, 2, (MICRO, SEQ), generator=g) if kind == "bert" else None
    position_ids = torch.randint(0, SEQ, (MICRO, SEQ), generator=g) if positions else None
    with mock.patch.object(Embedding, "forward", forward or Embedding.forward):
        out = embedding(tokens, position_ids, types)
    out.backward(torch.randn(out.shape, generator=g))
    return [out.detach()] + [p.grad for p in embedding.parameters()]


@pytest.mark.parametrize("positions", [False, True], ids=["positions-0..s", "position-ids"])
@pytest.mark.parametrize("kind", ["gpt", "bert", "llama"])
def test_embedding_lookup_in_sequence_order_gives_the_transposed_numbers(kind, positions):
    """Tables' gradients too: rows that several tokens share are summed in the previous [b, s] order."""
    assert_equal(embedding_run(kind, positions), embedding_run(kind, positions, transposed_embedding))


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_embedding_copies_nothing(kind):
    cfg = family_config(kind, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB,
                        hidden_dropout=0.0)
    with fake_accelerator():
        ps = ParallelState.single()
        ps.seed(3, FAKE_DEVICE)
        embedding = Embedding(cfg, ps, seed=5, sequence_parallel=False, device=FAKE_DEVICE).train()
        tokens = torch.zeros(MICRO, SEQ, dtype=torch.long, device=FAKE_DEVICE)
        with Ops() as ops:
            out = embedding(tokens, None, torch.zeros_like(tokens) if kind == "bert" else None)
    assert out.shape == (SEQ, MICRO, cfg.hidden_size) and out.is_contiguous()
    assert not {"clone", "copy_", "contiguous"} & set(ops.names), ops.names


def test_sequence_first_lookup_refuses_other_shapes():
    from megapipe.tensor_parallel.lookup import sequence_first_lookup

    with pytest.raises(ValueError, match=r"takes \[batch, sequence\] ids"):
        sequence_first_lookup(torch.zeros(4, dtype=torch.long), torch.zeros(3, 2))
