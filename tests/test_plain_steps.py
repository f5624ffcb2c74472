"""Plain target steps instead of rounds when drafts do not pay (DESIGN.md 3.3b, engine/fallback.py):
the engine stays lossless whatever mix of rounds and plain steps it runs, and the gate picks plain
steps when rounds cost more per token than they commit."""

import json

import jax
import numpy as np
import pytest
from test_cli import tiny_drafter  # noqa: F401  (a fixture)
from test_speculative import (
    PROMPTS,
    SAMPLING_PROMPTS,
    SOFT_TARGET,
    SPS,
    TARGET,
    TCFG,
    assert_follows_target,
    drafter,
    round_counts,
)

from dspark_jax.drafters.dspark import init_drafter_params
from dspark_jax.engine.fallback import PROBE_EVERY, PROBE_EVERY_MAX, PlainStepGate
from dspark_jax.engine.generate import generate
from dspark_jax.models.sampling import SamplingConfig
from dspark_jax.engine.speculative import SpecConfig, speculative_generate, speculative_serve
from dspark_jax.engine.sps import SPSTable, load_sps_table, save_sps_table, token_buckets


class ScriptedGate(PlainStepGate):
    """Plain steps where `pattern(step)` says so, whatever the costs: the engine must stay lossless
    under any schedule of rounds and plain steps that does not look at the current draft."""

    def __init__(self, pattern):
        super().__init__()
        self.pattern, self.step = pattern, 0

    def plain_run_length(self) -> int:
        self.step += 1
        return int(self.pattern(self.step))  # one step at a time


class PricedGate(PlainStepGate):
    """The real decision, with fixed costs instead of this machine's timings (rounds `round_s`,
    plain steps `plain_s` seconds), so that the choice it makes is deterministic."""

    def __init__(self, round_s: float, plain_s: float):
        super().__init__()
        self.costs = (round_s, plain_s)

    def observe_round(self, seconds, tokens_per_request, expected_per_request=None):
        super().observe_round(self.costs[0], tokens_per_request, expected_per_request)

    def observe_plain(self, seconds, steps=1):
        super().observe_plain(self.costs[1] * steps, steps)


def bucketed(**kw) -> SpecConfig:
    """Rounds verify through the flattened, token-bucketed pass (the dspark schedulers' layout)."""
    return SpecConfig(gamma=4, verify_buckets=token_buckets(3 * 5), **kw)


ALTERNATE = lambda step: step % 2 == 0  # noqa: E731  round, plain, round, plain, ...
MOSTLY_PLAIN = lambda step: step % 3 != 1  # noqa: E731  round, plain, plain, round, ...


@pytest.mark.parametrize("policy", ["fixed", "dspark"])
@pytest.mark.parametrize("pattern", [ALTERNATE, MOSTLY_PLAIN, lambda step: True], ids=["alternate", "mostly", "all"])
def test_greedy_with_plain_steps_equals_greedy_target(policy, pattern):
    dcfg, dparams = drafter()
    want = generate(TARGET, TCFG, PROMPTS, max_new_tokens=20).token_ids
    gate = ScriptedGate(pattern)
    got = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=20, gate=gate,
                               cfg=bucketed(policy=policy, sps=SPS))
    assert got.token_ids == want
    assert gate.plain_steps == got.plain_steps > 0
    if pattern(1):  # all plain: no round ran, every step emitted exactly one token per row
        assert gate.rounds == 0 and len(got.acceptance_lengths()) == 0
        assert got.plain_steps == 19  # the prefill emits the first of the 20 tokens
    else:
        accepting, _ = round_counts(got)
        assert gate.rounds > 0 and accepting > 0


class RunGate(PlainStepGate):
    """Plain-step runs of the given lengths (0: a round), in order, then rounds."""

    def __init__(self, runs):
        super().__init__()
        self.runs = iter(runs)

    def plain_run_length(self) -> int:
        return next(self.runs, 0)


