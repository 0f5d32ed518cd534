"""The speculation controller (services/engine/controller.py) on synthetic statistics and costs.

Pure functions, no models: acceptance 0 gives k = 0, acceptance near 1 with a cheap draft gives
kmax, a compute-bound verify makes k shrink as the batch grows; and properties over random inputs
(k within its bounds, the decision is no worse than any fixed k, more acceptance never gives less).
"""

from __future__ import annotations

import numpy as np
import pytest

from specd.services.engine import controller as controller_module
from specd.services.engine.controller import (
    MODEL,
    NGRAM,
    Choice,
    ControllerConfig,
    CostModel,
    RowPlan,
    SeqAcceptance,
    SpeculationController,
    _chained,
    _choose_few,
    choose_blocks,
    choose_seeded,
    expected_tokens,
    plain_choice,
)

KMAX = 6
_NO_EXPLORATION_KW = dict(
    explore_width=0.0,
    explore_anywhere=0.0,
    explore_anywhere_young=0.0,
    explore_width_alone=0.0,
    explore_anywhere_alone=0.0,
    explore_start=0.0,
    explore_resting=0.0,
    explore_plain=0.0,
    explore_new_batch=False,
)
_NO_EXPLORATION = ControllerConfig(**_NO_EXPLORATION_KW)
# A GPU at small batch: verification is memory-bound (a guess token costs ~nothing), draft steps cheap.
MEMORY_BOUND = CostModel(v0=10e-3, v_row=0.05e-3, v_token=0.01e-3, d0=0.1e-3, d_step=0.5e-3, d_step_row=0.0)
# A CPU (or a GPU at large batch): every verified token costs compute.
COMPUTE_BOUND = CostModel(v0=2e-3, v_row=0.2e-3, v_token=1.0e-3, d0=0.1e-3, d_step=0.5e-3, d_step_row=0.05e-3)


def _choose(acc, cost, B=1, match=0, model=True, cap=KMAX, **kw):
    acceptance = np.broadcast_to(np.asarray(acc, dtype=float), (B, 2, KMAX)).copy()
    return choose_blocks(acceptance, np.full(B, match), np.full(B, model, dtype=bool), np.full(B, cap), cost, **kw)


def test_expected_tokens_is_the_leviathan_formula() -> None:
    a = 0.7
    e = expected_tokens(np.full(KMAX, a))
    for k in range(KMAX + 1):
        assert e[k] == pytest.approx((1 - a ** (k + 1)) / (1 - a))


def test_acceptance_zero_gives_k_zero() -> None:
    for cost in (MEMORY_BOUND, COMPUTE_BOUND):
        for B in (1, 8):
            ch = _choose(0.0, cost, B=B, match=KMAX)
            assert (ch.ks == 0).all() and (ch.drafters == -1).all() and ch.width == 0 and ch.model_steps == 0


def test_acceptance_near_one_and_cheap_draft_gives_kmax() -> None:
    ch = _choose(0.99, MEMORY_BOUND, B=4)
    assert (ch.ks == KMAX).all() and (ch.drafters == MODEL).all()
    # n-gram matches are free to draft: with a full match the n-gram is preferred (no draft steps).
    ch = _choose(0.99, MEMORY_BOUND, B=4, match=KMAX)
    assert (ch.ks == KMAX).all() and (ch.drafters == NGRAM).all() and ch.model_steps == 0


def test_compute_bound_verify_makes_k_shrink_as_the_batch_grows() -> None:
    widths = [_choose(0.75, COMPUTE_BOUND, B=B).width for B in (1, 2, 4, 8, 16, 32, 64)]
    assert widths[0] >= 2, widths
    assert all(a >= b for a, b in zip(widths, widths[1:])), widths
    assert widths[-1] == 0, widths  # under load speculation goes off
    # Memory-bound verification keeps speculating at the same batch sizes.
    assert all(_choose(0.75, MEMORY_BOUND, B=B).width >= 3 for B in (1, 64))


def test_row_caps_and_ngram_match_lengths_bound_k() -> None:
    B = 5
    acc = np.full((B, 2, KMAX), 0.95)
    cap = np.array([0, 1, 2, 6, 6])
    match = np.array([6, 6, 1, 0, 3])
    ch = choose_blocks(acc, match, np.array([True, True, True, False, False]), cap, MEMORY_BOUND)
    assert (ch.ks <= cap).all()
    no_model = np.array([False, False, False, True, True])
    assert (ch.ks[no_model] <= match[no_model]).all()
    assert ch.ks[0] == 0 and ch.ks[3] == 0  # capped at 0 / no drafter at all
    assert (ch.drafters[3] == -1) and ch.drafters[4] == NGRAM and ch.ks[4] == 3


def test_each_row_takes_the_drafter_that_it_accepts_more_from() -> None:
    acc = np.zeros((2, 2, KMAX))
    acc[0, NGRAM], acc[0, MODEL] = 0.95, 0.2  # a row that repeats its context: n-gram
    acc[1, NGRAM], acc[1, MODEL] = 0.1, 0.9  # prose: the draft model
    ch = choose_blocks(acc, np.array([KMAX, KMAX]), np.array([True, True]), np.array([KMAX, KMAX]), MEMORY_BOUND)
    assert ch.drafters.tolist() == [NGRAM, MODEL] and (ch.ks > 0).all()


def test_forced_rows_set_a_minimum_width_and_are_kept() -> None:
    B = 3
    acc = np.full((B, 2, KMAX), 0.0)
    ch = choose_blocks(
        acc,
        np.zeros(B, int),
        np.ones(B, bool),
        np.full(B, KMAX),
        COMPUTE_BOUND,
        forced_k=np.array([4, -1, -1]),
        forced_drafter=np.array([MODEL, -1, -1]),
    )
    assert ch.ks.tolist() == [4, 0, 0] and ch.drafters[0] == MODEL and ch.width == 4 and ch.model_steps == 4


def _goodput(acc, match, model_ok, cap, cost, ks, drafters, catch_up=None) -> float:
    E = expected_tokens(acc)
    rows = np.arange(len(ks))
    tokens = np.where(drafters >= 0, E[rows, np.maximum(drafters, 0), ks], 1.0).sum()
    width = int(ks.max())
    used = drafters == MODEL
    steps = int(ks[used].max()) if used.any() else 0
    caught_up = int(catch_up[used].sum()) if catch_up is not None else 0
    return tokens / (cost.verify(len(ks), width) + cost.draft(steps, int(used.sum()), caught_up))


def _random_cost(rng: np.random.Generator) -> CostModel:
    scale = np.array([10, 1, 1, 1, 3, 0.5, 0.3]) * 1e-3
    v0, v_row, v_token, d0, d_step, d_step_row, d_catch = rng.uniform(0, 1, 7) * scale + 1e-6
    return CostModel(v0, v_row, v_token, d0, d_step, d_step_row, d_catch=d_catch)


