"""Speculation control for ``method="auto"``: per sequence, each round, how many guesses and from whom.

Two halves:

- :func:`choose_blocks` is the **pure** decision: per-row acceptance estimates, what each row can
  use (an n-gram match of some length, the draft model), and a cost model in; per-row block size k
  and drafter out. It maximises expected goodput, the round's expected emitted tokens over its
  expected cost.
- :class:`SpeculationController` keeps the statistics that feed it (decayed acceptance per
  sequence, drafter and position, started from the engine-wide rate; an online cost model fitted
  to the rounds' own timings) and adds the exploration that keeps them honest.

The round's cost, as the engine runs it. The target verifies a dense ``[B, W+1]`` block (W = the
widest block of the round; shorter rows are padded), so verification costs
``v0 + vB * B + vN * B * (W + 1)``: the verified tokens are one budget shared by the batch, and a
guess inside the width is free. The draft model runs ``Km`` sequential steps for all the rows it
drafts (``Bm`` of them): ``d0 + Km * (s0 + s1 * Bm)``. n-gram lookups are (nearly) free. On a GPU at
small batch ``vN`` is ~0 (memory-bound) and k goes up; at large batch, or on a CPU, ``vN * B``
dominates and k falls, down to 0 where a guess costs more than it is expected to yield.

Losslessness: the decision uses only what happened in earlier rounds, never the current round's
random draws, so the verified output follows the target's law whatever k is (the rejection rule is
lossless for any block size, including 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specd.services.common.constants import MAX_SPECULATIVE_TOKENS

# Drafter codes of the decision arrays; "none" is k = 0.
NGRAM, MODEL = 0, 1
DRAFTER_NAMES = ("ngram", "draft")
NONE = "none"


@dataclass(frozen=True)
class CostModel:
    """Expected seconds of one round (see the module docstring for the formula)."""

    v0: float  # verify: fixed per round
    v_row: float  # verify: per sequence in the batch
    v_token: float  # verify: per verified token (B * (W + 1) of them)
    d0: float = 0.0  # draft model: fixed per round that uses it (a network round trip, say)
    d_step: float = 0.0  # draft model: per step
    d_step_row: float = 0.0  # draft model: per step and per drafted row

    def verify(self, rows: int, width: int) -> float:
        return self.v0 + self.v_row * rows + self.v_token * rows * (width + 1)

    def draft(self, steps: int, rows: int) -> float:
        return 0.0 if steps == 0 or rows == 0 else self.d0 + steps * (self.d_step + self.d_step_row * rows)


@dataclass(frozen=True)
class Choice:
    """The decision for one round: per row k and drafter (-1: none), and what it was expected to give."""

    ks: np.ndarray  # [B] int
    drafters: np.ndarray  # [B] int: NGRAM, MODEL or -1
    width: int  # widest block
    model_steps: int  # draft model steps (0: the model is not used)
    expected_tokens: float
    expected_cost: float

    @property
    def goodput(self) -> float:
        return self.expected_tokens / self.expected_cost if self.expected_cost > 0 else 0.0


def expected_tokens(acceptance: np.ndarray) -> np.ndarray:
    """Expected emitted tokens for every block size: ``[..., kmax]`` conditional acceptance per
    position (P(guess j accepted | guesses before it accepted)) -> ``[..., kmax + 1]``; entry k is
    ``1 + sum_{j<=k} prod_{l<=j} a_l`` (one target token always, plus the accepted run)."""
    survive = np.cumprod(np.clip(acceptance, 0.0, 1.0), axis=-1)
    zero = np.zeros(acceptance.shape[:-1] + (1,))
    return 1.0 + np.concatenate([zero, np.cumsum(survive, axis=-1)], axis=-1)


def choose_blocks(
    acceptance: np.ndarray,
    match_len: np.ndarray,
    model_ok: np.ndarray,
    cap: np.ndarray,
    cost: CostModel,
    forced_k: np.ndarray | None = None,
    forced_drafter: np.ndarray | None = None,
    width_range: tuple[int, int] | None = None,
) -> Choice:
    """Per-row k and drafter maximising expected tokens / expected cost for one round.

    acceptance [B, 2, kmax]: conditional acceptance per row, drafter (NGRAM, MODEL) and position.
    match_len [B]: guesses the n-gram lookup has for the row (0: no match).
    model_ok [B] bool: whether the row may use the draft model.
    cap [B]: the row's largest k (its request's num_tokens, max_tokens and context left).
    forced_k / forced_drafter [B] (-1 = free): rows whose k and drafter are already decided (a
        fixed-method request, a seeded one); they are priced in and constrain the width.
    width_range: (lo, hi) bounds on the width (exploration); default any.

    Enumerates the width W and the model steps Km <= W (at most (kmax+1)^2 pairs, vectorised over
    rows). For one (W, Km), a guess within the width costs nothing more, so each free row takes the
    option with the most expected tokens: the n-gram's min(match, W, cap) guesses, the model's
    min(Km, cap), or none; the model option must beat the others by the marginal cost of drafting
    one more row, priced at the round's goodput (one Dinkelbach refinement). Ties go to the
    smaller block, so a row whose acceptance is 0 gets k = 0.
    """
    B, _, kmax = acceptance.shape
    if B == 1 and (forced_k is None or forced_k[0] < 0):
        return _choose_one(acceptance[0], int(match_len[0]), bool(model_ok[0]), int(cap[0]), cost, width_range)
    if forced_k is None:
        forced_k = np.full(B, -1)
    if forced_drafter is None:
        forced_drafter = np.full(B, -1)
    free = forced_k < 0
    cap = np.minimum(np.maximum(cap, 0), kmax)
    E = expected_tokens(acceptance)  # [B, 2, kmax + 1]
    rows = np.arange(B)
    ks_range = np.arange(kmax + 1)
    # Forced rows: fixed expected tokens, a minimum width and (if they use the model) minimum steps.
    fk = np.where(free, 0, np.minimum(np.maximum(forced_k, 0), kmax))
    fd = np.where(free | (fk == 0), -1, forced_drafter)
    forced_tokens = float(np.where(fd >= 0, E[rows, np.maximum(fd, 0), fk], 1.0)[~free].sum())
    forced_width = int(fk.max()) if B else 0
    forced_model_rows = int(((fd == MODEL) & ~free).sum())
    forced_steps = int(fk[fd == MODEL].max()) if forced_model_rows else 0

    # Per candidate width W: n-gram guesses and their expected tokens, [kmax+1, B].
    ng_k = np.minimum(np.minimum(match_len, cap)[None, :], ks_range[:, None])
    e_ng = E[rows[None, :], NGRAM, ng_k]
    # Per candidate model steps Km: the model's guesses, [kmax+1, B] (none where not allowed).
    m_k = np.where(model_ok[None, :], np.minimum(cap[None, :], ks_range[:, None]), 0)
    e_m = E[rows[None, :], MODEL, m_k]
    lo, hi = width_range if width_range is not None else (0, kmax)
    lo, hi = max(lo, forced_width), max(min(hi, kmax), forced_width)
    # The (W, Km) grid: [kmax+1, kmax+1, B] arrays, W on axis 0, Km on axis 1.
    W_ax, K_ax = ks_range[:, None], ks_range[None, :]
    valid = (K_ax <= W_ax) & (W_ax >= lo) & (W_ax <= hi) & (K_ax >= forced_steps)
    base = np.where(free[None, :], e_ng, 0.0)[:, None, :]  # [W, 1, B]
    e_model = e_m[None, :, :]  # [1, Km, B]
    can_model = (free & model_ok)[None, None, :] & (m_k > 0)[None, :, :]
    fixed_verify = cost.v0 + cost.v_row * B

    def evaluate(rate: float):
        # Drafting one more row costs d_step_row per step, priced at the round's goodput.
        use_model = can_model & ((e_model - base) * (1 - 1e-9) > rate * K_ax[:, :, None] * cost.d_step_row)
        tokens = forced_tokens + np.where(use_model, e_model, base).sum(axis=-1)
        bm = use_model.sum(axis=-1) + forced_model_rows  # [W, Km]
        ng_used = np.where(free[None, None, :] & ~use_model, ng_k[:, None, :], 0)
        widest_ng = ng_used.max(axis=-1) if B else np.zeros_like(bm)
        steps = np.where(bm > 0, np.maximum(K_ax, forced_steps), 0)
        width = np.maximum(np.maximum(widest_ng, forced_width), steps)
        c = fixed_verify + cost.v_token * B * (width + 1)
        c = c + np.where(steps > 0, cost.d0 + steps * (cost.d_step + cost.d_step_row * bm), 0.0)
        ratio = np.where(valid, tokens / c, -np.inf)
        # argmax takes the first maximum: the smallest width, then the fewest steps.
        flat = int(np.argmax(ratio))
        w, km = divmod(flat, kmax + 1)
        return (
            float(ratio[w, km]),
            w,
            km,
            use_model[w, km],
            ng_used[w, km],
            int(width[w, km]),
            int(steps[w, km]),
            float(tokens[w, km]),
            float(c[w, km]),
        )

    # Speculating nowhere prices the first pass; then one refinement at the goodput found.
    none_cost = cost.verify(B, forced_width) + cost.draft(forced_steps, forced_model_rows)
    best = evaluate((forced_tokens + float(free.sum())) / none_cost)
    if cost.d_step_row > 0:  # the goodput only prices extra model rows
        refined = evaluate(best[0])
        if refined[0] > best[0]:
            best = refined
    _, W, Km, use_model, ng_used, width, steps, tokens, c = best
    ks = np.where(use_model, m_k[Km], ng_used)
    drafters = np.where(use_model, MODEL, np.where(ng_used > 0, NGRAM, -1))
    ks = np.where(free, ks, fk)
    drafters = np.where(free, np.where(ks > 0, drafters, -1), fd)
    return Choice(ks.astype(int), drafters.astype(int), width, steps, tokens, c)


def _choose_one(
    acceptance: np.ndarray, match_len: int, model_ok: bool, cap: int, cost: CostModel, width_range
) -> Choice:
    """:func:`choose_blocks` for a batch of one free row, in plain Python: at batch 1 a round is a
    few milliseconds, and some fifty small numpy calls would cost a noticeable share of it."""
    kmax = acceptance.shape[-1]
    cap = min(max(cap, 0), kmax)
    lo, hi = width_range if width_range is not None else (0, kmax)
    hi = min(hi, kmax)
    e = [[1.0], [1.0]]
    for d in (NGRAM, MODEL):
        survive, total = 1.0, 1.0
        for a in acceptance[d].tolist():
            survive *= min(max(a, 0.0), 1.0)
            total += survive
            e[d].append(total)
    fixed = cost.v0 + cost.v_row
    best = None  # (ratio, k, drafter, width, steps, tokens, cost)
    # Alone, every option's full cost is known: compare them all (n-gram first, then the model by
    # steps; ties keep the earlier, smaller one).
    for W in range(lo, hi + 1):
        k = min(match_len, cap, W)
        options = [(e[NGRAM][k], k, NGRAM if k > 0 else -1, k, 0)]
        if model_ok:
            options += [(e[MODEL][min(cap, m)], min(cap, m), MODEL, m, m) for m in range(1, W + 1) if min(cap, m) > 0]
        for tokens, k, drafter, width, steps in options:
            c = fixed + cost.v_token * (width + 1) + cost.draft(steps, 1)
            if best is None or tokens / c > best[0] * (1 + 1e-9):
                best = (tokens / c, k, drafter, width, steps, tokens, c)
    _, k, drafter, width, steps, tokens, c = best
    return Choice(np.array([k]), np.array([drafter]), width, steps, tokens, c)


def choose_solo(
    acceptance: np.ndarray, match_len: np.ndarray, model_ok: np.ndarray, cap: np.ndarray, cost: CostModel
) -> tuple[np.ndarray, np.ndarray]:
    """Each row planned as if it ran alone (a batch of one): ``[D, 2, kmax]`` acceptance -> (ks, drafters).

    The same objective as :func:`choose_blocks` at B = 1, vectorised over independent rows.
    """
    D, _, kmax = acceptance.shape
    E = expected_tokens(acceptance)  # [D, 2, kmax + 1]
    k = np.arange(kmax + 1)
    verify = cost.verify(1, 0) + cost.v_token * k  # [kmax + 1]
    c_ng = verify
    c_m = verify + np.where(k > 0, cost.d0 + k * (cost.d_step + cost.d_step_row), 0.0)
    capped = k[None, :] <= np.minimum(cap, kmax)[:, None]  # [D, kmax + 1]
    r_ng = np.where(capped & (k[None, :] <= match_len[:, None]), E[:, NGRAM] / c_ng, -np.inf)
    r_m = np.where(capped & model_ok[:, None], E[:, MODEL] / c_m, -np.inf)
    r_m[:, 0] = -np.inf  # k = 0 is the n-gram column's (no drafter)
    ratio = np.concatenate([r_ng, r_m], axis=1)  # first maximum: n-gram before model, small k first
    best = np.argmax(ratio, axis=1)
    ks = best % (kmax + 1)
    drafters = np.where(ks == 0, -1, np.where(best > kmax, MODEL, NGRAM))
    return ks, drafters


# ------------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class ControllerConfig:
    """Knobs of the statistics and the exploration (defaults measured to be robust, see README)."""

    kmax: int = MAX_SPECULATIVE_TOKENS  # positions tracked
    prior_acceptance: float = 0.6  # before anything is known, per position
    global_prior_weight: float = 4.0  # pseudo-observations of prior_acceptance in the engine-wide rate
    global_decay: float = 0.995  # per round, engine-wide counts (about 200 rounds of memory)
    seq_prior_weight: float = 3.0  # pseudo-observations of the engine-wide rate in a sequence's own
    seq_decay: float = 0.85  # per round of that sequence (about 7 rounds of memory)
    cost_decay: float = 0.98  # per round, cost-model data (about 50 rounds)
    # Ridge pull of the cost fit toward its prior, in units of the features' mean square: weak, so
    # a little variation in the width identifies the per-token cost, yet it keeps a batch that never
    # varies its width (collinear features) well posed.
    cost_prior_weight: float = 3.0
    outlier_factor: float = 3.0  # a timing above this many times the prediction is clipped to it
    # Per round: verify one guess more or fewer than chosen, so the fit sees how verify time grows
    # with the width. Near the optimum goodput is flat in the width, so this costs little.
    explore_width: float = 0.1
    explore_start: float = 0.02  # per round, with speculation off everywhere: try a width of 1
    # Plan seeded sampled requests from their own history with fixed priors and costs (so they
    # repeat exactly); False plans them like any other row (tests of the timing-driven path).
    pin_seeded: bool = True
    seed: int = 0


class SeqAcceptance:
    """A sequence's decayed accept / test counts per drafter and position."""

    __slots__ = ("accepted", "tested")

    def __init__(self, kmax: int) -> None:
        self.accepted = np.zeros((2, kmax))
        self.tested = np.zeros((2, kmax))