def eagle3_drafter():
    from dspark_jax.drafters.config import DrafterConfig
    from dspark_jax.drafters.eagle3 import init_eagle3_params

    dcfg = DrafterConfig(kind="eagle3", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                         intermediate_size=48, vocab_size=32, head="none", confidence=False, target_layer_ids=(0, 2),
                         target_vocab_size=32, target_hidden_size=32, target_num_layers=4)
    return dcfg, init_eagle3_params(dcfg, jax.random.key(2), scale=0.3)


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
@pytest.mark.parametrize("sampling", [SamplingConfig(0.0), SamplingConfig(1.0)], ids=["greedy", "T1"])
def test_a_run_of_plain_steps_leaves_the_drafter_where_single_steps_do(kind, sampling):
    """A run of k plain steps commits its anchors' features to the drafter at the end, all at once:
    the drafter's context (its cache over the committed positions, and Eagle3's carried feature)
    must be what k one-step runs leave, for a row that finishes inside a run too (which ends that
    run: its slot is refilled at once under continuous batching)."""
    from dspark_jax.engine import speculative as S
    from dspark_jax.engine.generate import flatten_prompts, pad_prompts

    dcfg, dparams = drafter() if kind == "dspark" else eagle3_drafter()
    if kind == "dspark":  # a random drafter: its context projections are not the test drafter's special ones
        dparams = init_drafter_params(dcfg, jax.random.key(4), scale=0.5)
    cfg = SpecConfig(gamma=3, sampling=sampling)
    budgets = [30, 4, 30]  # the second row finishes inside the run
    tokens, lengths, max_len = pad_prompts(TCFG, PROMPTS, 30, slack=cfg.gamma + 1)
    state = S.spec_prefill(TARGET, dparams, jax.numpy.asarray(tokens), jax.numpy.asarray(lengths),
                           jax.numpy.asarray(budgets), jax.random.key(3), flatten_prompts(PROMPTS), tcfg=TCFG,
                           dcfg=dcfg, cfg=cfg, max_len=max_len)
    statics = dict(tcfg=TCFG, dcfg=dcfg, cfg=cfg)
    copy = lambda tree: jax.tree.map(lambda a: a.copy(), tree)  # noqa: E731  (the step donates its state)
    batched, stats = S.spec_plain(TARGET, dparams, copy(state), np.int32(7), **statics)
    # the run ends with the step in which the second row finishes (a server refills its slot at once) ...
    np.testing.assert_array_equal(stats.active, [3, 3, 3])  # steps each row took
    batched, stats = S.spec_plain(TARGET, dparams, batched, np.int32(4), **statics)
    np.testing.assert_array_equal(stats.active, [4, 0, 4])  # ... and the next one runs the others on
    stepped = copy(state)
    for _ in range(7):
        stepped, _ = S.spec_plain(TARGET, dparams, stepped, np.int32(1), **statics)
    np.testing.assert_array_equal(batched.output, stepped.output)
    a, b = batched.draft, stepped.draft
    np.testing.assert_array_equal(a.cache.lengths, b.cache.lengths)
    np.testing.assert_array_equal(a.cache.lengths - state.draft.cache.lengths, [7, 3, 7])
    for row, n in enumerate(np.asarray(a.cache.lengths)):  # every committed position, every layer
        np.testing.assert_allclose(a.cache.k[:, row, :n], b.cache.k[:, row, :n], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a.cache.v[:, row, :n], b.cache.v[:, row, :n], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.last_feature, b.last_feature, rtol=1e-6, atol=1e-6)
    # And what both hold is the context of the whole committed prefix: what a prefill of the prompt
    # plus every emitted token but the newest (the next anchor) gives the drafter.
    emitted = [np.asarray(batched.output)[r, : int(batched.num_generated[r]) - 1].tolist() for r in range(3)]
    prefixes = [p + e for p, e in zip(PROMPTS, emitted)]
    tokens, lengths, _ = pad_prompts(TCFG, prefixes, 30, slack=cfg.gamma + 1)
    fresh = S.spec_prefill(TARGET, dparams, jax.numpy.asarray(tokens), jax.numpy.asarray(lengths),
                           jax.numpy.asarray(budgets), jax.random.key(3), flatten_prompts(prefixes), tcfg=TCFG,
                           dcfg=dcfg, cfg=cfg, max_len=max_len)
    np.testing.assert_array_equal(fresh.draft.cache.lengths, a.cache.lengths)
    for row, n in enumerate(np.asarray(a.cache.lengths)):
        np.testing.assert_allclose(a.cache.k[:, row, :n], fresh.draft.cache.k[:, row, :n], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(a.cache.v[:, row, :n], fresh.draft.cache.v[:, row, :n], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(a.last_feature, fresh.draft.last_feature, rtol=1e-4, atol=1e-4)


def test_continuous_batching_with_plain_steps_is_lossless():
    """7 requests through 3 slots, refills between plain steps and rounds, stop tokens on."""
    dcfg, dparams = drafter()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11], [12, 13], [14, 15, 16], [17, 18, 19, 20]]
    want = [generate(TARGET, TCFG, [p], max_new_tokens=9).token_ids[0] for p in prompts]
    stop = want[0][4]
    want_stop = [generate(TARGET, TCFG, [p], stop_ids=[stop], max_new_tokens=9).token_ids[0] for p in prompts]
    for stops, expected in (((), want), ((stop,), want_stop)):
        gate = ScriptedGate(MOSTLY_PLAIN)
        got = speculative_serve(TARGET, TCFG, dparams, dcfg, prompts, slots=3, max_new_tokens=9, gate=gate,
                                cfg=bucketed(policy="dspark", sps=SPS, stop_ids=stops))
        assert got.token_ids == expected
        assert gate.plain_steps > 0 and gate.rounds > 0
        per_request = [s["plain_steps"] for s in got.request_stats]
        assert sum(per_request) > 0
        # a plain step is not a round: tau totals only count the rounds
        assert all(s["tau_sum"] >= s["rounds"] for s in got.request_stats)


