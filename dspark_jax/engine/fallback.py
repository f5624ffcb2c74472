"""When drafting does not pay, plain target steps instead of speculative rounds (DESIGN.md 3.3b).

A round costs the drafter's pass plus a verify pass and commits tau tokens per request; a plain
step costs one target pass and commits exactly one. `PlainStepGate` keeps running estimates of
tau (with a confidence head: the head's forecasts for the rounds run so far, corrected by what they
committed; without one: the tokens committed), of a round's seconds and of a plain step's seconds
(timed on this machine; the SPS table's profiled costs are only priors), and before each step
picks the one with the higher expected tokens per second. While plain steps win, a round is run
now and then (every `probe_every` plain steps, spaced out while probes keep losing, up to 64) so
that a drafter that starts paying again — easier text later in the response — is noticed.

Lossless by construction: the choice for step t is made from steps before t only (never from
step t's draft), and a plain step emits exactly the target's next token (the target's own decode
pass: greedy the argmax, sampled a draw from the processed target distribution).
"""

from __future__ import annotations

import dataclasses

import numpy as np

PROBE_EVERY = 8  # plain steps before the first re-probe
PROBE_EVERY_MAX = 64  # the re-probe interval doubles up to this while probes lose
PROBE_COST_SHARE = 0.05  # ... and a losing probe sets it at once to where probes cost at most this
SMOOTHING = 0.3  # weight of the newest observation in the running estimates of seconds
# ... and of tau: one round's tau is a noisy draw (a geometric-like count, sd ~1-1.5 at tau ~2), so
# its estimate averages over ~10 rounds; at 0.3 two early rejections in a row swung it below the
# break-even of a drafter that pays on average (measured: math, tau 2.1, 75% plain steps).
TAU_SMOOTHING = 0.1
# With a confidence head the gate follows its forecast of each round's tau (see `observe_round`): this
# much weight on the newest, and a prior of this many tokens on "the forecast is right".
FORECAST_SMOOTHING = 0.3
FORECAST_PRIOR = 16.0


@dataclasses.dataclass
class PlainStepGate:
    """Host-side state of the round / plain-step choice for one batch of request slots.

    round_s / plain_s: seconds of a round / a plain step (priors; None = unknown, measured by
    running one); tau: tokens a request commits per round (bonus included). timed=False keeps the
    priors and learns tau alone: then every process of a multi-process run that decodes the same
    batch (the tensor layout) makes the same choices, which its collectives need, since each
    process's own clock would not."""

    round_s: float | None = None
    plain_s: float | None = None
    tau: float | None = None
    probe_every: int = PROBE_EVERY
    # a round / a plain step timed here: until then round_s / plain_s are the table's priors
    round_timed: bool = False
    plain_timed: bool = False
    # with a confidence head: the smoothed forecast tau, and the tokens committed and forecast so far
    forecast: float | None = None
    committed_sum: float = 0.0
    forecast_sum: float = 0.0
    plain_run: int = 0  # plain steps since the last round
    rounds: int = 0
    plain_steps: int = 0
    timed: bool = True

    @classmethod
    def from_table(cls, table, rows: int, gamma: int, timed: bool = True) -> "PlainStepGate":
        """Priors from an SPS table: a round at the full verify bucket, and the table's plain-step
        cost when it was profiled with one."""
        from dspark_jax.engine.sps import sps_of

        full = float(sps_of(table, min(rows * (gamma + 1), table.max_tokens))) if table is not None else 0.0
        plain = getattr(table, "plain_sps", None)
        return cls(round_s=1.0 / full if full > 0 else None, plain_s=1.0 / plain if plain else None, timed=timed)

    def plain_run_length(self) -> int:
        """How many plain steps to run next before deciding again (0: a round next). A run ends
        where the next re-probe is due, so running it in one program changes no decision."""
        if not self.plain_now():
            return 0
        if not self.plain_timed:
            return 1  # the first one is measured alone
        return max(1, self.probe_every - self.plain_run)

    def plain_now(self) -> bool:
        """Run a plain step (True) or a round (False) next."""
        if self.tau is None or self.round_s is None:
            return False  # nothing known about the drafter yet: measure a round
        if self.timed and not self.plain_timed:
            # measure a plain step once even with a prior: a table profiled on a busy machine, or at
            # another context length, can price plain steps so high that they would never be tried
            return True
        if self.plain_s is None:
            return False  # untimed and no prior: nothing to compare with, rounds only
        if self.tau * self.plain_s >= self.round_s:  # tau / round_s >= 1 / plain_s: rounds pay
            return False
        return self.plain_run < self.probe_every

    def observe_round(self, seconds: float | None, tokens_per_request: np.ndarray,
                      expected_per_request: np.ndarray | None = None) -> None:
        """A round took `seconds` (None: not a fair measure, e.g. its program's first execution) and
        its active requests committed these many tokens each; `expected_per_request`, with a
        confidence head, is what the head forecast for them (1 + the prefix survival of the drafts
        verified)."""
        tokens = np.asarray(tokens_per_request, np.float64)
        own = None  # this round's tau as the gate counts it
        if tokens.size and expected_per_request is None:
            own = float(tokens.mean())
            self.tau = _smooth(self.tau, own, TAU_SMOOTHING)
        elif tokens.size:
            # One round's committed tokens are a noisy draw (sd ~1-1.5 at tau ~2); the head's
            # forecast of them is not (measured: correlation 0.8 round by round on math and code).
            # So the gate follows the forecast, lightly smoothed, scaled by how the tokens committed
            # so far compare with what was forecast for them (shrunk towards 1 while few are in).
            expected = np.asarray(expected_per_request, np.float64)
            self.committed_sum += float(tokens.sum())
            self.forecast_sum += float(expected.sum())
            bias = (self.committed_sum + FORECAST_PRIOR) / (self.forecast_sum + FORECAST_PRIOR)
            own = bias * float(expected.mean())
            self.forecast = _smooth(self.forecast, float(expected.mean()), FORECAST_SMOOTHING)
            self.tau = bias * self.forecast
        if self.timed and seconds is not None:
            self.round_s = _smooth(self.round_s if self.round_timed else None, seconds)
            self.round_timed = True
        if self.plain_run and own is not None and self.plain_s is not None:
            # a re-probe: back off while probes lose (by their own tau), at once to the interval where
            # what a probe loses is at most PROBE_COST_SHARE of the plain steps around it (a losing
            # round at 8 slots costs ~1.5 plain steps, at batch 1 ~0.6)
            loss = self.round_s - own * self.plain_s
            priced = int(np.ceil(loss / (PROBE_COST_SHARE * self.plain_s))) if loss > 0 else 0
            self.probe_every = (min(max(2 * self.probe_every, priced), PROBE_EVERY_MAX) if loss > 0
                                else PROBE_EVERY)
        self.plain_run = 0
        self.rounds += 1

    def observe_plain(self, seconds: float | None, steps: int = 1) -> None:
        """`steps` plain steps (run in one program) took `seconds` together (None: not timed fairly)."""
        if steps < 1:
            return
        if self.timed and seconds is not None:
            # the first timing replaces the prior outright: the table's cost is only a stand-in
            self.plain_s = _smooth(self.plain_s if self.plain_timed else None, seconds / steps)
            self.plain_timed = True
        self.plain_run += steps
        self.plain_steps += steps


def _smooth(old: float | None, new: float, weight: float = SMOOTHING) -> float:
    return new if old is None else (1 - weight) * old + weight * new
