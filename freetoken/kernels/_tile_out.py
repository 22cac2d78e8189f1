"""Where the tile GEMMs' results go (kernels/qgemm.py on VNNI, kernels/qgemm_amx.py on AMX):
``put`` writes pair p's product with weight row m into a [P,M] or [M,P] result, or adds it
weighted into a token's row of the experts' output; with ``where``'s half set, the GEMMs give
silu(row m's product) * row half + m's (the experts' gate and up halves: no [P,2I] result and no
pass over it); ``runs`` splits the weight rows into runs of equal ranges, each run over every
expert in turn (a run owns its rows, so the adds never race, and an expert's token tiles stay in
L2 for all of the run's rows).

Shape legend: kernels/qgemm.py's; T tokens of the output a pair's weighted product adds into.
"""
import numpy as np

from freetoken.kernels._numba import SERIAL, njit


@njit(inline="always", **SERIAL)
def put(res, into, p, m, value):
    """Pair p's product with weight row m into res as ``into`` = (layout, ptok, pw, half) says:
    layout 0 res[p, m], 1 res[m, p], 2 res[ptok[p], m] += pw[p] * value (the experts' weighted
    sum, added in the pairs' order as a pass over res would: a run owns its rows m). half is
    the GEMM's business (which rows it pairs), not put's."""
    layout, ptok, pw, _ = into
    if layout == 0:
        res[p, m] = value
    elif layout == 1:
        res[m, p] = value
    else:
        res[ptok[p], m] += pw[p] * value


def into(rows_first, add_to=None, half=0):
    """``put``'s (layout, ptok, pw) and the swiglu's half (0: none) for gemm's arguments."""
    layout = 2 if add_to is not None else 1 if rows_first else 0
    ptok, pw = add_to if add_to is not None else ((), ())
    return (np.int64(layout), np.ascontiguousarray(ptok, np.int32), np.ascontiguousarray(pw, np.float32),
            np.int64(half))


RUNS_PER_THREAD = 2            # row ranges a thread: equal work each, few re-reads of the tiles


def runs(M, rows):
    """How many runs of equal row ranges the tile GEMMs split M rows into (items of ``rows``)."""
    from numba import get_num_threads           # the tile GEMMs are numba kernels: numba is loaded
    return min((M + rows - 1) // rows, RUNS_PER_THREAD * get_num_threads())