# top-k/top-p with plain steps: in the slow set (the processed distributions' losslessness is tested
# in test_speculative; the plain-step path is the same for both)
@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), pytest.param(SamplingConfig(0.8, 8, 0.9), marks=pytest.mark.slow)],
                         ids=["T1", "topk-topp"])
def test_sampling_with_plain_steps_is_lossless(sampling):
    """The first 6 sampled tokens (6000 samples, 3 prompts) follow the target's conditionals exactly
    with rounds and plain steps alternating: position 0 is the prefill's sample, the others come
    from rounds (rejection sampling) or from plain steps. Power, on these seeds: a plain step that
    samples from the raw target distribution (temperature, top-k and top-p not applied) fails the
    top-k/top-p case at positions 2-5 (p-values ~0)."""
    dcfg, dparams = drafter()
    prompts = SAMPLING_PROMPTS * 2000
    gate = ScriptedGate(ALTERNATE)
    spec = speculative_generate(SOFT_TARGET, TCFG, dparams, dcfg, prompts, max_new_tokens=6, seed=3, gate=gate,
                                cfg=SpecConfig(gamma=4, sampling=sampling, policy="fixed",
                                               verify_buckets=(len(prompts) * 5 // 4, len(prompts) * 5 // 2,
                                                               len(prompts) * 5)))  # 3 programs, not 16
    assert gate.plain_steps >= 2 and gate.rounds >= 2
    accepting, rejecting = round_counts(spec)
    assert accepting > 1000 and rejecting > 1000, (accepting, rejecting)
    assert_follows_target(prompts, spec.token_ids, sampling)


def test_a_drafter_that_never_pays_falls_back_to_plain_steps():
    """A random drafter (nothing accepted) and rounds dearer than plain steps: after the first round
    and one measured plain step, the engine decodes with plain steps, re-probing with a round at
    growing intervals — and the output is still exactly the target's."""
    dcfg, _ = drafter(head="none")
    dparams = jax.tree.map(jax.numpy.asarray, jax.device_get(init_drafter_params(dcfg, jax.random.key(7), scale=0.3)))
    want = generate(TARGET, TCFG, PROMPTS, max_new_tokens=120).token_ids
    gate = PricedGate(round_s=2.0, plain_s=1.0)
    got = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=120, gate=gate,
                               cfg=bucketed(policy="fixed"))
    assert got.token_ids == want
    assert got.acceptance_lengths().mean() < 1.3  # the drafter really does not pay
    assert gate.plain_steps > 0.85 * (gate.plain_steps + gate.rounds), (gate.plain_steps, gate.rounds)
    assert gate.probe_every > PROBE_EVERY  # the probes lost, so they became rarer
    assert max(r["plain"] for r in got.rounds) > 8  # a run of plain steps goes through one program call


