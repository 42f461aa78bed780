"""Token sampling against PyTorch's own sampler: ``draw`` picks, from each row's generator, the index
``torch.multinomial`` picks for one sample, on distributions with and without filtered-out tokens."""

import pytest
import torch

from megapipe.inference.sampling import SamplingParams, draw, filter_logits, sequence_generators

pytestmark = pytest.mark.unit


def test_draw_picks_what_torch_multinomial_picks():
    logits = torch.randn(6, 97, generator=torch.Generator().manual_seed(0)) * 3
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                   SamplingParams(temperature=1.3, top_p=0.8)):
        probs = filter_logits(logits, params).softmax(dim=-1)
        for seed in range(20):
            ours = draw(probs, sequence_generators(seed, range(6), torch.device("cpu")))
            reference = [torch.multinomial(row, 1, generator=g).item()
                         for row, g in zip(probs, sequence_generators(seed, range(6), torch.device("cpu")))]
            assert ours.tolist() == reference
            assert bool((probs.gather(1, ours[:, None]) > 0).all())  # never a filtered-out token
