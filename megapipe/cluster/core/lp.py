"""cvxpy, which Gavel's optimisation policies write their linear programs in; imported at first use,
so the rest of megapipe runs without it and a policy without it is one sentence."""

from megapipe.optional import LazyModule

cp = LazyModule("cvxpy", "Gavel's optimisation policies")