def test_a_drafter_that_pays_keeps_drafting():
    """The structured drafter (tau ~1.7) and rounds a little dearer than plain steps: rounds win
    but for the measured plain step and stretches where the running tau dips."""
    dcfg, dparams = drafter()
    gate = PricedGate(round_s=1.1, plain_s=1.0)
    got = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=40, gate=gate,
                               cfg=bucketed(policy="fixed"))
    assert got.token_ids == generate(TARGET, TCFG, PROMPTS, max_new_tokens=40).token_ids
    assert got.acceptance_lengths().mean() > 1.5 and gate.plain_steps < 0.3 * gate.rounds, gate


# ----------------------------------------------------------------------------- the gate itself


def feed(gate: PlainStepGate, steps: int, round_s: float, plain_s: float, tau, forecast=None) -> str:
    """Run the gate for `steps` decisions with fixed costs; 'R' for a round, 'p' for a plain step.
    tau (and the head's forecast, if any): a number, or a function of the round's index."""
    out = ""
    at = lambda x, i: x(i) if callable(x) else x  # noqa: E731
    for _ in range(steps):
        if gate.plain_now():
            gate.observe_plain(plain_s)
            out += "p"
        else:
            i = out.count("R")
            gate.observe_round(round_s, np.array([at(tau, i)]),
                               None if forecast is None else np.array([at(forecast, i)]))
            out += "R"
    return out


def test_gate_measures_a_round_and_a_plain_step_first_then_prefers_the_cheaper_per_token():
    paying = feed(PlainStepGate(), 12, round_s=1.0, plain_s=0.5, tau=3.0)  # 3 tok/s vs 2 tok/s
    assert paying == "Rp" + "R" * 10
    losing = PlainStepGate()
    steps = feed(losing, 1 + PROBE_EVERY + 1 + 2 * PROBE_EVERY + 1, round_s=1.0, plain_s=0.5, tau=1.2)
    # measured both, then plain steps with re-probes at doubling intervals while the probes lose
    assert steps == "Rp" + "p" * (PROBE_EVERY - 1) + "R" + "p" * (2 * PROBE_EVERY) + "R"
    assert losing.probe_every == 4 * PROBE_EVERY


def test_gate_times_a_plain_step_even_when_its_prior_prices_them_out():
    """A table profiled on a busy machine prices plain steps at 20x their cost: the gate still times
    one after the first round, and from then on decodes with plain steps (rounds do not pay)."""
    gate = PlainStepGate(round_s=1.0, plain_s=10.0)
    steps = feed(gate, 2 + PROBE_EVERY, round_s=1.0, plain_s=0.5, tau=1.2)
    assert steps == "Rp" + "p" * (PROBE_EVERY - 1) + "R" and gate.plain_s == 0.5
    wrong_round = PlainStepGate(round_s=0.01, plain_s=0.5)  # a first timing replaces a prior outright
    feed(wrong_round, 2, round_s=1.0, plain_s=0.5, tau=1.2)
    assert wrong_round.round_s == 1.0


