"""The serving benchmark's bookkeeping: throughput over the steady rounds, the tail apart."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from bench_serving import summarize  # noqa: E402

from dspark_jax.engine.speculative import SpecResult  # noqa: E402
from dspark_jax.core.errors import UserError  # noqa: E402


def round_(active, accepted, num_draft, seconds):
    return {"active": np.asarray(active, bool), "accepted": np.asarray(accepted), "num_draft": np.asarray(num_draft),
            "confidence_logits": np.zeros((len(active), 3)), "seconds": seconds}


def test_steady_rounds_exclude_the_round_a_slot_finishes_in_and_the_tail():
    rounds = [round_([1, 1], [2, 0], [3, 3], 1.0),
              round_([1, 1], [1, 1], [3, 2], 1.0),
              round_([1, 1], [3, 0], [3, 1], 1.0),  # slot 0 finishes here: not steady
              round_([0, 1], [0, 0], [0, 1], 5.0),  # the tail: slot 1 alone
              round_([0, 1], [0, 1], [0, 1], 5.0)]
    res = SpecResult([[0] * 9, [0] * 5], 0.1, 13.0, 0.0, rounds)
    got = summarize([res], 2, eos_ids=set())
    assert got["steady_rounds"] == 2 and got["rounds"] == 5
    assert got["aggregate_tokens_per_s"] == pytest.approx((3 + 1 + 2 + 2) / 2.0)
    assert got["per_user_tokens_per_s"] == pytest.approx(2.0)
    assert got["tau"] == pytest.approx(2.0) and got["verify_budget"] == pytest.approx(2.75)
    assert got["verify_tokens_per_round"] == pytest.approx((4 + 4 + 4 + 3) / 2)
    assert got["batch_tokens_per_s"] == pytest.approx((8 + 4) / 13.0)


def test_no_steady_round_is_a_user_error():
    res = SpecResult([[0, 1]], 0.1, 1.0, 0.0, [round_([1], [0], [1], 1.0)])
    with pytest.raises(UserError, match="max-new-tokens"):
        summarize([res], 1, eos_ids=set())
