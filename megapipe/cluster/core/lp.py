"""The solvers Gavel's optimisation policies use, imported at first use so that the rest of megapipe
runs without them and a policy without them is one sentence: cvxpy for the programs written as
expressions, HiGHS (highspy) for LPs and MILPs handed over as sparse matrices."""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
import scipy.sparse as sp

from megapipe.optional import LazyModule, require

cp = LazyModule("cvxpy", "Gavel's optimisation policies")
clarabel = LazyModule("clarabel", "Gavel's optimisation policies", package="cvxpy")

SOLVER_NOISE = 1e-6  # entries of X below this are the solver's tolerance, not time to give
INFINITY = np.inf


def cleaned(values: np.ndarray) -> np.ndarray:
    """A solver's X clipped into [0, 1], with entries below its tolerance set to 0."""
    values = np.clip(values, 0.0, 1.0)
    values[values < SOLVER_NOISE] = 0.0
    return values


@functools.cache
def _highspy():
    """highspy, its start-up banner (printed on the process's stdout by the first instance) sent to
    /dev/null so that stdout carries only what tools print (scripts read tools/cluster.py's last lines)."""
    highspy = require("highspy", "Gavel's optimisation policies")
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
    return highspy


def highs_model(cost: np.ndarray, rows: sp.spmatrix, row_lower: np.ndarray, row_upper: np.ndarray,
                col_upper: np.ndarray, integer: np.ndarray | None = None, interior: bool = False):
    """A silent HiGHS instance holding min cost @ z subject to row_lower <= rows @ z <= row_upper and
    0 <= z <= col_upper (``integer`` marks integer columns). ``interior``: HiGHS's interior-point
    method without crossover, whose answer lies inside the optimal face, as an interior-point
    solver's does, instead of at a vertex of it."""
    highspy = _highspy()
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    if interior:
        highs.setOptionValue("solver", "ipm")
        highs.setOptionValue("run_crossover", "off")
    columns = sp.csc_matrix(rows)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = columns.shape[1], columns.shape[0]
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, np.zeros(columns.shape[1]), col_upper
    lp.row_lower_, lp.row_upper_ = row_lower, row_upper
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = columns.indptr, columns.indices, columns.data
    if integer is not None:
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in integer]
    highs.passModel(lp)
    return highs


def solution(highs) -> np.ndarray | None:
    """Run ``highs`` and return its primal solution, or None when it has no optimum."""
    highs.run()
    if highs.getModelStatus() != _highspy().HighsModelStatus.kOptimal:
        return None
    return np.asarray(highs.getSolution().col_value)