def test_gate_follows_the_heads_forecast_not_each_rounds_luck():
    """Break-even tau 2 (rounds 1 s, plain steps 0.5 s). Rounds commit 1, 1, 1, 4, 4, 4, ... tokens
    (2.5 on average) while the head forecasts 2.5 each time: the gate reading committed tokens
    alone drops to plain steps after the first short rounds; with the forecast it keeps drafting.
    A head that forecasts 5 where rounds commit 1.2 is corrected by what they commit."""
    luck = lambda i: 1.0 if (i // 3) % 2 == 0 else 4.0  # noqa: E731
    alone = feed(PlainStepGate(), 60, round_s=1.0, plain_s=0.5, tau=luck)
    with_head = feed(PlainStepGate(), 60, round_s=1.0, plain_s=0.5, tau=luck, forecast=2.5)
    assert alone.count("p") > 20 and with_head == "Rp" + "R" * 58, (alone, with_head)
    optimist = PlainStepGate()
    steps = feed(optimist, 300, round_s=1.0, plain_s=0.5, tau=1.2, forecast=5.0)
    assert optimist.tau < 2.0 and steps[-100:].count("p") > 90, steps


def test_a_dear_losing_probe_spaces_the_probes_out_at_once():
    """A probe that loses a whole plain step's worth of time (rounds 1.5 s commit 1 token, plain
    steps 0.5 s) moves the next one out to where probes cost 5% of the time, not 2x further."""
    from dspark_jax.engine.fallback import PROBE_COST_SHARE

    gate = PlainStepGate()
    assert feed(gate, 2 + PROBE_EVERY, round_s=1.5, plain_s=0.5, tau=1.0) == "Rp" + "p" * (PROBE_EVERY - 1) + "R"
    assert gate.probe_every == int(np.ceil(1.0 / (PROBE_COST_SHARE * 0.5))) > 2 * PROBE_EVERY


def test_gate_probe_interval_is_capped_and_resets_when_a_probe_wins():
    gate = PlainStepGate(round_s=1.0, plain_s=0.5, tau=1.0)
    feed(gate, 2000, round_s=1.0, plain_s=0.5, tau=1.0)
    assert gate.probe_every == PROBE_EVERY_MAX
    feed(gate, 3 * PROBE_EVERY_MAX, round_s=1.0, plain_s=0.5, tau=4.0)  # the text got easy: rounds pay again
    assert gate.probe_every == PROBE_EVERY and not gate.plain_now()


def test_gate_leaves_out_times_it_is_told_are_unfair():
    """A program's first execution (None seconds) teaches tau and counts its steps but not its cost;
    a probe that wins by its own tau brings the probes back at once."""
    gate = PlainStepGate(round_s=1.0, plain_s=0.5, tau=1.0)
    gate.observe_round(None, np.array([3.0]))
    assert gate.round_s == 1.0 and gate.tau > 1.0 and gate.rounds == 1
    gate.observe_plain(None, steps=4)
    assert gate.plain_s == 0.5 and gate.plain_steps == 4
    gate.probe_every = PROBE_EVERY_MAX
    gate.observe_round(1.0, np.array([4.0]))  # the running tau is still below break-even (2) ...
    assert gate.tau < 2.0 and gate.probe_every == PROBE_EVERY  # ... but this probe paid


class TimedGate(ScriptedGate):
    """ScriptedGate that records the seconds the engine reports for each step."""

    def __init__(self, pattern):
        super().__init__(pattern)
        self.seen = {"round": [], "plain": []}

    def observe_round(self, seconds, tokens_per_request, expected_per_request=None):
        self.seen["round"].append(seconds)
        super().observe_round(seconds, tokens_per_request, expected_per_request)

    def observe_plain(self, seconds, steps=1):
        self.seen["plain"].append(seconds)
        super().observe_plain(seconds, steps)


@pytest.mark.parametrize("cfg", [SpecConfig(gamma=4), bucketed(policy="fixed")], ids=["padded", "bucketed"])
def test_first_execution_of_each_program_is_not_timed(cfg):
    dcfg, dparams = drafter()
    gate = TimedGate(ALTERNATE)
    speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=20, gate=gate, cfg=cfg)
    programs = {"round": len(cfg.verify_buckets or [None]), "plain": 1}  # a verify program per bucket
    for kind, seconds in gate.seen.items():
        assert seconds[0] is None, kind
        untimed = sum(s is None for s in seconds)
        assert untimed <= programs[kind] < len(seconds) and all(s is None or s > 0 for s in seconds), (kind, seconds)


def test_gate_priors_come_from_the_sps_table():
    table = SPSTable(buckets=(1, 2, 4, 8, 10), sps=(50.0, 48.0, 45.0, 40.0, 20.0), plain_sps=40.0)
    gate = PlainStepGate.from_table(table, rows=2, gamma=4)  # a full round: 10 tokens, 20 rounds/s
    assert gate.round_s == pytest.approx(0.05) and gate.plain_s == pytest.approx(0.025)
    assert PlainStepGate.from_table(SPSTable(buckets=(1, 2), sps=(5.0, 4.0)), rows=1, gamma=1).plain_s is None
    assert PlainStepGate.from_table(None, rows=1, gamma=1).round_s is None


