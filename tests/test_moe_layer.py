"""The mixture-of-experts layer on one process, against hand-computed cases and transformers' router loss.

- routing: softmax after / before the top-k, sigmoid, group-limited, and an expert bias that moves
  the choice but not the weights, on logits whose answers are worked out by hand;
- the Switch balancing loss equals transformers' ``load_balancing_loss_func`` / k for the same
  logits, and the per-sequence loss is the mean of the sequences' own;
- capacity: dropping by probability and by position, and padding to capacity, on a hand-made map;
- the expert-bias update follows DeepSeek-V3's sign rule on counted tokens;
- the auxiliary losses reach the gradient exactly as if added to the loss, with the main loss's scale,
  and full recomputation changes neither the gradient nor the counts;
- the grouped matrix product and the loop over experts agree, forward and backward;
- routing statistics per layer reach the log line and the TensorBoard/W&B scalars;
- the FLOPs formula counts an MoE model's products exactly; bad flags are one sentence each.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from megapipe.config import ModelConfig
from megapipe.errors import ConfigError
from megapipe.models import build_model_chunks
from megapipe.models.flops import moe_flops_per_iteration, parameter_count
from megapipe.models.moe import moe_layer_stats, moe_stats_text, set_aux_loss_scale, update_expert_biases
from megapipe.models.moe.capacity import apply_capacity, expert_capacity
from megapipe.models.moe.grouped_linear import grouped_linear, grouped_mm_works
from megapipe.models.moe.expert_bias import bias_update
from megapipe.models.moe.dispatch import assignments
from megapipe.models.moe.layer import MoELayer
from megapipe.models.moe.load_balancing import seq_aux_loss, switch_aux_loss
from megapipe.models.moe.router import scores_for_aux_loss, topk_routing
from megapipe.parallel.state import ParallelState
from megapipe.training.logger import IterationStats

pytestmark = pytest.mark.unit

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0],
                       [0.0, 3.0, 1.0, 2.5]])


def moe_config(**fields) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8, ffn_hidden_size=48,
                swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                hidden_dropout=0.0, attention_dropout=0.0, num_experts=4, moe_router_topk=2)
    return ModelConfig(**{**base, **fields})


def test_softmax_after_topk_weighs_the_chosen_experts_by_their_own_softmax():
    routing = topk_routing(LOGITS, 2)
    assert routing.routing_map.tolist() == [[True, True, False, False], [False, True, False, True]]
    first = torch.softmax(torch.tensor([2.0, 1.0]), 0)
    second = torch.softmax(torch.tensor([3.0, 2.5]), 0)
    torch.testing.assert_close(routing.probs, torch.tensor([[first[0], first[1], 0, 0], [0, second[0], 0, second[1]]]))


def test_softmax_before_topk_keeps_the_probabilities_over_all_experts():
    routing = topk_routing(LOGITS, 2, pre_softmax=True)
    full = torch.softmax(LOGITS, -1)
    torch.testing.assert_close(routing.probs, full * routing.routing_map)
    assert routing.probs.sum(-1).lt(1).all()  # not renormalised


def test_sigmoid_scores_are_renormalised_over_the_chosen():
    routing = topk_routing(LOGITS, 2, score_function="sigmoid")
    s = torch.sigmoid(LOGITS)
    expected = torch.zeros(2, 4)
    expected[0, :2] = s[0, :2] / s[0, :2].sum()
    expected[1, [1, 3]] = s[1, [1, 3]] / s[1, [1, 3]].sum()
    torch.testing.assert_close(routing.probs, expected)


def test_group_limited_routing_picks_experts_inside_the_best_groups():
    # groups {0, 1} and {2, 3}; one group per token: the best expert of the other group is excluded
    logits = torch.tensor([[5.0, -5.0, 4.0, 3.9]])  # group scores (top-1 sums): 5 vs 4 -> group 0
    routing = topk_routing(logits, 2, pre_softmax=True, num_groups=2, group_topk=1)
    assert routing.routing_map.tolist() == [[True, True, False, False]]
    assert topk_routing(logits, 2, pre_softmax=True).routing_map.tolist() == [[True, False, True, False]]


def test_expert_bias_moves_the_choice_but_not_the_weights():
    bias = torch.tensor([0.0, 0.0, 0.0, 0.2])  # sigmoid(1) + 0.2 > sigmoid(1.0)... expert 3 overtakes expert 1
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.9]])
    routing = topk_routing(logits, 2, score_function="sigmoid", expert_bias=bias)
    assert routing.routing_map.tolist() == [[True, False, False, True]]
    s = torch.sigmoid(logits[0])
    torch.testing.assert_close(routing.probs[0, [0, 3]], torch.stack([s[0], s[3]]) / (s[0] + s[3]))


def test_balancing_loss_equals_transformers_router_loss_over_k():
    torch.manual_seed(0)
    logits = torch.randn(24, 8) * 2
    for k in (1, 2, 3):
        ours = switch_aux_loss(scores_for_aux_loss(logits, "softmax"), topk_routing(logits, k).routing_map, k)
        theirs = load_balancing_loss_func((logits,), num_experts=8, top_k=k)
        torch.testing.assert_close(ours * k, theirs)
    even = torch.zeros(8, 4)  # equal probabilities, each expert chosen equally often: Megatron's loss is 1
    routing = torch.eye(4, dtype=torch.bool).repeat(2, 1)
    assert switch_aux_loss(torch.softmax(even, -1), routing, 1).item() == pytest.approx(1.0)


def test_sequence_balancing_loss_is_the_mean_over_sequences():
    torch.manual_seed(1)
    s, b = 5, 3
    logits = torch.randn(s * b, 4)  # tokens ordered [s, b]
    scores, chosen = torch.softmax(logits, -1), topk_routing(logits, 2).routing_map
    per_sequence = [switch_aux_loss(scores.view(s, b, 4)[:, j], chosen.view(s, b, 4)[:, j], 2) for j in range(b)]
    torch.testing.assert_close(seq_aux_loss(scores, chosen, 2, s), torch.stack(per_sequence).mean())


# 6 tokens, 2 experts, top-1; capacity = ceil(6 x 1 / 2 x 0.5) = 2 tokens per expert
CAPACITY_PROBS = torch.tensor([[0.9, 0.0], [0.6, 0.0], [0.8, 0.0], [0.0, 0.7], [0.7, 0.0], [0.0, 0.5]])


def test_dropping_by_probability_keeps_each_experts_most_confident_tokens():
    probs, kept = apply_capacity(CAPACITY_PROBS, CAPACITY_PROBS > 0, 1, 0.5, "probs", pad=False)
    assert kept.tolist() == [[True, False], [False, False], [True, False], [False, True], [False, False],
                             [False, True]]
    torch.testing.assert_close(probs, CAPACITY_PROBS * kept)


def test_dropping_by_position_keeps_each_experts_earliest_tokens():
    _, kept = apply_capacity(CAPACITY_PROBS, CAPACITY_PROBS > 0, 1, 0.5, "position", pad=False)
    assert kept.tolist() == [[True, False], [True, False], [False, False], [False, True], [False, False],
                             [False, True]]


def test_padding_fills_each_expert_to_capacity_with_weightless_tokens():
    routing = CAPACITY_PROBS.clone()
    routing[5] = torch.tensor([0.5, 0.0])  # expert 1 now gets one token only
    probs, kept = apply_capacity(routing, routing > 0, 1, 0.5, "position", pad=True)
    assert kept.sum(0).tolist() == [2, 2]
    assert kept[:, 1].tolist() == [True, False, False, True, False, False]  # its token, then the earliest free one
    assert probs[0, 1] == 0 and probs[3, 1] == pytest.approx(0.7)


def test_assignments_found_by_sorting_equal_nonzero():
    torch.manual_seed(2)
    routing = topk_routing(torch.randn(13, 6), 3)
    padded = apply_capacity(routing.probs, routing.routing_map, 3, 0.5, "probs", pad=True)[1]
    dropped = apply_capacity(routing.probs, routing.routing_map, 3, 0.5, "probs", pad=False)[1]
    for routing_map, count in ((routing.routing_map, 13 * 3), (padded, 6 * expert_capacity(13, 6, 3, 0.5)),
                               (dropped, None)):
        expert_ids, token_ids = assignments(routing_map, count)
        reference = routing_map.t().nonzero(as_tuple=True)
        assert torch.equal(expert_ids, reference[0]) and torch.equal(token_ids, reference[1])


def test_expert_bias_update_follows_the_sign_rule_after_each_step():
    bias = torch.tensor([0.0, 0.1, -0.1, 0.0])
    counts = torch.tensor([10.0, 2.0, 6.0, 6.0])  # mean 6: expert 0 over, 1 under, 2 and 3 even
    torch.testing.assert_close(bias_update(bias, counts, 0.01), torch.tensor([-0.01, 0.11, -0.1, 0.0]))

    config = moe_config(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)
    layer = MoELayer(config, ParallelState.single(), "layers.0.mlp", 1, False, 0.01)
    x = torch.randn(4, 2, 32, requires_grad=True)
    layer(x)[0].sum().backward()
    counts = layer.router.step_tokens.clone()
    assert counts.sum().item() == 4 * 2 * 2
    update_expert_biases([layer])
    torch.testing.assert_close(layer.router.expert_bias, 0.01 * torch.sign(counts.mean() - counts))
    assert layer.router.step_tokens.sum().item() == 0  # the next step counts afresh


def _router_grad(config: ModelConfig, explicit: bool, scale=None):
    """The router's gradient from the layer's output sum, with the losses attached or added by hand."""
    torch.manual_seed(3)
    layer = MoELayer(config, ParallelState.single(), "layers.0.mlp", 1, False, 0.01)
    x = torch.randn(4, 2, 32)
    if explicit:
        layer.eval()  # no attached losses: add them to the objective instead
        out, _ = layer(x)
        logits = torch.nn.functional.linear(x.reshape(8, 32), layer.router.weight)
        scores, chosen = scores_for_aux_loss(logits, "softmax"), topk_routing(logits, 2).routing_map
        aux = switch_aux_loss(scores, chosen, 2) * config.moe_aux_loss_coeff
        z = torch.logsumexp(logits, -1).square().mean() * config.moe_z_loss_coeff
        (out.sum() + aux + z).backward()
    else:
        set_aux_loss_scale(layer, scale)
        layer(x)[0].sum().backward()
    return layer.router.weight.grad


def test_attached_losses_give_the_gradient_of_adding_them_to_the_loss():
    config = moe_config(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
    explicit = _router_grad(config, explicit=True)
    torch.testing.assert_close(_router_grad(config, explicit=False), explicit)
    without = _router_grad(moe_config(), explicit=False)
    assert not torch.allclose(without, explicit)  # the losses do contribute
    # under a main-loss scale of 1/4 (4 microbatches per step) the losses' share is scaled alike
    quarter = _router_grad(config, explicit=False, scale=torch.tensor(0.25))
    torch.testing.assert_close(quarter - without, (explicit - without) * 0.25, rtol=1e-4, atol=1e-7)


def test_full_recomputation_gives_the_same_router_gradient_and_counts_once():
    results = []
    for extra in ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)):
        config = moe_config(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1, **extra)
        model = build_model_chunks("gpt", config, ParallelState.single())[0]
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        model(None, {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 8)}).backward()
        router = model.layers["0"].mlp.router
        results.append((router.weight.grad, router.step_tokens))
    torch.testing.assert_close(results[1][0], results[0][0])
    assert torch.equal(results[1][1], results[0][1]) and results[0][1].sum().item() == 2 * 8 * 2


@pytest.mark.skipif(not grouped_mm_works(torch.device("cpu"), torch.float32), reason="this torch has no CPU grouped matmul")
def test_grouped_matmul_and_the_loop_over_experts_agree():
    torch.manual_seed(4)
    counts = torch.tensor([3, 0, 9, 4])  # an expert without tokens too
    results = []
    for grouped in (True, False):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)
        w = torch.randn(4, 48, 32, generator=torch.Generator().manual_seed(6), requires_grad=True)
        out = grouped_linear(x, w, counts, grouped)
        out.backward(torch.cos(out))
        results.append((out, x.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    config = moe_config(moe_grouped_gemm=True, moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True)
    layer = MoELayer(config, ParallelState.single(), "layers.0.mlp", 1, False, 0.01)
    x = torch.randn(4, 2, 32)
    grouped_out = layer(x)[0]
    config.moe_grouped_gemm = False
    torch.testing.assert_close(layer(x)[0], grouped_out, rtol=1e-5, atol=1e-6)


def test_flop_and_parameter_formulas_count_experts_router_and_shared_expert():
    config = moe_config(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True, moe_layer_freq=(1, 0),
                        masked_softmax_fusion=False, untie_embeddings_and_output_weights=True, qk_layernorm=True)
    model = build_model_chunks("gpt", config, ParallelState.single())[0]
    padding = 2 * (config.padded_vocab_size(1) - config.vocab_size) * config.hidden_size  # input and output rows
    assert parameter_count(config) == sum(p.numel() for p in model.parameters()) - padding
    tokens = torch.randint(0, config.vocab_size, (3, config.seq_length))
    with FlopCounterMode(display=False) as counter:
        model(None, {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(3, config.seq_length)}).backward()
    assert counter.get_total_flops() == moe_flops_per_iteration(config, global_batch_size=3, recompute=False)


def test_routing_statistics_per_layer_reach_the_log_line_and_the_scalars():
    config = moe_config(moe_expert_capacity_factor=0.5, moe_aux_loss_coeff=0.01)
    model = build_model_chunks("gpt", config, ParallelState.single())[0]
    for seed in range(2):  # two microbatches of 2 x 8 tokens, 2 experts each: 32 pairs, capacity 4 per expert
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
        model(None, {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 8)}).backward()
    stats = moe_layer_stats([model])
    assert sorted(stats) == [0, 1] and moe_layer_stats([model]) == {}  # read once, then cleared
    for s in stats.values():
        assert s["max"] <= 4 and s["mean"] == pytest.approx((32 - s["dropped"]) / 4)
        assert (s["cv"] > 0) == (s["max"] > s["min"])
    line = IterationStats(iteration=1, train_iters=1, consumed_samples=4, ms_per_iteration=1.0, learning_rate=0.1,
                          global_batch_size=4, losses={"lm loss": 1.0}, loss_scale=None, grad_norm=None,
                          skipped_iterations=0, nan_iterations=0, tokens_per_second=1.0, tflops_per_device=1.0,
                          mfu=None, memory_gib=0.0, moe=stats)
    assert line.line().endswith(moe_stats_text(stats) + " |") and "moe L1 tok" in line.line()
    assert line.scalars()["moe-L0-dropped"] == stats[0]["dropped"]


@pytest.mark.parametrize("fields, message", [
    (dict(moe_router_topk=5), r"^--moe-router-topk 5 must be between 1 and --num-experts 4; each token picks that "
                              r"many distinct experts\.$"),
    (dict(moe_expert_capacity_factor=0.0), r"^--moe-expert-capacity-factor 0\.0 must be above 0"),
    (dict(moe_expert_capacity_factor=-1.0), r"^--moe-expert-capacity-factor -1\.0 must be above 0"),
    (dict(moe_router_group_topk=1), r"^--moe-router-group-topk needs --moe-router-num-groups"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), r"^--moe-router-num-groups 3 does not divide "
                                                              r"--num-experts 4"),
    (dict(add_bias_linear=True), r"^--num-experts needs --disable-bias-linear"),
    (dict(moe_layer_freq=(1, 0, 1)), r"^--moe-layer-freq lists 3 entries but --num-layers is 2"),
])
def test_bad_moe_flags_are_one_sentence(fields, message):
    with pytest.raises(ConfigError, match=message):
        moe_config(**fields).validate()


def test_qk_norm_over_whole_projections_needs_one_tensor_rank():
    config = moe_config(qk_layernorm=True, qk_layernorm_scope="projection")
    config.validate(tensor_parallel=1)
    with pytest.raises(ConfigError, match=r"^--qk-layernorm-scope projection normalises across all heads, which "
                                          r"needs --tensor-model-parallel-size 1"):
        config.validate(tensor_parallel=2)
