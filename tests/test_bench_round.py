"""bench_round --profile: op time summed by kind from a jax.profiler trace of a compiled program."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_round  # noqa: E402
from dspark_jax.models import cpu_kernels  # noqa: E402


@pytest.mark.skipif(not cpu_kernels.active(), reason="our CPU product kernel is not built on this machine")
def test_op_profile_names_our_products_by_weight_shape_and_counts_every_call():
    w_big, w_small = jnp.ones((256, 64), jnp.float32), jnp.ones((32, 64), jnp.float32)

    def program(x, w_big, w_small):
        h = jnp.tanh(cpu_kernels.matmul_t(x, w_big))[:, :64]
        return cpu_kernels.matmul_t(cpu_kernels.matmul_t(h, w_small)[:, :1] * h, w_small)

    args = (jnp.ones((4, 64), jnp.float32), w_big, w_small)
    compiled = jax.jit(program).lower(*args).compile()
    kinds = set(bench_round.op_kinds(compiled).values())
    assert {"product, weights f32[256,64]", "product, weights f32[32,64]"} <= kinds
    profile = bench_round.op_profile(compiled, lambda: args, runs=3)
    assert profile["product, weights f32[256,64]"]["calls"] == pytest.approx(1)
    assert profile["product, weights f32[32,64]"]["calls"] == pytest.approx(2)
    assert all(v["ms"] > 0 for v in profile.values())
    assert any(k.startswith("XLA ops") for k in profile)  # the tanh, slices and product between them


def test_timers_run_in_turn_once_per_repeat_after_a_warm_up():
    """Side by side: a slow phase of the machine must touch every row alike, so each repeat runs
    every timer once, in turn, and the first round (compilation, first executions) is not counted."""
    calls = []

    def timer(name):
        return (lambda x: calls.append((name, x)) or jnp.zeros(()), lambda: (len(calls),))

    medians = bench_round.interleaved_ms({"a": timer("a"), "b": timer("b")}, repeats=3)
    assert [name for name, _ in calls] == ["a", "b"] * 4
    assert [x for _, x in calls] == list(range(8))  # make() is called right before its run
    assert set(medians) == {"a", "b"} and all(v >= 0 for v in medians.values())