def _record(accepted: np.ndarray, tested: np.ndarray, proposed: int, num_accepted: int) -> None:
    """Guesses 1..num_accepted passed; guess num_accepted+1 (if made) failed; later ones untested."""
    accepted[:num_accepted] += 1.0
    tested[: min(num_accepted + 1, proposed)] += 1.0


class _ShapedFit:
    """Least squares with exponential forgetting of ``y ~ a * (shape . x) + b . x``.

    ``shape`` is the prior's idea of how the cost splits over the features; its level ``a`` is
    fitted freely, while the deviations ``b`` are pulled toward 0 by a ridge penalty worth
    ``prior_weight`` rounds at the feature's observed variation. So a batch that never varies its width
    (collinear features) keeps the prior's proportions at the measured level, instead of sharing a
    slow stretch of the machine equally among the coefficients; variation in the width moves the
    per-token cost away from the prior as far as the data says.
    """

    def __init__(self, shape: np.ndarray, prior_weight: float) -> None:
        self.shape = shape
        p = len(shape) + 1
        self.ztz = np.zeros((p, p))
        self.zty = np.zeros(p)
        self.zsum = np.zeros(p)
        self.weight = 0.0
        self.prior_weight = prior_weight
        self._coef: np.ndarray | None = None

    def decay(self, factor: float) -> None:
        self.ztz *= factor
        self.zty *= factor
        self.zsum *= factor
        self.weight *= factor
        # The solution barely moves with a uniform decay; it is refreshed at the next add.

    def add(self, x: np.ndarray, y: float) -> None:
        z = np.empty(len(x) + 1)
        z[0] = self.shape @ x
        z[1:] = x
        self.ztz += np.outer(z, z)
        self.zty += z * y
        self.zsum += z
        self.weight += 1.0
        self._coef = None

    @property
    def fitted(self) -> bool:
        return self.weight > 1e-3

    def coef(self) -> np.ndarray:
        """The cost per unit of each feature (never negative: a negative slope is noise)."""
        if self._coef is None:
            mean_sq = np.diag(self.ztz) / self.weight + 1e-12
            var = np.maximum(mean_sq - (self.zsum / self.weight) ** 2, 0.0)
            lam = self.prior_weight * (var + 1e-3 * mean_sq)
            lam[0] = 1e-9 * mean_sq[0]  # the level is free
            theta = np.linalg.solve(self.ztz + np.diag(lam), self.zty)
            self._coef = np.maximum(theta[0] * self.shape + theta[1:], 0.0)
        return self._coef

    def predict(self, x: np.ndarray) -> float:
        return float(self.coef() @ x)