def _random_context_cost(rng: np.random.Generator, staircase: bool, per_row_steps: bool = True) -> CostModel:
    """_random_cost with a price per cached token and, where ``staircase``, deviations by verified
    tokens (CostModel.by_tokens); ``per_row_steps`` False drops the draft's per-row step cost."""
    base = _random_cost(rng)
    steps = list(rng.uniform(-2e-4, 2e-4, int(rng.integers(1, 60)))) if staircase else None
    return CostModel(
        base.v0, base.v_row, base.v_token, base.d0, base.d_step, base.d_step_row * per_row_steps,
        v_key=float(rng.uniform(0, 1e-6)), d_catch=base.d_catch, by_tokens=steps,
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(40))
def test_properties_on_random_batches(seed: int) -> None:
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 40))
    acc = rng.uniform(0, 1, (B, 2, KMAX)) ** rng.uniform(0.2, 3)
    match = rng.integers(0, KMAX + 1, B)
    model_ok = rng.random(B) < 0.7
    cap = rng.integers(0, KMAX + 1, B)
    cost = _random_cost(rng)
    # Tokens each row would catch up on the draft model (most none, some after rounds sat out).
    catch_up = np.where(rng.random(B) < 0.3, rng.integers(1, 60, B), 0)
    ch = choose_blocks(acc, match, model_ok, cap, cost, catch_up=catch_up)
    # Bounds: 0 <= k <= cap; n-gram rows within their match; model rows only where allowed.
    assert ((ch.ks >= 0) & (ch.ks <= cap)).all()
    ng, md = ch.drafters == NGRAM, ch.drafters == MODEL
    assert (ch.ks[ng] <= match[ng]).all() and model_ok[md].all()
    assert ((ch.ks > 0) == (ch.drafters >= 0)).all()
    assert ch.width == (int(ch.ks.max()) if B else 0)
    got = _goodput(acc, match, model_ok, cap, cost, ch.ks, ch.drafters, catch_up)
    assert got == pytest.approx(ch.goodput, rel=1e-9)
    # No worse than speculation off, nor than any fixed k with the better drafter per row.
    for k in range(KMAX + 1):
        for who in (NGRAM, MODEL):
            ks = np.minimum(np.minimum(cap, k), match if who == NGRAM else cap)
            if who == MODEL:
                ks = np.where(model_ok, ks, 0)
            dr = np.where(ks > 0, who, -1)
            assert got >= _goodput(acc, match, model_ok, cap, cost, ks, dr, catch_up) * (1 - 1e-9), (k, who)
    # Monotone: higher acceptance everywhere never gives a narrower block.
    ch_up = choose_blocks(np.sqrt(acc), match, model_ok, cap, cost, catch_up=catch_up)
    assert ch_up.width >= ch.width and ch_up.expected_tokens >= ch.expected_tokens - 1e-9


