"""The runner's per-request int32 slot rows and ids_at agree with the plain lists they stand for,
through growth, reassignment and in-place rewrites (the prefix cache's)."""
import numpy as np

from freetoken.engine.request import Request, SamplingParams
from freetoken.engine.runner import slot_row


def test_slot_row_follows_the_list_through_growth_and_rewrites():
    req = Request(prompt_ids=[1, 2, 3], params=SamplingParams())
    rng = np.random.default_rng(0)
    for step in range(300):
        req.slots.extend(int(s) for s in rng.integers(0, 10**6, int(rng.integers(1, 40))))
        if step % 37 == 5:                       # the scheduler's in-place rewrite (cache_prompt)
            req.slots[:10] = [7] * 10
            req.slot_row_len = 0
        if step % 91 == 90:                      # a new list (a reset or a resumed prefix)
            req.slots = list(req.slots[:5])
        n = int(rng.integers(1, len(req.slots) + 1))
        assert slot_row(req, n).tolist() == req.slots[:n]


def test_ids_at_is_a_slice_of_all_ids():
    req = Request(prompt_ids=list(range(10)), params=SamplingParams())
    req.output_ids = list(range(100, 107))
    for start in range(0, 17):
        for n in range(0, 6):
            assert req.ids_at(start, n) == req.all_ids[start:start + n]