# Prior shape of the cost model, in units of one fixed verify cost: a guess token or a row costs a
# tenth of it, a draft step 12% (the demo pair on a CPU core is near this; the real pair's draft
# is dearer, and a GPU's verify at small batch cheaper per token, which the fit learns).
_VERIFY_SHAPE = np.array([1.0, 0.1, 0.1])
_DRAFT_SHAPE = np.array([0.02, 0.12, 0.03])
# The cost model seeded requests are planned with: fixed, so their k never depends on timings.
REFERENCE_COST = CostModel(*_VERIFY_SHAPE, *_DRAFT_SHAPE)


@dataclass
class RowPlan:
    """What the engine needs to know about one row to plan it."""

    seq: SeqAcceptance
    greedy: bool
    cap: int  # largest k for this row
    match_len: int  # n-gram guesses available
    model_ok: bool
    forced_k: int = -1  # -1: the controller decides
    forced_drafter: int = -1
    deterministic: bool = False  # plan from the row alone with fixed priors (seeded sampling)


@dataclass
class ControllerStats:
    """Counts since start, for exporters and tests."""

    rounds: int = 0
    explored: int = 0
    chosen_k: list[int] = field(default_factory=list)  # last round, per row


class SpeculationController:
    """Statistics, cost model and exploration around :func:`choose_blocks`; one per engine."""

    def __init__(self, config: ControllerConfig = ControllerConfig()) -> None:
        self.cfg = config
        k = config.kmax
        # Engine-wide counts keyed by [greedy][drafter, position].
        self.global_accepted = np.zeros((2, 2, k))
        self.global_tested = np.zeros((2, 2, k))
        self.verify_fit = _ShapedFit(_VERIFY_SHAPE, config.cost_prior_weight)
        self.draft_fit = _ShapedFit(_DRAFT_SHAPE, config.cost_prior_weight)
        self.rng = np.random.default_rng(config.seed)
        self.stats = ControllerStats()

    # ----------------------------------------------------------------------- estimates

    def global_acceptance(self, greedy: bool) -> np.ndarray:
        """[2, kmax] engine-wide conditional acceptance, pulled toward the prior."""
        w = self.cfg.global_prior_weight
        g = int(greedy)
        return (self.global_accepted[g] + w * self.cfg.prior_acceptance) / (self.global_tested[g] + w)

    def seq_acceptance(self, seq: SeqAcceptance, prior: np.ndarray) -> np.ndarray:
        w = self.cfg.seq_prior_weight
        return (seq.accepted + w * prior) / (seq.tested + w)

    def cost_model(self) -> CostModel:
        """The fitted round cost; before any timing the reference shape (only ratios matter)."""
        if not self.verify_fit.fitted:
            return REFERENCE_COST
        v = self.verify_fit.coef()
        # Until the draft model has been timed, its steps are priced at the prior's share of the
        # verify cost at the measured level.
        d = self.draft_fit.coef() if self.draft_fit.fitted else _DRAFT_SHAPE * (v[0] / _VERIFY_SHAPE[0])
        return CostModel(*v, *d)

    # ------------------------------------------------------------------------- planning

    def plan(self, rows: Sequence[RowPlan], kmax: int) -> Choice:
        """Ks and drafters for this round's rows (kmax: the widest block any row may get)."""
        forced_k = np.array([r.forced_k for r in rows], dtype=int)
        forced_d = np.array([r.forced_drafter for r in rows], dtype=int)
        # Seeded sampled rows: planned alone, from their own history and fixed priors, so the same
        # request draws the same random numbers whatever shares its batch and however fast it runs.
        solo = [i for i, r in enumerate(rows) if r.deterministic and r.forced_k < 0 and self.cfg.pin_seeded]
        if solo:
            prior = np.full((2, self.cfg.kmax), self.cfg.prior_acceptance)
            acc = np.stack([self.seq_acceptance(rows[i].seq, prior) for i in solo])[:, :, :kmax]
            ks, drafters = choose_solo(
                acc,
                np.array([rows[i].match_len for i in solo], dtype=int),
                np.array([rows[i].model_ok for i in solo], dtype=bool),
                np.array([rows[i].cap for i in solo], dtype=int),
                REFERENCE_COST,
            )
            forced_k[solo], forced_d[solo] = ks, drafters
        priors = {g: self.global_acceptance(g) for g in {r.greedy for r in rows}}
        acc = np.stack([self.seq_acceptance(r.seq, priors[r.greedy])[:, :kmax] for r in rows])
        args = (
            acc,
            np.array([r.match_len for r in rows], dtype=int),
            np.array([r.model_ok for r in rows], dtype=bool),
            np.array([r.cap for r in rows], dtype=int),
            self.cost_model(),
            forced_k,
            forced_d,
        )
        choice = choose_blocks(*args)
        explore = self._exploration_range(choice, args, kmax)
        if explore is not None:
            choice = choose_blocks(*args, width_range=explore)
            self.stats.explored += 1
        self.stats.rounds += 1
        self.stats.chosen_k = choice.ks.tolist()
        return choice

    def _exploration_range(self, choice: Choice, args, kmax: int) -> tuple[int, int] | None:
        """Now and then verify a width off the optimum, so the cost fit sees how verify time grows
        with the verified tokens (a batch that always runs one width cannot tell)."""
        can_guess = bool(((args[1] > 0) | args[2]).any()) and kmax > 0
        if not can_guess:
            return None
        u = self.rng.random()
        if choice.width == 0:
            return (1, 1) if u < self.cfg.explore_start else None
        if u < self.cfg.explore_width:
            w = choice.width + (1 if self.rng.random() < 0.5 and choice.width < kmax else -1)
            return (w, w)
        return None

    # ----------------------------------------------------------------------- observing

    def observe_rows(self, rows: Sequence[tuple[SeqAcceptance, bool, int, int, int]]) -> None:
        """After verification: per row (its stats, greedy, drafter code or -1, guesses made, accepted).

        Every row's own counts decay each of its rounds (so a drafter it stopped using drifts back to
        the engine-wide rate and gets tried again); the engine-wide counts decay per round.
        """
        self.global_accepted *= self.cfg.global_decay
        self.global_tested *= self.cfg.global_decay
        for seq, greedy, drafter, proposed, accepted in rows:
            seq.accepted *= self.cfg.seq_decay
            seq.tested *= self.cfg.seq_decay
            if drafter < 0 or proposed <= 0:
                continue
            _record(seq.accepted[drafter], seq.tested[drafter], proposed, accepted)
            g = int(greedy)
            _record(self.global_accepted[g, drafter], self.global_tested[g, drafter], proposed, accepted)

    def observe_costs(
        self, rows: int, width: int, verify_seconds: float, model_steps: int, model_rows: int, draft_seconds: float
    ) -> None:
        """One round's timings: verification of ``rows`` x ``width + 1`` tokens (and the emit that
        follows), and ``model_steps`` draft-model steps for ``model_rows`` rows (0 if unused)."""
        cfg = self.cfg
        xv = np.array([1.0, rows, rows * (width + 1.0)])
        self.verify_fit.decay(cfg.cost_decay)
        self.draft_fit.decay(cfg.cost_decay)
        # A round far slower than predicted (another process took the core) is clipped, not trusted.
        limit = cfg.outlier_factor * self.verify_fit.predict(xv) if self.verify_fit.fitted else np.inf
        self.verify_fit.add(xv, min(verify_seconds, limit))
        if model_steps > 0 and model_rows > 0:
            xd = np.array([1.0, model_steps, model_steps * float(model_rows)])
            if self.draft_fit.fitted:
                limit = cfg.outlier_factor * self.draft_fit.predict(xd)
            else:  # the first timing (a draft service's time-out, say) is checked against the prior
                c = self.cost_model()
                limit = 2 * cfg.outlier_factor * c.draft(model_steps, model_rows)
            self.draft_fit.add(xd, min(draft_seconds, limit))