@pytest.mark.parametrize("seed", range(20))
def test_a_few_rows_are_chosen_in_plain_python_as_by_the_arrays(seed: int) -> None:
    """_choose_few (a batch of up to FEW_ROWS free rows, plain Python) makes choose_blocks' decision:
    the same ks, drafters, width and steps, and the same expected tokens and cost, with width
    ranges, context, catch-ups and a staircase in the cost."""
    rng = np.random.default_rng(300 + seed)
    for case in range(25):
        B = int(rng.integers(2, controller_module.FEW_ROWS + 1))
        acc = rng.uniform(0, 1, (B, 2, KMAX)) ** rng.uniform(0.2, 3)
        match = rng.integers(0, KMAX + 3, B)
        model_ok = rng.random(B) < 0.7
        cap = rng.integers(0, KMAX + 1, B)
        cost = _random_context_cost(rng, staircase=case % 2 == 1, per_row_steps=case % 3 > 0)
        catch_up = np.where(rng.random(B) < 0.3, rng.integers(1, 60, B), 0) / 8.0
        keys = int(rng.integers(0, 3000))
        width_range = None
        if case % 3 == 0:
            w = int(rng.integers(1, KMAX + 1))
            width_range = (w, w)
        want = choose_blocks(acc, match, model_ok, cap, cost, width_range=width_range, keys=keys, catch_up=catch_up)
        got = _choose_few(
            acc.tolist(), match.tolist(), model_ok.tolist(), cap.tolist(), cost, width_range, keys, catch_up.tolist()
        )
        assert (got.ks.tolist(), got.drafters.tolist()) == (want.ks.tolist(), want.drafters.tolist()), case
        assert (got.width, got.model_steps) == (want.width, want.model_steps)
        assert got.expected_tokens == pytest.approx(want.expected_tokens, rel=1e-12)
        assert got.expected_cost == pytest.approx(want.expected_cost, rel=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_a_plain_round_is_priced_as_the_grid_held_at_width_zero(seed: int) -> None:
    """plain_choice (the plain round a batch's choice must beat by batch_margin) is what choose_blocks
    and _choose_few choose with the width held at 0: no guesses, a token per row, the same cost."""
    rng = np.random.default_rng(700 + seed)
    for case in range(20):
        B = int(rng.integers(2, 20))
        acc = rng.uniform(0, 1, (B, 2, KMAX))
        match = rng.integers(0, KMAX + 3, B)
        model_ok = rng.random(B) < 0.7
        cap = rng.integers(0, KMAX + 1, B)
        cost = _random_context_cost(rng, staircase=case % 2 == 1)
        keys = int(rng.integers(0, 3000))
        got = plain_choice(B, cost, keys)
        grids = [choose_blocks(acc, match, model_ok, cap, cost, width_range=(0, 0), keys=keys)]
        if B <= controller_module.FEW_ROWS:
            grids.append(_choose_few(acc.tolist(), match.tolist(), model_ok.tolist(), cap.tolist(), cost, (0, 0), keys))
        for want in grids:
            assert (got.ks.tolist(), got.drafters.tolist()) == (want.ks.tolist(), want.drafters.tolist())
            assert (got.width, got.model_steps) == (want.width, want.model_steps) == (0, 0)
            assert got.expected_tokens == want.expected_tokens == B
            assert got.expected_cost == pytest.approx(want.expected_cost, rel=1e-12)


@pytest.mark.parametrize("rows", [2, 5, 8])
def test_the_controller_plans_a_few_rows_as_it_plans_many(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """plan() takes the plain-Python path for a few rows; two controllers with one history, one of
    them made to take the array path, choose alike round after round (exploration included)."""
    rng = np.random.default_rng(rows)
    twins = [SpeculationController(), SpeculationController()]
    seqs = [[SeqAcceptance(16) for _ in range(rows)] for _ in twins]
    greedy = [bool(g) for g in rng.random(rows) < 0.5]
    for rnd in range(120):
        match = [int(m) for m in rng.integers(0, KMAX + 1, rows)]
        model_ok = [bool(m) for m in rng.random(rows) < 0.8]
        catch_up = [int(c) for c in rng.integers(0, 20, rows) * (rng.random(rows) < 0.2)]
        choices = []
        for twin, few_rows in ((0, controller_module.FEW_ROWS), (1, 0)):
            monkeypatch.setattr(controller_module, "FEW_ROWS", few_rows)
            plans = [
                RowPlan(seqs[twin][i], greedy[i], KMAX, match[i], model_ok[i], context=200 + rnd, catch_up=catch_up[i])
                for i in range(rows)
            ]
            choices.append(twins[twin].plan(plans, KMAX))
        a, b = choices
        assert (a.ks.tolist(), a.drafters.tolist(), a.width, a.model_steps) == (
            b.ks.tolist(),
            b.drafters.tolist(),
            b.width,
            b.model_steps,
        ), rnd
        # Both see the same outcome of the round.
        passed = [int(min(k, rng.integers(0, KMAX + 1))) for k in a.ks]
        width_seconds = 4e-3 + rows * (a.width + 1) * rng.uniform(0.3e-3, 0.6e-3)
        for twin in (0, 1):
            twins[twin].observe_rows(
                [(seqs[twin][i], greedy[i], int(a.drafters[i]), int(a.ks[i]), passed[i]) for i in range(rows)]
            )
            twins[twin].observe_costs(
                rows, a.width, width_seconds, a.model_steps, rows, 1e-3 * a.model_steps, 200 + rnd
            )
    assert twins[0].stats.explored == twins[1].stats.explored > 0


def test_controller_learns_acceptance_and_costs_from_rounds() -> None:
    """Statistics in, k out: a sequence whose guesses always fail goes to k = 0; one whose guesses
    always pass goes wide; a verify that grows steeply with the tokens pulls the width down."""
    ctl = SpeculationController()
    good, bad = SeqAcceptance(16), SeqAcceptance(16)
    rows = [RowPlan(good, True, KMAX, 0, True), RowPlan(bad, True, KMAX, 0, True)]
    for _ in range(30):
        ch = ctl.plan(rows, KMAX)
        k = ch.ks.tolist()
        ctl.observe_rows([(good, True, MODEL, k[0], k[0]), (bad, True, MODEL, k[1], 0)])
        # Memory-bound timings: the width costs almost nothing.
        ctl.observe_costs(2, ch.width, 10e-3 + 0.01e-3 * 2 * (ch.width + 1), ch.model_steps, 2, 0.3e-3 * ch.model_steps)
    est_good = ctl.seq_acceptance(good, ctl.global_acceptance(True))[MODEL, 0]
    est_bad = ctl.seq_acceptance(bad, ctl.global_acceptance(True))[MODEL, 0]
    assert est_good > 0.8 and est_bad < 0.5
    final = ctl.plan(rows, KMAX)
    assert final.ks[0] == KMAX
    # Now a compute-bound regime (a large batch on a CPU): 64 rows, each verified token 1 ms.
    seqs = [SeqAcceptance(16) for _ in range(64)]
    batch = [RowPlan(s, True, KMAX, 0, True) for s in seqs]
    for _ in range(150):
        ch = ctl.plan(batch, KMAX)
        ctl.observe_rows([(s, True, MODEL, int(k), int(k) // 2) for s, k in zip(seqs, ch.ks)])
        t = 2e-3 + 1e-3 * 64 * (ch.width + 1)
        ctl.observe_costs(64, ch.width, t, ch.model_steps, 64, 1e-3 * ch.model_steps)
    assert ctl.plan(batch, KMAX).width <= 1


def test_a_row_far_behind_on_the_draft_model_pays_its_catch_up() -> None:
    """A row the draft model has not seen for a while must be fed those tokens before it gets a
    guess: a row whose gain is small stays off the model while a caught-up row with the same
    acceptance uses it, alone (the plain-Python path) and in a batch; where the gain is large the
    catch-up is worth paying."""
    draft = dict(d0=0.5e-3, d_step=0.3e-3, d_step_row=0.05e-3, d_catch=0.1e-3)
    cost = CostModel(v0=5e-3, v_row=0.1e-3, v_token=0.3e-3, **draft)
    for B in (1, 8):
        fresh = _choose(0.5, cost, B=B, cap=2)
        behind = _choose(0.5, cost, B=B, cap=2, catch_up=np.full(B, 60.0))
        assert (fresh.drafters == MODEL).all() and (fresh.ks > 0).all(), fresh
        assert (behind.ks == 0).all() and behind.model_steps == 0, behind
        # Near-certain guesses are worth catching up for.
        assert (_choose(0.98, cost, B=B, cap=KMAX, catch_up=np.full(B, 5.0)).drafters == MODEL).all()
    # Half a batch behind, where a wider verify costs little (else the rows behind, verified at
    # the round's width for nothing, make speculating nowhere the better round): only the
    # caught-up rows draft.
    cheap_width = CostModel(v0=5e-3, v_row=0.1e-3, v_token=0.02e-3, **draft)
    mixed = _choose(0.5, cheap_width, B=8, cap=2, catch_up=np.array([0.0, 60.0] * 4))
    assert mixed.drafters.tolist() == [MODEL, -1] * 4, mixed
    assert (_choose(0.5, cheap_width, B=8, cap=2).drafters == MODEL).all()


def test_the_controller_spreads_a_catch_up_over_the_rounds_it_pays_for() -> None:
    """RowPlan.catch_up is priced at 1 / catch_up_rounds a round: a row that sat out a stretch comes
    back where the rounds ahead repay it, which a one-round price would never allow."""
    seq = SeqAcceptance(KMAX)
    for rounds, expected in ((1.0, -1), (8.0, MODEL)):
        # No margin: the batch of 2 shows the price itself.
        ctl = SpeculationController(ControllerConfig(catch_up_rounds=rounds, batch_margin=0.0, **_NO_EXPLORATION_KW))
        for batch in (1, 2):  # the plain-Python path and the batched one
            rows = [RowPlan(seq, True, 3, 0, True, context=100, catch_up=150) for _ in range(batch)]
            assert set(ctl.plan(rows, 3).drafters.tolist()) == {expected}, (rounds, batch)


@pytest.mark.parametrize("seed", range(16))
def test_the_cost_fit_keeps_its_line_when_a_coefficient_would_go_negative(seed: int) -> None:
    """A batch of 4 that mostly verifies a width of 2, whose context drifts (rows grow, finish and
    are replaced) but costs nothing: the unconstrained fit trades a negative cost per cached token
    against a larger fixed cost, and clamping that one coefficient to 0 had lifted the whole line
    (4 of these 16 seeds failed; a like simulation had prices 56-89% off in 5 of 16 seeds and 73x in
    one). Held at 0 and the rest refitted, every price stays within 50% of the truth (the timings
    are +-20%)."""
    rng = np.random.default_rng(seed)
    ctl = SpeculationController()
    ctx = rng.integers(100, 400, 4)
    worst = 0.0

    def truth(width: int) -> float:
        return 3.6e-3 + 1.6e-3 * 4 * (width + 1)

    for i in range(300):
        w = int(rng.choice([0, 1, 2], p=[0.05, 0.10, 0.85]))
        draft = (1.5e-3 + 2.5e-3 * w) * rng.lognormal(0, 0.2) if w else 0.0
        ctl.observe_costs(4, w, truth(w) * rng.lognormal(0, 0.2), w, 4 if w else 0, draft, int(ctx.sum()))
        ctx += 1 + rng.integers(0, w + 1, 4)
        done = rng.random(4) < 0.02
        ctx[done] = rng.integers(100, 400, int(done.sum()))
        if i >= 100 and i % 20 == 0:
            cost = ctl.cost_model()
            for width in (0, 2):
                worst = max(worst, abs(cost.verify(4, width, int(ctx.sum())) / truth(width) - 1))
    assert worst < 0.5


def test_the_cost_fit_learns_the_price_of_catching_up() -> None:
    """Draft timings with and without catch-up tokens: the fit separates their price from a step's."""
    ctl = SpeculationController(_NO_EXPLORATION)
    rng = np.random.default_rng(0)
    d0, d_step_row, d_catch = 1e-3, 0.1e-3, 0.05e-3
    for i in range(400):
        rows, steps = int(rng.integers(1, 32)), int(rng.integers(1, 5))
        caught_up = int(rng.integers(0, 300)) if i % 3 == 0 else 0
        draft = d0 + steps * d_step_row * rows + d_catch * caught_up
        ctl.observe_costs(rows, steps, 5e-3 + 0.2e-3 * rows * (steps + 1), steps, rows, draft, 0, caught_up)
    cost = ctl.cost_model()
    assert cost.d_catch == pytest.approx(d_catch, rel=0.15)
    assert cost.draft(3, 16) == pytest.approx(d0 + 3 * 16 * d_step_row, rel=0.15)


@pytest.mark.parametrize("second", [4.7e-3, 2.0e-3])
def test_a_fixed_cost_fitted_onto_the_context_does_not_price_the_draft_at_nothing(second: float) -> None:
    """Two plain rounds of two rows whose context differs by two tokens and whose times differ
    (as the stack's first timed rounds of a demo warm-up did: 3 and 5 ms): the fit may put the
    whole round on the context and none on the fixed cost. The draft model, not yet timed, is
    still priced at the prior's share of the measured level, and once timed at what it took. (At
    the fitted fixed cost's level it was priced at nothing, its first timings were clipped to
    that price, and it stayed free for the rest of the run.)"""
    ctl = SpeculationController(_NO_EXPLORATION)
    ctl.observe_costs(2, 0, 3e-3, 0, 0, 0.0, 300)
    ctl.observe_costs(2, 0, second, 0, 0, 0.0, 302)
    cost = ctl.cost_model()
    plain = cost.verify(2, 0, 302)
    untimed = cost.draft(3, 2)
    assert plain > 0 and 0.1 * plain < untimed < 2 * plain, (plain, untimed)
    for i in range(40):
        ctl.observe_costs(2, 3, 5e-3, 3, 2, 2.5e-3, 304 + 8 * i)
    assert ctl.cost_model().draft(3, 2) == pytest.approx(2.5e-3, rel=0.3)


def test_the_cost_fit_prices_the_tokens_a_packed_round_verifies() -> None:
    """Where the forward skips padding (rows verifying fewer guesses than the width), the round's
    timing is fitted against the tokens it computed, not rows x (width + 1): the fit recovers the
    per-token price, and a plan pricing every row at the full width prices an upper bound."""
    ctl = SpeculationController(_NO_EXPLORATION)
    rng = np.random.default_rng(1)
    v0, v_token = 5e-3, 1e-3
    for _ in range(300):
        rows, width = int(rng.integers(2, 16)), int(rng.integers(0, 5))
        # One row verifies the width, the others anywhere from none to all of it.
        guesses = [width] + [int(g) for g in rng.integers(0, width + 1, rows - 1)]
        tokens = sum(g + 1 for g in guesses)
        ctl.observe_costs(rows, width, v0 + v_token * tokens, 0, 0, 0.0, 0, 0, tokens)
    cost = ctl.cost_model()
    assert cost.v_token == pytest.approx(v_token, rel=0.05)
    assert cost.verify_tokens(8, 12) == pytest.approx(v0 + 12 * v_token, rel=0.05)
    assert cost.verify(8, 3) == pytest.approx(v0 + 32 * v_token, rel=0.05)


def test_a_batch_round_far_off_its_price_refits_the_cost_model_at_the_next_plan() -> None:
    """A round of a batch that took more than surprise_factor over (or under) its price makes the
    next plan refit, not the periodic refit up to refit_every rounds later; rounds shorter than
    surprise_seconds and a batch of one do not (their jitter would refit every few rounds)."""

    def settled(rows: int, seconds: float) -> tuple[SpeculationController, object]:
        ctl = SpeculationController(_NO_EXPLORATION)
        for _ in range(20):
            ctl.observe_costs(rows, 0, seconds, 0, 0, 0.0)
        return ctl, ctl.cost_model()

    ctl, model = settled(8, 0.1)
    ctl.observe_costs(8, 0, 0.11, 0, 0, 0.0)  # within the factor: the same prices
    assert ctl.cost_model() is model
    ctl.observe_costs(8, 0, 0.2, 0, 0, 0.0)
    refitted = ctl.cost_model()
    assert refitted is not model and refitted.verify(8, 0) > model.verify(8, 0)
    ctl, model = settled(8, 0.1)
    ctl.observe_costs(8, 0, 0.05, 0, 0, 0.0)  # far under its price: refitted too
    assert ctl.cost_model() is not model
    for rows, seconds in ((8, 5e-3), (1, 0.1)):
        ctl, model = settled(rows, seconds)
        ctl.observe_costs(rows, 0, 2 * seconds, 0, 0, 0.0)
        assert ctl.cost_model() is model, (rows, seconds)


def test_a_dropped_drafter_is_tried_again() -> None:
    """Estimates decay toward the engine-wide rate, which decays toward the prior: a sequence that
    stopped drafting after a bad stretch starts again once nothing holds its estimate down."""
    ctl = SpeculationController()
    seq = SeqAcceptance(16)
    rows = [RowPlan(seq, True, KMAX, 0, True)]
    ctl.observe_costs(1, 0, 10e-3, 0, 0, 0.0)
    for _ in range(10):
        ch = ctl.plan(rows, KMAX)
        ctl.observe_rows([(seq, True, MODEL, int(ch.ks[0]), 0)])
    # Off, but for the rare exploratory round (explore_start) that tries one guess.
    assert sum(int(ctl.plan(rows, KMAX).ks[0]) for _ in range(100)) <= 10
    ks = []
    for _ in range(400):
        ch = ctl.plan(rows, KMAX)
        ks.append(int(ch.ks[0]))
        ctl.observe_rows([(seq, True, MODEL if ch.ks[0] else -1, int(ch.ks[0]), int(ch.ks[0]))])
    assert ks[-1] > 0


def test_seeded_rows_are_planned_without_timings_or_batch() -> None:
    """A deterministic row gets the same k whatever the cost model and its batch mates say."""
    out = []
    for cost_t in (1e-3, 50e-3):
        ctl = SpeculationController()
        ctl.observe_costs(8, 0, cost_t, 0, 0, 0.0)
        seq = SeqAcceptance(16)
        mates = [RowPlan(SeqAcceptance(16), False, KMAX, 0, True) for _ in range(7)]
        ch = ctl.plan([RowPlan(seq, False, KMAX, 2, True, deterministic=True), *mates], KMAX)
        out.append((int(ch.ks[0]), int(ch.drafters[0])))
    assert out[0] == out[1] and out[0][0] > 0


@pytest.mark.parametrize("seed", range(40))
def test_a_seeded_row_drafts_its_fixed_k_or_nothing(seed: int) -> None:
    """choose_seeded: k is 0 or min(k, cap) from the model (the n-gram's match, up to it, where
    there is no model), whichever promises more goodput alone; nothing else, so seeded rows in
    one batch share their width."""
    rng = np.random.default_rng(300 + seed)
    acc = (rng.uniform(0, 1, (2, KMAX)) ** rng.uniform(0.2, 3)).tolist()
    match, model_ok, cap = int(rng.integers(0, KMAX + 1)), bool(rng.random() < 0.7), int(rng.integers(0, KMAX + 1))
    k = int(rng.integers(1, KMAX + 1))
    cost = _random_cost(rng)
    got_k, got_d = choose_seeded(acc, match, model_ok, cap, k, cost)
    drafter = MODEL if model_ok else NGRAM
    top = min(k, cap) if model_ok else min(k, cap, match)
    assert (got_k, got_d) in ((0, -1), (top, drafter)) and (got_k > 0) == (got_d >= 0)
    if top > 0:
        guessed = float(expected_tokens(np.array(acc[drafter][:top]))[-1])
        price = cost.verify(1, top) + (cost.draft(top, 1) if model_ok else 0.0)
        assert (got_k > 0) == (guessed / price > 1.0 / cost.verify(1, 0))


def test_a_seeded_row_with_failing_guesses_stops_guessing() -> None:
    """The way out stays: a seeded row whose guesses pass drafts its k; one whose guesses all fail
    drafts none."""
    ctl = SpeculationController()
    good, bad = SeqAcceptance(KMAX), SeqAcceptance(KMAX)
    for _ in range(30):
        ctl.observe_rows([(good, False, MODEL, 3, 3), (bad, False, MODEL, 3, 0)])
    ch = ctl.plan([RowPlan(good, False, KMAX, 0, True, deterministic=True)], KMAX)
    assert (int(ch.ks[0]), int(ch.drafters[0])) == (ctl.cfg.seeded_k, MODEL)
    ch = ctl.plan([RowPlan(bad, False, KMAX, 0, True, deterministic=True)], KMAX)
    assert int(ch.ks[0]) == 0


def test_a_seeded_row_is_planned_alike_alone_among_few_and_among_many() -> None:
    """The same seeded row's plan alone (its own fast path), beside a few free rows and beside
    many seeded rows."""
    rng = np.random.default_rng(7)
    ctl = SpeculationController()
    seq = SeqAcceptance(KMAX)
    for _ in range(40):
        k = int(rng.integers(1, KMAX + 1))
        ctl.observe_rows([(seq, False, MODEL, k, int(rng.integers(0, k + 1)))])

    def seeded(s: SeqAcceptance) -> RowPlan:
        return RowPlan(s, False, KMAX, 2, True, deterministic=True)

    plans = []
    for mates in (
        [],
        [RowPlan(SeqAcceptance(KMAX), False, KMAX, 0, True) for _ in range(3)],
        [seeded(SeqAcceptance(KMAX)) for _ in range(controller_module.FEW_ROWS + 4)],
    ):
        ch = ctl.plan([seeded(seq), *mates], KMAX)
        plans.append((int(ch.ks[0]), int(ch.drafters[0])))
    assert plans[0] == plans[1] == plans[2] and plans[0][0] > 0


def test_a_seeded_row_learns_its_later_positions_from_its_own_longer_history() -> None:
    """Conditional acceptance rises with the position (a guess that follows passed ones is easier).
    A seeded row may not borrow the engine-wide rate, so its short memory is pulled toward its own
    longer one; pulled toward the fixed prior instead, the positions after the first inherited the
    first's lower estimate and seeded rows drafted too little."""
    cfg = ControllerConfig()
    ctl = SpeculationController(cfg)
    seq = SeqAcceptance(KMAX)
    first, later = 0.7, 0.95  # conditional acceptance at position 1, and at every one after it
    rng = np.random.default_rng(0)
    for _ in range(60):
        passed = 0
        while passed < 4 and rng.random() < (first if passed == 0 else later):
            passed += 1
        ctl.observe_rows([(seq, False, MODEL, 4, passed)])
    got = ctl._seeded_acceptance(seq, KMAX)[MODEL]
    fixed_prior = _chained(
        seq.accepted[MODEL], seq.tested[MODEL], cfg.seq_prior_weight * seq.unit, cfg.prior_acceptance
    )
    assert abs(got[0] - first) < 0.15
    for j in (1, 2, 3):
        assert got[j] > 0.8 and got[j] > fixed_prior[j] + 0.05


def test_oracle_bound_prices_only_the_accepted_guesses() -> None:
    """The bench's oracle: rounds recovered from the per-position counters, each priced as a
    (j+1)-token pass plus j draft steps. With a flat verify and free drafting it is exactly the
    tokens per target pass; dearer verification or drafting lowers it."""
    from specd.benchmarks.engine_bench import oracle_speedup, rounds_by_accepted
    from specd.services.engine.stats import SpecStats

    s = SpecStats()
    for proposed, accepted in [(3, 3), (3, 0), (3, 1), (2, 2), (0, 0)]:
        s.record_round(proposed, accepted, accepted + 1)
    assert rounds_by_accepted(s) == [2, 1, 1, 1]
    flat = {f"target_{t}": 10.0 for t in range(1, 5)}
    assert oracle_speedup(s, flat, 0.0) == pytest.approx(s.tokens_per_forward)
    steep = {f"target_{t}": 10.0 + 4 * (t - 1) for t in range(1, 5)}
    assert oracle_speedup(s, steep, 0.0) < oracle_speedup(s, flat, 0.0)
    assert oracle_speedup(s, flat, 2.0) < oracle_speedup(s, flat, 0.0)


@pytest.mark.parametrize("seed", range(30))
def test_batch_of_one_fast_path_is_optimal(seed: int) -> None:
    """At B = 1 the plain-Python path compares every option's full cost: nothing beats it."""
    rng = np.random.default_rng(100 + seed)
    acc = rng.uniform(0, 1, (1, 2, KMAX)) ** rng.uniform(0.2, 3)
    match, model_ok, cap = rng.integers(0, KMAX + 1, 1), rng.random(1) < 0.7, rng.integers(0, KMAX + 1, 1)
    cost = _random_cost(rng)
    catch_up = rng.integers(0, 30, 1) * (seed % 2)
    ch = choose_blocks(acc, match, model_ok, cap, cost, catch_up=catch_up)
    got = _goodput(acc, match, model_ok, cap, cost, ch.ks, ch.drafters, catch_up)
    assert got == pytest.approx(ch.goodput, rel=1e-9) and 0 <= ch.ks[0] <= cap[0]
    for k in range(int(cap[0]) + 1):
        for who in (NGRAM, MODEL):
            if (who == NGRAM and k > match[0]) or (who == MODEL and not model_ok[0]):
                continue
            dr = np.array([who if k > 0 else -1])
            assert got >= _goodput(acc, match, model_ok, cap, cost, np.array([k]), dr, catch_up) * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_a_batch_of_one_looks_up_the_ngram_only_where_it_could_win(seed: int) -> None:
    """plan_one asks for the n-gram's match only when an n-gram option could be chosen, and
    chooses exactly what the batched decision chooses with the match known."""
    rng = np.random.default_rng(200 + seed)
    ctl = SpeculationController(_NO_EXPLORATION)
    seq = SeqAcceptance(KMAX)
    ng_rate, model_rate = rng.uniform(0, 1, 2)
    for _ in range(int(rng.integers(0, 30))):
        drafter = NGRAM if rng.random() < 0.5 else MODEL
        k = int(rng.integers(1, KMAX + 1))
        passed = int(np.argmin(rng.random(k) < (ng_rate if drafter == NGRAM else model_rate))) if k else 0
        ctl.observe_rows([(seq, True, drafter, k, passed if passed or rng.random() < 0.5 else k)])
        ctl.observe_costs(1, k, 4e-3 + k * rng.uniform(0.2e-3, 1e-3), k if drafter == MODEL else 0, 1, 0.5e-3 * k)
    match, model_ok, cap = int(rng.integers(0, KMAX + 1)), bool(rng.random() < 0.8), int(rng.integers(1, KMAX + 1))
    asked = []
    choice = ctl.plan_one(seq, True, cap, model_ok, 0, lambda: asked.append(1) or match)
    acc = ctl.seq_acceptance(seq, ctl.global_acceptance(True))[None, :, :cap]
    want = choose_blocks(acc, np.array([match]), np.array([model_ok]), np.array([cap]), ctl.cost_model())
    assert (choice.ks.tolist(), choice.drafters.tolist()) == (want.ks.tolist(), want.drafters.tolist())
    assert choice.expected_cost == pytest.approx(want.expected_cost, rel=1e-9)
    if choice.drafters[0] == NGRAM or not model_ok:
        assert asked == [1]
    assert len(asked) <= 1


def test_a_batch_of_one_skips_the_lookup_when_the_model_is_far_better() -> None:
    """A sequence whose n-gram guesses always fail and whose model guesses always pass: the
    lookup, the dearest part of a batch of one's choice, is never made."""
    ctl = SpeculationController(_NO_EXPLORATION)
    seq = SeqAcceptance(KMAX)
    for _ in range(20):
        ctl.observe_rows([(seq, True, NGRAM, 3, 0), (seq, True, MODEL, 3, 3)])
        ctl.observe_costs(1, 3, 4e-3, 3, 1, 0.6e-3)
    asked = []
    choice = ctl.plan_one(seq, True, KMAX, True, 0, lambda: asked.append(1) or KMAX)
    assert choice.drafters[0] == MODEL and choice.width > 0 and asked == []


def test_untested_positions_inherit_the_rate_one_position_earlier() -> None:
    """A sequence kept at k = 2 that always passes both guesses: positions it never tested are
    estimated near its observed rate (chained prior), not at the fixed starting prior, so a
    longer block gets tried."""
    ctl = SpeculationController()
    seq = SeqAcceptance(16)
    for _ in range(40):
        ctl.observe_rows([(seq, True, MODEL, 2, 2)])
    est = ctl.seq_acceptance(seq, ctl.global_acceptance(True))[MODEL]
    assert est[0] > 0.9 and est[1] > 0.9
    assert est[2] > 0.85 and est[5] > 0.85  # never tested: inherited, well above the 0.6 prior
    assert ctl.cfg.prior_acceptance < 0.7


def test_exploration_at_batch_one_tries_a_wider_and_a_narrower_block() -> None:
    """Alone in its batch, a row's exploratory rounds verify one guess more or one fewer than the
    optimum, so the cost fit sees the width vary both ways."""
    ctl = SpeculationController()
    seq = SeqAcceptance(16)
    ctl.observe_costs(1, 3, 4e-3, 3, 1, 0.6e-3)
    rows = [RowPlan(seq, True, KMAX, 0, True)]
    counts = np.bincount([int(ctl.plan(rows, KMAX).width) for _ in range(400)], minlength=KMAX + 2)
    best = int(counts.argmax())
    assert 0 < best < KMAX, counts  # the fixture's costs put the optimum inside the range
    assert counts[best - 1] > 0 and counts[best + 1] > 0, counts
    assert counts[best - 1] + counts[best + 1] < 0.25 * counts.sum(), counts  # now and then only


def test_a_batch_of_one_explores_less_once_past_its_young_rounds() -> None:
    """Young, a row alone tries a neighbouring width about explore_width of its rounds; past
    young_rounds timed rounds about explore_width_alone (plus the rare width anywhere)."""
    ctl = SpeculationController()
    seq = SeqAcceptance(16)
    rows = [RowPlan(seq, True, KMAX, 0, True)]

    def off_optimum(n: int) -> float:
        widths = np.array([int(ctl.plan(rows, KMAX).width) for _ in range(n)])
        return float((widths != np.bincount(widths).argmax()).mean())

    ctl.observe_costs(1, 3, 4e-3, 3, 1, 0.6e-3)
    young = off_optimum(2000)
    for _ in range(ctl.cfg.young_rounds):
        ctl.observe_costs(1, 3, 4e-3, 3, 1, 0.6e-3)
    grown = off_optimum(4000)
    cfg = ctl.cfg
    assert young > 0.5 * (cfg.explore_width + cfg.explore_anywhere_young), young
    assert 0 < grown < 2 * (cfg.explore_width_alone + cfg.explore_anywhere_alone) < young, (young, grown)


def _speculating_batch(rows: int, cfg: ControllerConfig, rounds: int = 2100) -> tuple[int, int]:
    """A batch whose every guess passes, on a memory-bound verify (guesses nearly free): its plain
    rounds after the first 100, and the controller's explored rounds, over ``rounds``."""
    ctl = SpeculationController(cfg)
    seqs = [SeqAcceptance(16) for _ in range(rows)]
    plain = 0
    for r in range(rounds):
        ch = ctl.plan([RowPlan(s, True, KMAX, 0, True) for s in seqs], KMAX)
        plain += r >= 100 and ch.width == 0
        ctl.observe_rows([(s, True, MODEL if k else -1, k, k) for s, k in zip(seqs, ch.ks.tolist())])
        seconds = 10e-3 + 0.05e-3 * rows * (ch.width + 1)
        ctl.observe_costs(
            rows, ch.width, seconds, ch.model_steps, rows if ch.model_steps else 0, 0.3e-3 * ch.model_steps
        )
    return plain, ctl.stats.explored


@pytest.mark.parametrize("rows", [1, 4])
def test_a_speculating_batch_now_and_then_runs_a_plain_round(rows: int) -> None:
    """explore_plain: a batch that chooses to speculate every round still runs a round without
    guesses now and then, so its fit keeps seeing what a plain round costs instead of extending
    its line down to it: about 3% of its rounds while that cost is unknown, fewer once plain
    rounds of its size have been timed (explore_settled), never none; with explore_settled out of
    the way, the full 3%. A batch of one is left as it was (criterion 2 of issue 12 measures it; a
    plain round in 33 would cost it about 1.5% at k = 3)."""
    plain, _ = _speculating_batch(rows, ControllerConfig())
    always, _ = _speculating_batch(rows, ControllerConfig(explore_settled=1e12))
    if rows == 1:
        assert plain == always == 0
    else:
        assert 30 <= always <= 100, always  # 3% of 2000
        assert 8 <= plain <= always // 2, (plain, always)


def test_a_shape_timed_often_does_not_settle_another_that_verifies_as_many_tokens() -> None:
    """4 rows at k = 3 and 16 plain rows verify the same 16 tokens. A controller that has timed
    the first hundreds of times (and 16 rows at k = 3, never plain) still probes plain rounds at
    16 rows at the full explore_plain rate: settled by shape, not by the staircase's count of
    verified tokens (keyed by the count, it probed at a seventh of the rate). (Without the plain
    round a new batch size runs first, explore_new_batch: nothing is timed here between plans, so
    that round would be every round.)"""
    ctl = SpeculationController(ControllerConfig(explore_new_batch=False))
    for _ in range(300):
        ctl.observe_costs(4, 3, 10.8e-3, 3, 4, 0.9e-3)
        ctl.observe_costs(16, 3, 13.2e-3, 3, 16, 1.2e-3)
    rows = [RowPlan(SeqAcceptance(16), True, KMAX, 0, True) for _ in range(16)]
    widths = [ctl.plan(rows, KMAX).width for _ in range(4000)]  # nothing more timed meanwhile
    plain = widths.count(0)
    assert widths.count(3) > 0.8 * len(widths)  # it speculates
    assert 0.6 * 0.03 * 4000 <= plain <= 1.5 * 0.03 * 4000, plain


def test_a_batch_explores_less_where_its_rounds_have_priced_the_widths() -> None:
    """explore_settled: once rounds of the batch's size have been timed many times at the widths
    around the chosen one, trials of them (plain, one guess more or fewer, anywhere) are a
    fraction of what they are while those are untimed; seeds vary, the order holds."""
    for seed in range(3):
        _, settled = _speculating_batch(4, ControllerConfig(seed=seed), rounds=3000)
        _, always = _speculating_batch(4, ControllerConfig(seed=seed, explore_settled=1e12), rounds=3000)
        assert 0 < settled < always / 3, (seed, settled, always)


@pytest.mark.parametrize("learn_steps, seed", [(True, 0), (True, 1), (True, 7), (False, 0)])
def test_a_staircase_verify_cost_is_learned(learn_steps: bool, seed: int) -> None:
    """A kernel that takes 3 rows per pass: 1-3 verified tokens cost one pass, 4-6 two, 7 three.
    Every guess passes here, so the best block is k = 5 (6 tokens for two passes, the top of the
    second step; k = 6 pays a third pass for one token more); a line fitted through the same
    timings cannot see that, the staircase table can. (Seeds 1 and 7 of the exploration settled
    on k = 6 while the table kept deviations from the line of their day.)"""
    from specd.services.engine.controller import ControllerConfig

    def seconds(width: int) -> float:
        return 6e-3 + 2e-3 * -(-(width + 1) // 3)

    cfg = ControllerConfig(step_prior_weight=3.0 if learn_steps else 1e12, seed=seed)
    ctl = SpeculationController(cfg)
    seq = SeqAcceptance(16)
    rows = [RowPlan(seq, True, KMAX, 0, True)]
    widths = []
    for _ in range(800):
        ch = ctl.plan(rows, KMAX)
        k = int(ch.ks[0])
        widths.append(ch.width)
        ctl.observe_rows([(seq, True, MODEL if k else -1, k, k)])
        ctl.observe_costs(1, ch.width, seconds(ch.width), ch.model_steps, 1, 0.1e-3 * ch.model_steps)
    mode = int(np.bincount(widths[-300:]).argmax())
    if learn_steps:
        assert mode == 5, np.bincount(widths[-300:])
    else:
        assert mode != 5, np.bincount(widths[-300:])  # the line alone misses it


@pytest.mark.parametrize("price_context", [True, False])
def test_a_verify_cost_that_grows_with_the_context_is_not_blamed_on_the_width(price_context: bool) -> None:
    """32 rows whose context grows from 50 to 350 tokens, then again from 50: each cached token
    attended to costs 4 us a round, as the demo target's does on a CPU. The best block is 1 guess
    at a short context (the round is cheap, a token of width is dear beside it) and 2 at a long one.
    Fed each round's context, the fit finds the per-token and per-key costs and the choice follows
    the optimum; blind to it (the old cost model), the growth lands on the line and the short
    context gets a wider block than its best."""
    B, acc_p = 32, 0.6
    true = CostModel(v0=3e-3, v_row=0.0, v_token=0.3e-3, v_key=4e-6)
    rng = np.random.default_rng(0)
    ctl = SpeculationController(ControllerConfig(batch_margin=0.0))  # the choice follows the optimum itself
    seqs = [SeqAcceptance(16) for _ in range(B)]
    widths = []
    for r in range(600):
        ctx = 50 + r % 300
        rows = [RowPlan(s, True, KMAX, 0, True, context=ctx if price_context else 0) for s in seqs]
        ch = ctl.plan(rows, KMAX)
        widths.append(ch.width)
        outs = []
        for s, k in zip(seqs, ch.ks.tolist()):
            passed = 0
            while passed < k and rng.random() < acc_p:
                passed += 1
            outs.append((s, True, MODEL if k else -1, k, passed))
        ctl.observe_rows(outs)
        keys = B * ctx
        seconds = true.verify(B, ch.width, keys) * (1 + 0.05 * rng.standard_normal())
        model_rows = B if ch.model_steps else 0
        ctl.observe_costs(
            B, ch.width, seconds, ch.model_steps, model_rows, 1e-4 * ch.model_steps, keys if price_context else 0
        )
    acc = np.full((B, 2, KMAX), acc_p)

    def best(ctx: int) -> int:
        return choose_blocks(acc, np.zeros(B, int), np.ones(B, bool), np.full(B, KMAX), true, keys=B * ctx).width

    assert (best(75), best(330)) == (1, 2)  # the case is what it says
    short = int(np.bincount(widths[310:340]).argmax())  # contexts 60-90, second pass
    long = int(np.bincount(widths[560:600]).argmax())  # contexts 310-350
    if price_context:
        fit = ctl.cost_model()
        assert abs(fit.v_key / true.v_key - 1) < 0.25 and abs(fit.v_token / true.v_token - 1) < 0.25, fit
        assert (short, long) == (1, 2), (np.bincount(widths[310:340]), np.bincount(widths[560:600]))
    else:
        assert short > 1, np.bincount(widths[310:340])


@pytest.mark.parametrize("bounded", [True, False])
def test_exploration_at_a_large_batch_never_tries_a_width_far_from_paying(bounded: bool) -> None:
    """64 rows, each verified token 0.2 ms beside 30 ms a round: blocks of 1-2 pay best, 5 and 6
    lose over 20% of that. Past the young rounds a width tried anywhere must be expected to keep
    85% of the chosen round's goodput, so those are never verified; unbounded, they were."""
    from specd.services.engine.controller import ControllerConfig

    B = 64
    true = CostModel(v0=30e-3, v_row=0.0, v_token=0.2e-3)
    ctl = SpeculationController(ControllerConfig(explore_max_loss=0.15 if bounded else 1.0))
    for w in list(range(KMAX + 1)) * 20:  # a server that has seen every width (and is past young)
        ctl.observe_costs(B, w, true.verify(B, w), w, B, 1e-5 * w)
    seqs = [SeqAcceptance(16) for _ in range(B)]
    rng = np.random.default_rng(0)
    widths = []
    for _ in range(1500):
        ch = ctl.plan([RowPlan(s, True, KMAX, 0, True) for s in seqs], KMAX)
        widths.append(ch.width)
        outs = []
        for s, k in zip(seqs, ch.ks.tolist()):
            passed = 0
            while passed < k and rng.random() < 0.6:
                passed += 1
            outs.append((s, True, MODEL if k else -1, k, passed))
        ctl.observe_rows(outs)
        ctl.observe_costs(B, ch.width, true.verify(B, ch.width), ch.model_steps, B, 1e-5 * ch.model_steps)
    late = np.bincount(widths[200:], minlength=KMAX + 1)
    assert late[1:4].sum() > 0.9 * late.sum(), late  # it settles on a short block
    if bounded:
        assert late[5:].sum() == 0, late
    else:
        assert late[5:].sum() > 0, late


@pytest.mark.parametrize(("rows", "low_rate"), [(1, 0.2), (2, 0.2), (4, 0.25), (12, 0.3)])
def test_a_batch_speculates_only_where_it_promises_the_margin(rows: int, low_rate: float) -> None:
    """At a batch of more than one, guesses must promise batch_margin (5%) more goodput than a
    plain round, else the round is plain; a batch of one takes the optimum as it is. The acceptance
    sets the promise: at low_rate guesses promise 0.4-3% more than a plain round, at 0.5 20-45% more."""
    assert ControllerConfig().batch_margin == 0.05
    cost = CostModel(v0=4e-3, v_row=0.0, v_token=0.05e-3, d0=0.5e-3, d_step=0.2e-3)
    for rate, gain_is_large in ((low_rate, False), (0.5, True)):
        acc = np.full((rows, 2, KMAX), rate)
        best = choose_blocks(acc, np.zeros(rows, int), np.ones(rows, bool), np.full(rows, KMAX), cost)
        plain = choose_blocks(
            acc, np.zeros(rows, int), np.ones(rows, bool), np.full(rows, KMAX), cost, width_range=(0, 0)
        )
        gain = best.goodput / plain.goodput - 1
        assert best.width > 0 and (gain > 0.05) == gain_is_large, gain  # the case is what it says
        for margin in (0.0, 0.05):
            ctl = SpeculationController(ControllerConfig(batch_margin=margin, **_NO_EXPLORATION_KW))
            ctl.cost_model = lambda c=cost: c  # the prices of the case, not a fit
            ctl.global_acceptance = lambda greedy, a=rate: [[a] * KMAX, [a] * KMAX]
            seqs = [SeqAcceptance(KMAX) for _ in range(rows)]
            width = ctl.plan([RowPlan(s, True, KMAX, 0, True) for s in seqs], KMAX).width
            speculates = margin == 0.0 or rows == 1 or gain_is_large
            assert (width > 0) == speculates, (rate, margin, width)


def test_a_batch_that_chose_plain_rounds_rests_from_planning() -> None:
    """After a plan that speculates nowhere at a batch of more than one, dormant() holds the next
    dormant_rounds rounds plain without planning; not after a speculating plan, at a batch of one,
    or where no row could guess."""
    cost = CostModel(v0=4e-3, v_row=0.0, v_token=0.05e-3, d0=0.5e-3, d_step=0.2e-3)

    def controller(rate: float) -> SpeculationController:
        ctl = SpeculationController(ControllerConfig(dormant_rounds=5, **_NO_EXPLORATION_KW))
        ctl.cost_model = lambda: cost
        ctl.global_acceptance = lambda greedy: [[rate] * KMAX, [rate] * KMAX]
        return ctl

    def rests(ctl: SpeculationController) -> list[bool]:
        return [ctl.dormant() for _ in range(7)]

    off = controller(0.0)
    assert off.plan([RowPlan(SeqAcceptance(KMAX), True, KMAX, 0, True) for _ in range(4)], KMAX).width == 0
    assert rests(off) == [True] * 5 + [False] * 2
    on = controller(0.9)
    assert on.plan([RowPlan(SeqAcceptance(KMAX), True, KMAX, 0, True) for _ in range(4)], KMAX).width > 0
    assert rests(on) == [False] * 7
    alone = controller(0.0)
    assert alone.plan([RowPlan(SeqAcceptance(KMAX), True, KMAX, 0, True)], KMAX).width == 0
    assert rests(alone) == [False] * 7
    # No row able to guess (the draft not ready for any, no n-gram match): plain, and no rest.
    unable = controller(0.9)
    assert unable.plan([RowPlan(SeqAcceptance(KMAX), True, KMAX, 0, False) for _ in range(4)], KMAX).width == 0
    assert rests(unable) == [False] * 7


def _resting_batch(cfg: ControllerConfig, rounds: int, cost: CostModel, rate: float, told: CostModel) -> list[int]:
    """A batch of 16 rows run as the engine runs it (a rest's rounds plain and untimed, dormant()),
    timed by ``cost`` and accepting each guess with probability ``rate``, after 200 rounds of 4 rows
    timed by ``told`` (another load's prices, extrapolated to 16 rows): each round's width."""
    ctl = SpeculationController(cfg)
    for r in range(200):
        w = r % 4
        ctl.observe_costs(4, w, told.verify(4, w), w, 4 if w else 0, told.draft(w, 4))
    rng = np.random.default_rng(0)
    seqs = [SeqAcceptance(16) for _ in range(16)]
    widths = []
    for _ in range(rounds):
        if ctl.dormant():
            widths.append(0)
            continue
        ch = ctl.plan([RowPlan(s, True, KMAX, 0, True) for s in seqs], KMAX)
        ks = ch.ks.tolist()
        passed = [int(np.cumprod(rng.random(k) < rate).sum()) for k in ks]
        ctl.observe_rows([(s, True, MODEL if k else -1, k, a) for s, k, a in zip(seqs, ks, passed)])
        steps = ch.model_steps
        ctl.observe_costs(16, ch.width, cost.verify(16, ch.width), steps, 16 if steps else 0, cost.draft(steps, 16))
        widths.append(ch.width)
    return widths


def test_a_batch_at_rest_probes_widths_its_rounds_never_timed() -> None:
    """explore_resting: a batch of 16 whose plans go plain from prices never timed at its size
    (extrapolated from 4 rows on a compute-bound verify, where at 16 rows in truth a few more
    tokens cost little and most guesses pass) tries its best round with guesses at its next plans
    instead of resting on them, and soon speculates; without that it rests plain for over 500
    rounds (its only probe, explore_start, tries one guess, which the extrapolation still prices
    above plain). Where guesses truly do not pay at 16 rows, the trials cost few rounds (a shape
    counts as timed once its timings are folded in, at the next refit) and it stays plain."""
    told = CostModel(v0=1e-3, v_row=0.1e-3, v_token=1.0e-3, d0=0.5e-3, d_step=1e-3, d_step_row=0.3e-3)
    cheap = CostModel(v0=5e-3, v_row=0.05e-3, v_token=0.02e-3, d0=0.5e-3, d_step=0.6e-3)
    on = _resting_batch(ControllerConfig(), 1000, cheap, 0.8, told)
    off = _resting_batch(ControllerConfig(explore_resting=0.0), 1000, cheap, 0.8, told)
    assert not any(off[:500])  # the case is what it says: the plans go plain
    assert next(i for i, w in enumerate(on) if w > 0) < 10
    assert sum(w > 0 for w in on[500:]) > 0.9 * 500
    losing = _resting_batch(ControllerConfig(), 2000, told, 0.8, told)
    assert sum(w > 0 for w in losing) < 0.02 * len(losing), sum(w > 0 for w in losing)


@pytest.mark.parametrize("rows", [8, 32])  # the plain-Python path and the batched one
@pytest.mark.parametrize("probe", ["explore_resting", "explore_start"])
def test_a_probe_of_a_batch_at_rest_prices_its_catch_up_in_full(probe: str, rows: int) -> None:
    """A batch whose plan is plain, probed (a resting probe, or explore_start's width of 1): the
    probe is one round before the batch rests again, so a row far behind on the draft model pays its
    whole catch-up there, not the 1 / catch_up_rounds share a plan that keeps drafting spreads. The
    rows behind stay off the model; rows the draft has caught up are still probed. Spread, as
    before, the probe drafted every row (500 tokens behind each, at 32 real-pair rows in the stack
    a probe took 2.6 s where a plain round took 0.4)."""
    cost = CostModel(v0=5e-3, v_row=0.0, v_token=1e-3, d0=0.5e-3, d_step=0.3e-3, d_step_row=0.02e-3, d_catch=4e-6)

    def plan(behind: list[float], probing: bool = True) -> Choice:
        ctl = SpeculationController(ControllerConfig(**{**_NO_EXPLORATION_KW, probe: 1.0 if probing else 0.0}))
        ctl.cost_model = lambda: cost
        ctl.global_acceptance = lambda greedy: [[0.5] * KMAX, [0.5] * KMAX]
        batch = [RowPlan(SeqAcceptance(KMAX), True, KMAX, 0, True, context=100, catch_up=c) for c in behind]
        return ctl.plan(batch, KMAX)

    assert plan([0.0] * rows, probing=False).width == 0  # the case is what it says: the plan rests
    all_behind = plan([500.0] * rows)
    assert all_behind.width == 0 and all_behind.model_steps == 0, all_behind
    half = plan([0.0, 500.0] * (rows // 2))
    assert half.drafters.tolist() == [MODEL, -1] * (rows // 2), half
    assert half.ks.tolist() == [1, 0] * (rows // 2), half


def test_rests_double_while_plans_keep_resting_and_start_short_again() -> None:
    """Each plan at a batch that rests again doubles the rest (dormant_rounds, then twice as many, up
    to dormant_rounds_max, whatever the batch's rows); a plan that speculates starts them at
    dormant_rounds again, and a batch of one never rests."""
    cost = CostModel(v0=4e-3, v_row=0.0, v_token=0.05e-3, d0=0.5e-3, d_step=0.2e-3)
    rate = [0.0]
    ctl = SpeculationController(ControllerConfig(dormant_rounds=2, dormant_rounds_max=8, **_NO_EXPLORATION_KW))
    ctl.cost_model = lambda: cost
    ctl.global_acceptance = lambda greedy: [[rate[0]] * KMAX, [rate[0]] * KMAX]

    def rest_after_plan(rows: int) -> int:
        """Plans a batch of ``rows`` fresh rows, then counts the rounds it rests (at most 100)."""
        ctl.plan([RowPlan(SeqAcceptance(KMAX), True, KMAX, 0, True) for _ in range(rows)], KMAX)
        n = 0
        while n < 100 and ctl.dormant():
            n += 1
        return n

    assert [rest_after_plan(4) for _ in range(5)] == [2, 4, 8, 8, 8]
    rate[0] = 0.9  # guesses pay: the plan speculates, and the next rest is short
    assert rest_after_plan(4) == 0
    rate[0] = 0.0
    assert [rest_after_plan(rows) for rows in (4, 2, 3)] == [2, 4, 8]
    assert rest_after_plan(1) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_new_batch_size_where_guesses_cost_compute_starts_plain(seed: int) -> None:
    """A CPU-like target (the real pair's on this machine): a verify pass costs the larger of
    reading the weights (80 ms) and computing its tokens (20 ms each), so a batch of one verifies
    up to 4 tokens for the price of one and speculates, while 4 rows verify 4 tokens for 80 ms and
    8 for 160: there guesses accepted 80% of the time cost more than they give. Met for the first
    time after hundreds of rounds alone, the batch of 4 times a plain round, probes a width and
    rests. Before (the fixed cost split evenly with the rows, no plain round first, a probed width
    counted untimed until the periodic refit) it speculated in 21 of its first 60 rounds at each of
    these seeds; on the real pair in 24 of its first 28 plans (one in-process trace)."""
    ctl = SpeculationController(ControllerConfig(seed=seed))

    def verify_seconds(rows: int, width: int) -> float:
        return max(80e-3, 20e-3 * rows * (width + 1))

    def run(seqs: list[SeqAcceptance], rounds: int) -> list[int]:
        rng = np.random.default_rng(seed)
        widths = []
        for _ in range(rounds):
            if len(seqs) > 1 and ctl.dormant():
                widths.append(0)  # a rest: a plain round, neither planned nor timed
                continue
            ch = ctl.plan([RowPlan(s, False, 4, 0, True) for s in seqs], 4)
            widths.append(ch.width)
            observed = []
            for s, k in zip(seqs, ch.ks.tolist()):
                accepted = int(np.argmin(np.append(rng.random(k) < 0.8, False))) if k else 0
                observed.append((s, False, MODEL if k else -1, k, accepted))
            ctl.observe_rows(observed)
            steps = ch.model_steps
            ctl.observe_costs(len(seqs), ch.width, verify_seconds(len(seqs), ch.width), steps, len(seqs), 10e-3 * steps)
        return widths

    alone = run([SeqAcceptance(KMAX)], 300)
    assert np.mean(alone[100:]) > 2  # alone, guesses are nearly free: it speculates
    four = run([SeqAcceptance(KMAX) for _ in range(4)], 60)
    assert sum(1 for w in four if w > 0) <= 6, four
    assert all(w == 0 for w in four[20:]), four


@pytest.mark.parametrize("rows", [1, 4, 12, 32])  # one row, the plain-Python path, the batched one
def test_drafts_at_answers_as_the_plan_of_a_fresh_batch_and_counts_nothing(rows: int) -> None:
    """What the engine asks at admission (whether to have the draft prefill new prompts): a batch
    of ``rows`` fresh rows is given the draft model by drafts_at exactly where plan() gives it to
    them, over acceptances and prices where it does and where it does not (the batch margin
    included); asking explores nothing, counts no round and starts no rest."""
    margin_cost = CostModel(v0=4e-3, v_row=0.0, v_token=0.05e-3, d0=0.5e-3, d_step=0.2e-3)
    answers = []
    for cost in (MEMORY_BOUND, COMPUTE_BOUND, margin_cost):
        for rate in (0.0, 0.25, 0.5, 0.9):
            ctl = SpeculationController(_NO_EXPLORATION)
            ctl.cost_model = lambda c=cost: c
            ctl.global_acceptance = lambda greedy, a=rate: [[a] * KMAX, [a] * KMAX]
            asked = ctl.drafts_at(rows, True, 100 * rows, KMAX)
            assert ctl.stats.rounds == 0 and not ctl.dormant()
            batch = [RowPlan(SeqAcceptance(KMAX), True, KMAX, 0, True, context=100) for _ in range(rows)]
            planned = ctl.plan(batch, KMAX).model_steps > 0
            assert asked == planned, (cost, rate, rows)
            answers.append(asked)
    assert any(answers) and not all(answers)  # the cases cover both answers
    assert not SpeculationController(_NO_EXPLORATION).drafts_at(rows, True, 0, 0)  # no guesses allowed
