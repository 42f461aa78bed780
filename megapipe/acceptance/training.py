"""pretrain_gpt.py on one GPU with each fusion backend, and a Llama-shaped model, all started at once.

Each run trains 20 iterations in bf16 on the embedded corpus; its losses must fall. Without dropout
the backends compute the same function from the same weights and data, so Triton's first loss
equals eager's up to bf16 rounding: each kernel rounds its result once to bf16 (2^-8 relative),
and a loss averaged over thousands of tokens through four layers moves by a few such roundings, so
1e-2 relative is a bound with margin that a wrong kernel (a missing bias, a wrong scale) exceeds.
"""

from __future__ import annotations

from megapipe.acceptance.record import Context, Record
from megapipe.acceptance.runs import falling, model_flags, run_together

ITERATIONS = 20
FIRST_LOSS_RTOL = 1e-2
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


def run(record: Record, context: Context) -> None:
    common = model_flags(context) + ["--train-iters", str(ITERATIONS), "--bf16"]
    backends = ("eager",) if context.dry_run else ("eager", "triton", "compile", "apex")
    commands = {f"GPT, {name} fusions": ("pretrain_gpt.py", common + ["--fusion-backend", name]) for name in backends}
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    commands["Llama-shaped, full recomputation, dropout"] = ("pretrain_gpt.py", common + LLAMA + dropout)
    finished = run_together(commands)
    for name in backends:
        result = finished[f"GPT, {name} fusions"]
        chosen, reason = result.backend()
        if result.returncode == 0 and chosen != name:
            record.skip(result.what, f"ran with {chosen}: {reason}")
            continue
        record.check(result.what, lambda: (result.succeeded(), falling(result.losses(), ITERATIONS))[1])
    llama = finished["Llama-shaped, full recomputation, dropout"]
    record.check(llama.what, lambda: (llama.succeeded(), falling(llama.losses(), ITERATIONS))[1])
    if "triton" in backends:
        record.check("Triton's first loss equals eager's", lambda: _same_first_loss(
            finished["GPT, triton fusions"].losses(), finished["GPT, eager fusions"].losses()))


def _same_first_loss(triton: dict, eager: dict) -> str:
    assert 1 in triton and 1 in eager, "a run logged no first iteration"
    difference = abs(triton[1] - eager[1]) / eager[1]
    assert difference <= FIRST_LOSS_RTOL, f"{triton[1]:.5f} vs {eager[1]:.5f} ({difference:.1e} relative)"
    return f"{triton[1]:.5f} vs {eager[1]:.5f} ({difference:.1e} relative)"