def test_sps_table_keeps_the_plain_step_cost(tmp_path):
    path = tmp_path / "t.json"
    table = SPSTable(buckets=(1, 2), sps=(5.0, 4.0), device="cpu", model="m", plain_sps=9.0)
    save_sps_table(path, table)
    assert load_sps_table(path) == table
    old = json.loads(path.read_text())
    del old["plain_sps"]  # a table profiled before plain steps existed still loads
    path.write_text(json.dumps(old))
    assert load_sps_table(path).plain_sps is None
    with pytest.raises(ValueError, match="plain_sps must be finite and > 0"):
        SPSTable(buckets=(1,), sps=(1.0,), plain_sps=0.0)


@pytest.mark.parametrize("buckets", [None, (4, 8, 15)], ids=["padded", "flattened"])
def test_the_engine_builds_its_own_gate(buckets):
    """SpecConfig(plain_steps=True) without a gate: the engine's own (timed on this machine, so the
    mix of rounds and plain steps varies), with either verify layout; the output is the target's."""
    cfg = SpecConfig(gamma=4, plain_steps=True, verify_buckets=buckets, policy="dspark", sps=SPS)
    dcfg, dparams = drafter()
    got = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=12, cfg=cfg)
    assert got.token_ids == generate(TARGET, TCFG, PROMPTS, max_new_tokens=12).token_ids
    assert got.plain_steps >= 1  # the gate measures a plain step early on


def test_the_decode_engine_keeps_its_gate_across_batches(tiny_target_folder, tiny_drafter):
    """`decode`'s engine keeps one gate per (rows, greedy): the second batch starts from what the
    first learned (no measuring round again), and every batch's output is still the target's."""
    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.engine.decode_settings import DecodeSettings
    from dspark_jax.engine.speculative_run import load_speculative

    target = load_target(tiny_target_folder)
    settings = DecodeSettings(drafter=tiny_drafter, scheduler="fixed", max_batch=2, max_new_tokens=10, json=True,
                              plain_steps="on")
    engine = load_speculative(settings, target)
    prompts = [[5, 6, 7], [9, 3]]
    greedy = SamplingConfig()
    first = engine(prompts, greedy, seed=0)
    gate = engine.gates[(2, True)]
    learned = (gate.tau, gate.rounds + gate.plain_steps)
    assert learned[0] is not None and learned[1] > 0
    second = engine([[4, 4, 8], [2, 11]], greedy, seed=0)
    assert engine.gates[(2, True)] is gate and gate.rounds + gate.plain_steps > learned[1]
    assert first.token_ids == generate(target.params, target.config, prompts, max_new_tokens=10).token_ids
    assert second.token_ids == generate(target.params, target.config, [[4, 4, 8], [2, 11]],
                                        max_new_tokens=10).token_ids
    engine(prompts, SamplingConfig(1.0), seed=0)  # sampled batches have their own gate
    assert set(engine.gates) == {(2, True), (2, False)}


def test_an_untimed_gate_decides_from_its_priors_and_tau_alone():
    """timed=False (the tensor layout's processes): the same choices whatever each process's clock
    says, from the table's costs and the (shared) tau; without a plain-step prior, rounds only."""
    runs = {feed(PlainStepGate(round_s=1.0, plain_s=0.5, timed=False), 300, round_s=r, plain_s=p, tau=1.2)
            for r, p in [(1.0, 0.5), (0.1, 5.0), (9.0, 0.01)]}
    assert len(runs) == 1 and "p" in next(iter(runs)) and "R" in next(iter(runs))
    assert feed(PlainStepGate(round_s=1.0, timed=False), 50, round_s=1.0, plain_s=0.1, tau=1.0) == "R" * 50
    timed = {feed(PlainStepGate(round_s=1.0, plain_s=0.5), 300, round_s=r, plain_s=p, tau=1.2)
             for r, p in [(1.0, 0.5), (0.1, 5.0)]}
    assert len(timed) == 2  # (the timed gate does follow its clock)
