"""Speculation control for ``method="auto"``: per sequence, each round, how many guesses and from whom.

Two halves:

- :func:`choose_blocks` is the **pure** decision: per-row acceptance estimates, what each row can
  use (an n-gram match of some length, the draft model), and a cost model in; per-row block size k
  and drafter out. It maximises expected goodput, the round's expected emitted tokens over its
  expected cost.
- :class:`SpeculationController` keeps the statistics that feed it (decayed acceptance per
  sequence, drafter and position, started from the engine-wide rate; an online cost model fitted
  to the rounds' own timings) and adds the exploration that keeps them honest.

The round's cost, as the planner prices it. The target verifies a dense ``[B, W+1]`` block (W = the
widest block of the round; shorter rows are padded), so verification costs
``v0 + vB * B + vN * B * (W + 1) + vK * keys``: the verified tokens are one budget shared by the
batch, and a guess inside the width is free. ``keys`` is the round's context, the cached tokens its
rows attend to: the same whatever the widths, but a round of 64 rows at 300 tokens of context costs
three times one at 50 on the demo target, and a fit blind to it blames the width for the growth.
The draft model runs ``Km`` sequential steps for all the rows it drafts (``Bm`` of them), after feeding
each row the committed tokens it has not seen: ``d0 + Km * (s0 + s1 * Bm) + dC * C``, where ``C``
counts the tokens past the usual one or two (``CATCH_UP_TOKENS``) of a row that sat out earlier
rounds (a row the draft has never seen brings its whole context). Without ``dC``, switching a row
back to the model after speculation was off looks free, and under load a controller that switches
rows on and off pays for catching them up every time. n-gram lookups are (nearly) free. On a GPU at
small batch ``vN`` is ~0 (memory-bound) and k goes up; at large batch, or on a CPU, ``vN * B``
dominates and k falls, down to 0 where a guess costs more than it is expected to yield. A target
that skips the padding (``CausalLM.skips_padding``: the fused CPU forward) computes only each row's
own tokens; the fit is of the tokens a round computed, so there this price is an upper bound.

Losslessness: the decision uses only what happened in earlier rounds, never the current round's
random draws, so the verified output follows the target's law whatever k is (the rejection rule is
lossless for any block size, including 0).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from specd.services.common.constants import FIXED_NUM_TOKENS, MAX_SPECULATIVE_TOKENS

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
    v_key: float = 0.0  # verify: per cached token the round's rows attend to (their context)
    d_catch: float = 0.0  # draft model: per committed token fed before guessing (catch-up)
    # Measured deviation from the line, seconds, by the round's verified tokens B * (W + 1) (0 past
    # its end). Kernels work on blocks of rows, so a verified token more costs a staircase, not a
    # line: on this CPU the bf16 kernel takes 3 rows per pass over the weights.
    # A list, not an array: a batch of one prices its options one by one every round, where
    # indexing a list costs a fraction of an array (the batched path makes the array once, lazily).
    by_tokens: Sequence[float] | None = field(default=None, compare=False, repr=False)
    _steps: list[float] | None = field(init=False, default=None, compare=False, repr=False)
    _steps_array: np.ndarray | None = field(init=False, default=None, compare=False, repr=False)
    # A batch of one's verify cost by k without its context.
    _solo: list[float] = field(init=False, default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.by_tokens is not None:
            object.__setattr__(self, "_steps", [float(x) for x in self.by_tokens])
        solo = [self.verify(1, k) for k in range(MAX_SPECULATIVE_TOKENS + 1)]
        object.__setattr__(self, "_solo", solo)

    def verify(self, rows: int, width: int, keys: int = 0) -> float:
        return self.verify_tokens(rows, rows * (width + 1), keys)

    def verify_tokens(self, rows: int, tokens: int, keys: int = 0) -> float:
        """Verification of ``tokens`` tokens in ``rows`` rows: a padded round verifies rows * (width + 1);
        a forward that skips padding (CausalLM.skips_padding) only the rows' own."""
        return self.v0 + self.v_row * rows + self.v_token * tokens + self.v_key * keys + self.extra(tokens)

    def extra(self, tokens: int) -> float:
        t = self._steps
        return t[tokens] if t is not None and tokens < len(t) else 0.0

    def extra_array(self, tokens: np.ndarray) -> np.ndarray | float:
        if not self._steps:
            return 0.0
        t = self._steps_array
        if t is None:
            t = np.array(self._steps)
            object.__setattr__(self, "_steps_array", t)
        return np.where(tokens < len(t), t[np.minimum(tokens, len(t) - 1)], 0.0)

    def draft(self, steps: int, rows: int, caught_up: float = 0) -> float:
        if steps == 0 or rows == 0:
            return 0.0
        return self.d0 + steps * (self.d_step + self.d_step_row * rows) + self.d_catch * caught_up


class Choice(NamedTuple):
    """The decision for one round: per row k and drafter (-1: none), and what it was expected to give.

    Immutable like a frozen dataclass, and built at a fraction of its cost: one is made every round."""

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
    keys: int = 0,
    catch_up: np.ndarray | None = None,
) -> Choice:
    """Per-row k and drafter maximising expected tokens / expected cost for one round.

    acceptance [B, 2, kmax]: conditional acceptance per row, drafter (NGRAM, MODEL) and position.
    match_len [B]: guesses the n-gram lookup has for the row (0: no match).
    model_ok [B] bool: whether the row may use the draft model.
    cap [B]: the row's largest k (its request's num_tokens, max_tokens and context left).
    forced_k / forced_drafter [B] (-1 = free): rows whose k and drafter are already decided (a
        fixed-method request, a seeded one); they are priced in and constrain the width.
    width_range: (lo, hi) bounds on the width (exploration); default any.
    keys: the round's context (cached tokens its rows attend to), priced whatever the widths.
    catch_up [B]: tokens the draft model must feed a row before guessing for it (0: none; see the
        module docstring), priced where the row uses the model; fractional where the controller
        spreads a catch-up over the rounds it pays for (ControllerConfig.catch_up_rounds).

    Enumerates the width W and the model steps Km <= W (at most (kmax+1)^2 pairs, vectorised over
    rows). For one (W, Km), a guess within the width costs nothing more, so each free row takes the
    option with the most expected tokens: the n-gram's min(match, W, cap) guesses, the model's
    min(Km, cap), or none; the model option must beat the others by the marginal cost of drafting
    one more row (its steps and its catch-up), priced at the round's goodput (one Dinkelbach
    refinement). Ties go to the smaller block, so a row whose acceptance is 0 gets k = 0.
    """
    B, _, kmax = acceptance.shape
    if catch_up is None:
        catch_up = np.zeros(B, dtype=int)
    if B == 1 and (forced_k is None or forced_k[0] < 0):
        acc = np.clip(acceptance[0], 0.0, 1.0).tolist()
        return _choose_one(
            acc, int(match_len[0]), bool(model_ok[0]), int(cap[0]), cost, width_range, keys, float(catch_up[0])
        )
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
    forced_catch_up = float(catch_up[(fd == MODEL) & ~free].sum())
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
    fixed_verify = cost.v0 + cost.v_row * B + cost.v_key * keys
    row_catch_up = cost.d_catch * catch_up  # [B] seconds

    def evaluate(rate: float, ranged: bool = True):
        # Drafting one more row costs d_step_row per step and its catch-up, priced at the round's goodput.
        marginal = K_ax[:, :, None] * cost.d_step_row + row_catch_up[None, None, :]
        use_model = can_model & ((e_model - base) * (1 - 1e-9) > rate * marginal)
        tokens = forced_tokens + np.where(use_model, e_model, base).sum(axis=-1)
        bm = use_model.sum(axis=-1) + forced_model_rows  # [W, Km]
        caught_up = np.where(use_model, catch_up, 0).sum(axis=-1) + forced_catch_up  # [W, Km]
        ng_used = np.where(free[None, None, :] & ~use_model, ng_k[:, None, :], 0)
        widest_ng = ng_used.max(axis=-1) if B else np.zeros_like(bm)
        steps = np.where(bm > 0, np.maximum(K_ax, forced_steps), 0)
        width = np.maximum(np.maximum(widest_ng, forced_width), steps)
        c = fixed_verify + cost.v_token * B * (width + 1) + cost.extra_array(B * (width + 1))
        drafting = cost.d0 + steps * (cost.d_step + cost.d_step_row * bm) + cost.d_catch * caught_up
        c = c + np.where(steps > 0, drafting, 0.0)
        # The round's actual width (not only the n-gram's cap W) must lie in the range: a range
        # asks for that width to be verified (exploration).
        ok = valid & (width >= lo) & (width <= hi) if ranged else valid
        ratio = np.where(ok, tokens / c, -np.inf)
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
    none_cost = cost.verify(B, forced_width, keys) + cost.draft(forced_steps, forced_model_rows, forced_catch_up)
    rate = (forced_tokens + float(free.sum())) / none_cost
    best = evaluate(rate)
    ranged = best[0] > -np.inf  # no row can reach the range: the best outside it
    if not ranged:
        best = evaluate(rate, ranged=False)
    if cost.d_step_row > 0 or row_catch_up.any():  # the goodput only prices extra model rows
        refined = evaluate(best[0], ranged)
        if refined[0] > best[0]:
            best = refined
    _, W, Km, use_model, ng_used, width, steps, tokens, c = best
    ks = np.where(use_model, m_k[Km], ng_used)
    drafters = np.where(use_model, MODEL, np.where(ng_used > 0, NGRAM, -1))
    ks = np.where(free, ks, fk)
    drafters = np.where(free, np.where(ks > 0, drafters, -1), fd)
    return Choice(ks.astype(int), drafters.astype(int), width, steps, tokens, c)


# Up to this many rows the controller decides in plain Python (_choose_few): between forward passes
# the caches are cold, and choose_blocks' some hundred small numpy calls cost 0.5-0.8 ms a round,
# a seventh of a 4-row round on the demo pair; past it the vectorised grid is cheaper.
FEW_ROWS = 8


def _choose_few(
    acceptance: Sequence[Sequence[Sequence[float]]],
    match_len: Sequence[int],
    model_ok: Sequence[bool],
    cap: Sequence[int],
    cost: CostModel,
    width_range: tuple[int, int] | None = None,
    keys: int = 0,
    catch_up: Sequence[float] | None = None,
) -> Choice:
    """:func:`choose_blocks` for a few free rows (none forced), in plain Python: the same grid of
    (width W, model steps Km), the same per-row choice and Dinkelbach refinement, the same ties (the
    smallest width, then the fewest steps). ``acceptance`` is ``[B][2][kmax]`` lists."""
    B = len(acceptance)
    kmax = len(acceptance[0][MODEL])
    if catch_up is None:
        catch_up = [0.0] * B
    caps = [min(max(int(c), 0), kmax) for c in cap]
    # Per row and drafter: expected tokens by block size (expected_tokens, as lists).
    e_ng: list[list[float]] = []  # [B][kmax + 1]
    e_m: list[list[float]] = []
    for row in acceptance:
        for d, out in ((NGRAM, e_ng), (MODEL, e_m)):
            survive, total, e = 1.0, 0.0, [1.0]
            for a in row[d]:
                survive *= min(max(a, 0.0), 1.0)
                total += survive
                e.append(1.0 + total)
            out.append(e)
    ng_cap = [min(int(m), c) for m, c in zip(match_len, caps)]
    top_ng = max(ng_cap, default=0)
    lo, hi = width_range if width_range is not None else (0, kmax)
    hi = max(min(hi, kmax), 0)
    lo = min(max(lo, 0), hi)
    fixed_verify = cost.v0 + cost.v_row * B + cost.v_key * keys
    row_catch_up = [cost.d_catch * c for c in catch_up]
    any_catch_up = any(row_catch_up)
    per_verified = cost.v_token * B
    rows = range(B)

    # Per model step count Km: each row's expected tokens with the model (None: it cannot use it).
    e_model = [
        [e_m[b][min(caps[b], Km)] if model_ok[b] and min(caps[b], Km) > 0 else None for b in rows]
        for Km in range(kmax + 1)
    ]
    margin = 1 - 1e-9

    def uses_model(W: int, Km: int, rate: float) -> list[bool]:
        base = [e_ng[b][min(ng_cap[b], W)] for b in rows]
        step_row = Km * cost.d_step_row
        em = e_model[Km]
        return [em[b] is not None and (em[b] - base[b]) * margin > rate * (step_row + row_catch_up[b]) for b in rows]

    def evaluate(rate: float, ranged: bool) -> tuple[float, int, int, int, int, float, float]:
        """The best (ratio, W, Km, width, steps, tokens, cost) at ``rate``."""
        best: tuple[float, int, int, int, int, float, float] | None = None
        for W in range(lo, hi + 1):
            ng_used = [min(n, W) for n in ng_cap]
            base = [e_ng[b][ng_used[b]] for b in rows]
            # A W past every n-gram match, the range's floor and Km changes nothing from W = max of
            # those (the same guesses, tokens and cost), which comes first and so wins any tie:
            # skipped. With no match anywhere, 6 of the 21 (W, Km) pairs at kmax = 5 remain.
            for Km in range(W + 1) if W <= max(lo, top_ng) else range(W, W + 1):
                step_row = Km * cost.d_step_row
                em = e_model[Km]
                tokens, bm, caught_up, widest_ng = 0.0, 0, 0.0, 0
                for b in rows:  # summed in row order, as choose_blocks' sum over rows
                    e = em[b]
                    if e is not None and (e - base[b]) * margin > rate * (step_row + row_catch_up[b]):
                        tokens += e
                        bm += 1
                        caught_up += catch_up[b]
                    else:
                        tokens += base[b]
                        if ng_used[b] > widest_ng:
                            widest_ng = ng_used[b]
                steps = Km if bm > 0 else 0
                width = widest_ng if widest_ng > steps else steps
                c = fixed_verify + per_verified * (width + 1) + cost.extra(B * (width + 1))
                if steps > 0:
                    c = c + (cost.d0 + steps * (cost.d_step + cost.d_step_row * bm) + cost.d_catch * caught_up)
                ratio = tokens / c if not ranged or lo <= width <= hi else -np.inf
                if best is None or ratio > best[0]:  # the first maximum, as argmax
                    best = (ratio, W, Km, width, steps, tokens, c)
        assert best is not None
        return best

    none_cost = cost.verify(B, 0, keys)
    rate = float(B) / none_cost
    best, at = evaluate(rate, True), rate
    ranged = best[0] > -np.inf
    if not ranged:
        best = evaluate(rate, False)
    if cost.d_step_row > 0 or any_catch_up:
        refined = evaluate(best[0], ranged)
        if refined[0] > best[0]:
            best, at = refined, best[0]
    _, W, Km, width, steps, tokens, c = best
    use_model = uses_model(W, Km, at)
    ks, drafters = [], []
    for b in rows:
        if use_model[b]:
            k, d = min(caps[b], Km), MODEL
        else:
            k = min(ng_cap[b], W)
            d = NGRAM if k > 0 else -1
        ks.append(k)
        drafters.append(d if k > 0 else -1)
    return Choice(np.array(ks), np.array(drafters), width, steps, tokens, c)


def _choose_one(
    acceptance: Sequence[Sequence[float]],
    match_len: int,
    model_ok: bool,
    cap: int,
    cost: CostModel,
    width_range: tuple[int, int] | None,
    keys: int = 0,
    catch_up: float = 0.0,
) -> Choice:
    """:func:`choose_blocks` for a batch of one free row, in plain Python: at batch 1 a round is a
    few milliseconds, and some fifty small numpy calls would cost a noticeable share of it.

    Alone, a row's width is its own k, so the options are simply the n-gram's k = 0..match and the
    model's k = 1..cap, each priced in full. An exploration range keeps the options whose width lies
    in it (where there are none, the widest below it). ``acceptance`` is ``[2][kmax]`` (lists, in
    [0, 1]; a drafter the row cannot use may hold fewer positions)."""
    kmax = len(acceptance[MODEL])
    cap = min(max(cap, 0), kmax)
    lo, hi = width_range if width_range is not None else (0, kmax)
    top_ngram = min(match_len, cap, hi)
    top_model = min(cap, hi) if model_ok else 0
    widest = max(top_ngram, top_model)
    lo = min(lo, widest)  # nothing reaches the range: the widest below it
    context = cost.v_key * keys
    solo = cost._solo
    # (ratio, tokens, k, drafter, cost); n-gram first, then the model, small k first: ties keep the
    # earlier, cheaper option.
    best = (1.0 / (solo[0] + context), 1.0, 0, -1, solo[0] + context) if lo == 0 else None
    for d, top, d0, step in (
        (NGRAM, top_ngram, 0.0, 0.0),
        (MODEL, top_model, cost.d0 + cost.d_catch * catch_up, cost.d_step + cost.d_step_row),
    ):
        survive, tokens = 1.0, 1.0
        for k in range(1, top + 1):
            survive *= acceptance[d][k - 1]
            tokens += survive
            c = solo[k] + context + d0 + step * k
            if k >= lo and (best is None or tokens / c > best[0] * (1 + 1e-9)):
                best = (tokens / c, tokens, k, d, c)
    _, tokens, k, drafter, c = best
    return solo_choice(k, drafter, tokens, c)


def plain_choice(rows: int, cost: CostModel, keys: int = 0) -> Choice:
    """A round without guesses for ``rows`` free rows: what :func:`choose_blocks` chooses with the
    width held at 0, priced without its grid (a batch prices one every round, see
    SpeculationController._explore_and_count)."""
    return Choice(np.zeros(rows, dtype=int), np.full(rows, -1), 0, 0, float(rows), cost.verify(rows, 0, keys))


def _frozen(values: list[int]) -> np.ndarray:
    a = np.array(values)
    a.setflags(write=False)
    return a


# A batch of one's decision arrays, made once (read-only, shared): a fresh array per round costs
# more than the rest of that round's choice.
_ONE_ROW_KS = [_frozen([k]) for k in range(MAX_SPECULATIVE_TOKENS + 1)]
_ONE_ROW_DRAFTERS = {d: _frozen([d]) for d in (-1, NGRAM, MODEL)}


def solo_choice(k: int, drafter: int, tokens: float = 1.0, cost: float = 0.0) -> Choice:
    """A batch of one's decision: k guesses from ``drafter`` (k = 0: none), expected to give
    ``tokens`` for ``cost`` seconds (unpriced by default)."""
    d = drafter if k > 0 else -1
    return Choice(_ONE_ROW_KS[k], _ONE_ROW_DRAFTERS[d], k, k if d == MODEL else 0, tokens, cost)


def _forced_choice(
    acceptance: np.ndarray,
    ks: np.ndarray,
    drafters: np.ndarray,
    cost: CostModel,
    keys: int = 0,
    catch_up: np.ndarray | None = None,
) -> Choice:
    """The round of rows whose k and drafter are all decided already, priced like any other."""
    kmax = acceptance.shape[-1]
    ks = np.minimum(np.maximum(ks, 0), kmax)
    drafters = np.where(ks > 0, drafters, -1)
    E = expected_tokens(acceptance)
    rows = np.arange(len(ks))
    tokens = float(np.where(drafters >= 0, E[rows, np.maximum(drafters, 0), ks], 1.0).sum())
    model = drafters == MODEL
    steps = int(ks[model].max()) if model.any() else 0
    width = int(ks.max()) if len(ks) else 0
    caught_up = float(catch_up[model].sum()) if catch_up is not None else 0.0
    c = cost.verify(len(ks), width, keys) + cost.draft(steps, int(model.sum()), caught_up)
    return Choice(ks.astype(int), drafters.astype(int), width, steps, tokens, c)


def choose_seeded(
    acceptance: Sequence[Sequence[float]], match_len: int, model_ok: bool, cap: int, k: int, cost: CostModel
) -> tuple[int, int]:
    """A seeded sampled row's plan, from its ``[2][kmax]`` acceptance alone: (k, drafter).

    Two options: no guesses, or ``k`` of them (at most ``cap``) from the draft model; without the
    model, from the n-gram (as many as it matches, up to ``k``). Each is priced as if the row ran
    alone, and the better goodput wins (a tie: none).

    Why so few: a seeded row's plan may depend on neither timings nor its batch (its tokens must
    repeat whatever shares the batch), so it cannot see load, and a batch verifies its widest
    row's block: rows planned alone over every k (measured on the demo pair, 16 seeded rows at
    T = 0.8: k from 1 to 6, the batch verifying the widest) ran at 0.66x `none`, where a fixed k = 3
    ran at 0.93x. One common k keeps the batch's width at it, and the row keeps its way out when
    its guesses fail."""
    top = min(k, cap, len(acceptance[MODEL]))
    best, best_k, best_d = 1.0 / cost.verify(1, 0), 0, -1
    drafter, k = (MODEL, top) if model_ok else (NGRAM, min(top, match_len))
    if k > 0:
        survive, summed = 1.0, 0.0
        for a in acceptance[drafter][:k]:
            survive *= min(max(a, 0.0), 1.0)
            summed += survive
        c = cost.verify(1, k) + (cost.draft(k, 1) if drafter == MODEL else 0.0)
        if (1.0 + summed) / c > best:
            best_k, best_d = k, drafter
    return best_k, best_d


# ------------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class ControllerConfig:
    """Knobs of the statistics and the exploration (defaults measured to be robust, see README)."""

    kmax: int = MAX_SPECULATIVE_TOKENS  # positions tracked
    prior_acceptance: float = 0.6  # before anything is known, at the first position
    # Pseudo-observations, in the engine-wide rate, of the prior (first position) and of the rate
    # one position earlier (later positions; see _chained).
    global_prior_weight: float = 4.0
    global_decay: float = 0.995  # per round, engine-wide counts (about 200 rounds of memory)
    seq_prior_weight: float = 3.0  # pseudo-observations of the engine-wide rate in a sequence's own
    seq_decay: float = 0.85  # per round of that sequence (about 7 rounds of memory)
    # Per round of a sequence, its own longer memory (SeqAcceptance.own, about 50 rounds): a seeded
    # row's prior, built like the engine-wide one (global_prior_weight, prior_acceptance).
    own_decay: float = 0.98
    cost_decay: float = 0.98  # per round, cost-model data (about 50 rounds)
    # Ridge pull of the cost fit toward its prior, in units of the features' mean square: weak, so
    # a little variation in the width identifies the per-token cost, yet it keeps a batch that never
    # varies its width (collinear features) well posed.
    cost_prior_weight: float = 3.0
    outlier_factor: float = 3.0  # a timing above this many times the prediction is clipped to it
    # Rounds between refits of the cost model: it moves slowly, and a refit (two small solves) is a
    # noticeable share of a few-millisecond round.
    refit_every: int = 16
    # At a batch, a round of at least surprise_seconds that took more than this factor over or
    # under what the cost model in use priced it at makes the next plan refit. Until the periodic
    # refit a bad price otherwise stands for up to refit_every plans: 32 real-pair rows (in
    # process, greedy code) priced two draft steps at ~0 ms after two timings dominated by
    # catching the rows up, ran 2 s rounds priced at 1.2-1.6 s for the next seven plans, and lost
    # 14-16% to plain decoding. Shorter rounds are left out: a refit costs 0.15 ms or more, and a
    # round of a few milliseconds jitters by more than this factor.
    surprise_factor: float = 1.25
    surprise_seconds: float = 0.02
    global_refresh_every: int = 4  # rounds between recomputations of the engine-wide rates
    # The staircase (CostModel.by_tokens): per count of verified tokens below step_tokens, the mean
    # deviation of the rounds from the current line, decayed per observation of that count (a
    # count seen long ago keeps what was seen) and shrunk toward 0 by step_prior_weight rounds.
    step_tokens: int = 1024
    step_decay: float = 0.95
    step_prior_weight: float = 3.0
    # A staircase is not convex: one guess more or fewer never finds the next cheap step. So now
    # and then a width anywhere in 1..kmax is tried instead, often while the engine is young.
    explore_anywhere: float = 0.02
    explore_anywhere_young: float = 0.25
    young_rounds: int = 64
    # Per round: verify one guess more or fewer than chosen, so the fit sees how verify time grows
    # with the width. Near the optimum goodput is flat in the width, so this costs little.
    explore_width: float = 0.1
    # Past the young rounds, a batch of one explores less: its widths are few and soon seen, and
    # at the optimum one guess fewer costs it a fifth of a round's goodput (the demo pair at k = 3;
    # measured: 0.1 / 0.02 cost it about 2% against the best fixed k).
    explore_width_alone: float = 0.04
    explore_anywhere_alone: float = 0.01
    explore_start: float = 0.02  # per round, with speculation off everywhere: try a width of 1
    # A batch size met for the first time (more than one row) runs one plain round before anything
    # else: see SpeculationController._explore_and_count.
    explore_new_batch: bool = True
    # Per plan of a batch that would rest (see dormant_rounds), with this probability: the best
    # round with guesses instead, where the batch's rows were never timed at its width. A batch at
    # rest plans once per rest and times nothing in between, so a plain plan made from untimed
    # prices (a young cost model's prior, say) was as good as final: 16 demo streams in the stack
    # went plain at their first plan and stayed plain for the whole pass. Only untimed shapes: a
    # version that kept probing timed ones at explore_settled's share gained in the stack's
    # first passes and seemed to lose in its later ones (docs/benchmarks.md). A shape counts as
    # timed once its timings are folded in, at the plan after its first one (observe_costs): probed
    # until the next refit instead, up to refit_every plans, a batch of 4 real-pair rows met for
    # the first time speculated in most of its first 16 rounds where plain ones were faster.
    explore_resting: float = 1.0
    # Per round, at a batch that speculates: a round without guesses, so the fit keeps seeing what
    # a plain round costs. Never seeing one, it priced a plain round by extending its line down
    # from the widths it ran, and on a CPU, where a round with guesses also pays for sampling
    # against the draft's q, that price sat 50-70% above the truth and kept a batch of 4 sampled
    # rows speculating where plain rounds were faster (measured in the stack).
    explore_plain: float = 0.03
    # At a batch of more than one, a round with guesses must promise this much more goodput than a
    # plain round. Measured in the stack (4 sampled streams, demo pair), rounds the model expected
    # to gain about 20% over a plain round gained nothing (their tokens expected 12% too high and
    # their time 10% too low: choosing by noisy estimates favours the ones that err upward), and a
    # round with guesses also costs the draft service CPU beside the target that its own timing
    # does not show. Not more: at 10%, 20 greedy rows in fp32 never started speculating (a young
    # cost model promised less than that) and ran at 0.87 of their speed at 5%. A batch of
    # one is left as it was (its choices were measured on par with the best fixed k).
    batch_margin: float = 0.05
    # At a batch of more than one, after a plan that speculates nowhere (not an exploration), the
    # next rounds run plain without planning (SpeculationController.dormant): dormant_rounds of them
    # after the first such plan, twice as many after each that follows, up to dormant_rounds_max; a
    # plan that speculates starts them short again. So a batch whose load falls waits at most
    # dormant_rounds_max rounds for its next plan (a batch of one plans every round). The probe of
    # a width of 1 (explore_start) comes only at the rounds that plan. Measured on the demo pair, 4
    # sampled rows: with speculation all but off, a round took 7% longer than one of "none"
    # in-process (planning 0.18 ms of ~5), and in the stack a probe cost about four plain rounds
    # (the draft catches the rows up first), 4-10% of the time at 2% of the rounds. In the stack,
    # 4 sampled code streams at rest (mean k 0.04; `specd bench --serve`, 10 passes a run), `auto`
    # against `none`: rests of 8 rounds 0.958 and 0.962, of 64 rounds 1.047 and 1.064 (two A/B
    # pairs); later, on a noisier VM, runs interleaved: these growing rests 0.953, 1.000, 0.973,
    # 0.985, rests of 8 0.937, 0.950, 0.922, 0.970, rests of 64 1.003, 0.934. Growing rests that
    # also started short when the batch fell to half its rows or to one gave 0.882 and 0.974,
    # presumably because the benchmark's streams, all 64 tokens long, end close together.
    dormant_rounds: int = 8
    dormant_rounds_max: int = 64
    # A row's catch-up on the draft model (RowPlan.catch_up) is paid once and serves the rounds it
    # then keeps drafting: priced at this share per round. About the memory of a row's own
    # acceptance (seq_decay): priced in full, a row that sat out a stretch would never come back.
    catch_up_rounds: float = 8.0
    # Past the young rounds and at a batch, a width tried anywhere may cost at most this share of
    # the chosen round's expected goodput: at 64 rows on a CPU a width of 5 costs three rounds,
    # and trying it teaches nothing worth that.
    explore_max_loss: float = 0.15
    # From this many rows up one guess more or fewer moves the verified tokens past a step of the
    # kernels' blocks (3 rows on this CPU), so the neighbours see the staircase.
    explore_bounded_rows: int = 4
    # A width the batch's rows have been timed at n times (decayed per such round by step_decay)
    # is explored only with probability explore_settled / (n + explore_settled): a price the
    # rounds have pinned down teaches little more, and each trial off the optimum costs its share
    # of a round (4 demo streams in the stack: the plain probe alone about 1% of the time). A
    # shape never timed is explored at the full rates; one timed about 20 times (where the decay
    # saturates) at about a seventh of them.
    explore_settled: float = 3.0
    # A seeded row's guesses when it speculates (choose_seeded says why one k): the fixed methods'.
    seeded_k: int = FIXED_NUM_TOKENS
    seed: int = 0


class DecayedCounts:
    """Accept / test counts per drafter and position (``[drafter][position]``), decayed lazily.

    The lists hold the counts in units of ``unit``: decaying everything by ``f`` is ``unit /= f``
    (one float), a new observation adds ``unit``, and the counts themselves are ``accepted / unit``
    and ``tested / unit``. Plain lists, not arrays: they are read and written a few entries at a
    time every round of every sequence, between forward passes that leave the caches cold, and
    there a numpy call costs some microseconds where a list access costs a fraction of one.
    """

    __slots__ = ("accepted", "tested", "unit")

    def __init__(self, drafters: int, kmax: int) -> None:
        self.accepted = [[0.0] * kmax for _ in range(drafters)]
        self.tested = [[0.0] * kmax for _ in range(drafters)]
        self.unit = 1.0

    def decay(self, factor: float) -> None:
        self.unit /= factor
        if self.unit > 1e150:  # fold the unit back in long before it could overflow
            u = self.unit
            self.accepted = [[x / u for x in row] for row in self.accepted]
            self.tested = [[x / u for x in row] for row in self.tested]
            self.unit = 1.0

    def record(self, drafter: int, proposed: int, num_accepted: int) -> None:
        """Guesses 1..num_accepted passed; guess num_accepted+1 (if made) failed; later ones untested."""
        u, acc, tested = self.unit, self.accepted[drafter], self.tested[drafter]
        for j in range(num_accepted):
            acc[j] += u
        for j in range(min(num_accepted + 1, proposed)):
            tested[j] += u


class SeqAcceptance(DecayedCounts):
    """A sequence's decayed accept / test counts per drafter (NGRAM, MODEL) and position, and the
    same counts with a longer memory (``own``): what a seeded row is pulled toward, where any other
    row is pulled toward the engine-wide rate (which a seeded row's plan must not depend on)."""

    __slots__ = ("own",)

    def __init__(self, kmax: int) -> None:
        super().__init__(2, kmax)
        self.own = DecayedCounts(2, kmax)


def _chained(accepted: list[float], tested: list[float], weight: float, first: float) -> list[float]:
    """Conditional acceptance per position from one drafter's decayed counts: position 0 pulled
    toward ``first``, every later one toward the estimate one position earlier,
    ``est_j = (accepted_j + weight * est_{j-1}) / (tested_j + weight)``.

    Why chained: a position that has rarely been tested (the controller has kept blocks shorter)
    then inherits the rate just before it, which is what acceptance measured by position looks
    like (roughly flat), instead of a fixed prior that may sit far below it and would keep blocks
    short for ever."""
    out, est = [], first
    for a, t in zip(accepted, tested):
        est = (a + weight * est) / (t + weight)
        out.append(est)
    return out


def _pulled(
    seq: DecayedCounts, prior: list[list[float]], weight: float, n: int, n_ngram: int | None = None
) -> list[list[float]]:
    """``[2][n]`` a sequence's conditional acceptance, each position pulled toward ``prior`` by
    ``weight`` pseudo-observations (only the first ``n_ngram`` positions of the n-gram's, if given)."""
    w = weight * seq.unit
    lengths = (n if n_ngram is None else n_ngram, n)
    return [
        [(a + w * p) / (t + w) for a, t, p in zip(acc[:m], tested[:m], pr)]
        for acc, tested, pr, m in zip(seq.accepted, seq.tested, prior, lengths)
    ]


class _ShapedFit:
    """Least squares with exponential forgetting of ``y ~ a * (shape . x) + b . x``.

    ``shape`` is the prior's idea of how the cost splits over the features; its level ``a`` is
    fitted freely, while the deviations ``b`` are pulled toward 0 by a ridge penalty worth
    ``prior_weight`` rounds at the feature's observed variation. So a batch that never varies its width
    (collinear features) keeps the prior's proportions at the measured level, instead of sharing a
    slow stretch of the machine equally among the coefficients; variation in the width moves the
    per-token cost away from the prior as far as the data says.

    Plain Python (sums in units of ``unit``, decayed lazily, and a small solve at each refit): one
    observation a round is a few dozen multiplications, where the array version cost more in
    numpy calls than a batch of one's whole choice.
    """

    def __init__(self, shape: Sequence[float], prior_weight: float, free_deviation: int | None = None) -> None:
        self.shape = [float(x) for x in shape]
        # A feature whose deviation is (all but) unpenalised: what the data cannot split among
        # features that never varied apart (collinear) goes to it, not equally to each.
        self.free_deviation = free_deviation
        p = len(shape) + 1
        self.ztz = [[0.0] * p for _ in range(p)]  # lower triangle used
        self.zty = [0.0] * p
        self.zsum = [0.0] * p
        self.total = 0.0  # the observations' summed weight, in units
        self.unit = 1.0
        self.prior_weight = prior_weight

    def decay(self, factor: float) -> None:
        self.unit /= factor
        if self.unit > 1e150:  # fold the unit back in long before it could overflow
            u = self.unit
            self.ztz = [[x / u for x in row] for row in self.ztz]
            self.zty = [x / u for x in self.zty]
            self.zsum = [x / u for x in self.zsum]
            self.total /= u
            self.unit = 1.0

    def add(self, x: Sequence[float], y: float) -> None:
        """One observation: features ``x`` and the seconds ``y`` they took."""
        u = self.unit
        z = [sum(s * v for s, v in zip(self.shape, x)), *x]
        for i, zi in enumerate(z):
            uz = u * zi
            self.zsum[i] += uz
            self.zty[i] += uz * y
            row = self.ztz[i]
            for j in range(i + 1):
                row[j] += uz * z[j]
        self.total += u

    @property
    def fitted(self) -> bool:
        return self.total > 1e-3 * self.unit

    def coef(self) -> list[float]:
        """The cost per unit of each feature, none negative.

        Non-negative least squares by an active set: a coefficient the fit makes negative is held
        at 0 and the others are refitted without it. Clamping it alone would shift the whole line:
        the features are nearly collinear (a round's context moves with its batch, like its fixed
        cost), and an unconstrained fit trades a large negative cost per cached token against a
        large fixed cost; clamped, that line sat tens of milliseconds above every round it priced."""
        w, rounds = self.total, self.total / self.unit
        n = len(self.zty)  # the level's feature, then each feature's own
        features = n - 1
        gram = [[self.ztz[max(i, j)][min(i, j)] / w for j in range(n)] for i in range(n)]
        rhs = [x / w for x in self.zty]
        mean = [x / w for x in self.zsum]
        # The level is free; the deviations are pulled toward 0 by prior_weight rounds' worth
        # (the system is divided through by the rounds' summed decayed weight).
        ridge = []
        for i in range(1, n):
            mean_sq = gram[i][i] + 1e-12
            floor = (1e-9 if i - 1 == self.free_deviation else 1e-3) * mean_sq
            ridge.append(self.prior_weight * (max(mean_sq - mean[i] ** 2, 0.0) + floor) / rounds)
        held: list[int] = []
        while True:
            free = [j for j in range(features) if j not in held]
            # The basis: the level's feature less the held features (a held deviation is minus the
            # level's share, so the coefficient is 0), then each free feature; each vector as its
            # nonzero (index, value) pairs (a dense product cost more than the rest of a refit).
            basis = [[(0, 1.0)] + [(j + 1, -self.shape[j]) for j in sorted(held) if self.shape[j]]]
            basis += [[(j + 1, 1.0)] for j in free]
            g = [[sum(a * gram[k][m] * b for k, a in bi for m, b in bj) for bj in basis] for bi in basis]
            r = [sum(a * rhs[k] for k, a in bi) for bi in basis]
            g[0][0] += 1e-9 * (g[0][0] + 1e-12) / rounds
            for row, j in enumerate(free, start=1):
                g[row][row] += ridge[j]
            theta = _solve(g, r)
            deviation = dict(zip(free, theta[1:]))
            coef = [0.0 if j in held else theta[0] * s + deviation[j] for j, s in enumerate(self.shape)]
            worst = min(range(features), key=coef.__getitem__)
            if coef[worst] >= 0.0:
                return coef
            held.append(worst)
            if len(held) == features:
                return [0.0] * features

    def level(self) -> float:
        """The level ``a`` of the best fit with no deviations: ``y ~ a * (shape . x)``."""
        g = self.ztz[0][0]
        return max(self.zty[0] / g, 0.0) if g > 0 else 0.0


def _clip_limit(predicted: float, factor: float) -> float:
    """The most a timing priced at ``predicted`` counts for in a fit: ``factor`` times its price, or
    anything where the price is nothing (clipped to 0, every later timing would confirm it)."""
    return factor * predicted if predicted > 0 else float("inf")


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` by Gaussian elimination with partial pivoting (a small, well-posed system)."""
    n = len(b)
    m = [row[:] + [bi] for row, bi in zip(a, b)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[pivot] = m[pivot], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            if f:
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    x = [0.0] * n
    for c in range(n - 1, -1, -1):
        x[c] = (m[c][n] - sum(m[c][j] * x[j] for j in range(c + 1, n))) / m[c][c]
    return x


# Prior shape of the cost model, in units of one fixed verify cost: a guess token or a row costs a
# tenth of it, a cached token of context attended to 0.03% (between the demo target's 0.1% and
# the real pair's 0.003%), a draft step 12% (the demo pair on a CPU core is near this; the real
# pair's draft is dearer, and a GPU's verify at small batch cheaper per token, which the fit learns).
_VERIFY_SHAPE = (1.0, 0.1, 0.1, 3e-4)  # v0, v_row, v_token, v_key
# A token caught up is one more position in a batched first pass: a twelfth of a step (a step
# reads the draft's weights for one token; the demo and the real draft on this CPU are near 1/15).
_DRAFT_SHAPE = (0.02, 0.12, 0.03, 0.01)  # d0, d_step, d_step_row, d_catch


def _cost(verify: Sequence[float], draft: Sequence[float], by_tokens: Sequence[float] | None = None) -> CostModel:
    v0, v_row, v_token, v_key = (float(x) for x in verify)
    d0, d_step, d_step_row, d_catch = (float(x) for x in draft)
    return CostModel(v0, v_row, v_token, d0, d_step, d_step_row, v_key, d_catch, by_tokens)


# The cost model seeded requests are planned with: fixed, so their k never depends on timings. It
# prices no context: a seeded row's plan must not depend on what shares its batch.
REFERENCE_COST = _cost((*_VERIFY_SHAPE[:3], 0.0), _DRAFT_SHAPE)


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
    # Plan from the row alone with fixed priors (a seeded sampled request, unless the engine plans
    # those from measurements: EngineConfig.pin_seeded).
    deterministic: bool = False
    context: int = 0  # tokens in the row's cache (what its verification attends to)
    catch_up: int = 0  # tokens the draft model must feed before guessing for it (CostModel.d_catch)


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
        # Engine-wide counts, one per greedy / sampled, each [drafter][position].
        self.global_counts = (DecayedCounts(2, k), DecayedCounts(2, k))
        self._global_estimate: list[list[list[float]] | None] = [None, None]  # per greedy, cached
        self._global_age = [0, 0]  # rounds since each was computed
        # The fixed cost takes what the rows cannot be told apart from: a batch that has only ever
        # run one size (one row, say) says nothing of what a row costs. Split evenly between the
        # two, a weights-bound target's fixed cost made each further row look nearly as dear as the
        # pass (the real pair's first plain rounds of 4 rows priced at 124-182 ms, when they took
        # 80-90, as one row did), and speculation cheap beside them.
        self.verify_fit = _ShapedFit(_VERIFY_SHAPE, config.cost_prior_weight, free_deviation=0)
        self.draft_fit = _ShapedFit(_DRAFT_SHAPE, config.cost_prior_weight)
        self.rng = random.Random(config.seed)  # exploration: one draw a round, no array needed
        self.stats = ControllerStats()
        self._cost: CostModel | None = None  # the fitted model, refitted every refit_every rounds
        self._cost_age = 0
        self._stale = False  # refit at the next use (the first timings)
        # Timings since the last refit, folded into the fits then: (rows, width, keys, verify
        # seconds, model steps, model rows, draft seconds, tokens caught up, tokens verified).
        self._timings: list[tuple[int, int, int, float, int, int, float, int, int]] = []
        self._draft_timed = False  # whether any round has timed the draft model
        self._timed_round = 0  # rounds timed so far
        self._dormant = 0  # rounds left to run plain without planning (see dormant())
        self._rest = config.dormant_rounds  # the next rest's length (doubles while plans keep resting)
        # By verified tokens, decayed sums of the rounds' seconds and of their verify features
        # (lists: see DecayedCounts). The line is linear, so a count's mean deviation from whatever
        # line the last refit drew is these sums' (see _fit_cost).
        self._step_y = [0.0] * config.step_tokens
        self._step_x = [[0.0] * 4 for _ in range(config.step_tokens)]
        self._step_n = [0.0] * config.step_tokens
        self._step_top = 0  # one past the most tokens a timed round has verified
        # Timed rounds by (rows, width), decayed per observation of that shape like the staircase
        # (see _unsettled).
        self._seen: dict[tuple[int, int], float] = {}

    # ----------------------------------------------------------------------- estimates

    def global_acceptance(self, greedy: bool) -> list[list[float]]:
        """[2][kmax] engine-wide conditional acceptance, pulled toward the prior (recomputed every
        ``global_refresh_every`` rounds: it has a memory of hundreds)."""
        g = int(greedy)
        cached = self._global_estimate[g]
        if cached is None or self._global_age[g] >= self.cfg.global_refresh_every:
            cached = self._global_estimate[g] = self._global_rate(g)
            self._global_age[g] = 0
        return cached

    def _global_rate(self, g: int) -> list[list[float]]:
        c = self.global_counts[g]
        w = self.cfg.global_prior_weight * c.unit
        return [_chained(a, t, w, self.cfg.prior_acceptance) for a, t in zip(c.accepted, c.tested)]

    def seq_acceptance(self, seq: SeqAcceptance, prior: list[list[float]]) -> np.ndarray:
        """[2, kmax] the sequence's conditional acceptance, pulled toward ``prior``."""
        return np.array(_pulled(seq, prior, self.cfg.seq_prior_weight, len(seq.accepted[0])))

    def cost_model(self) -> CostModel:
        """The fitted round cost (refitted every ``refit_every`` rounds); before any timing the
        reference shape (only ratios matter)."""
        if self._cost is None or self._stale or self._cost_age >= self.cfg.refit_every:
            if self._timings:
                self._fold_timings()
            self._cost, self._cost_age, self._stale = self._fit_cost(), 0, False
        return self._cost

    def _fit_cost(self) -> CostModel:
        if not self.verify_fit.fitted:
            return REFERENCE_COST
        v = self.verify_fit.coef()
        # Until the draft model has been timed, its steps are priced at the prior's share of the
        # verify cost at the measured level: the fitted fixed cost's, unless a few rounds moved it
        # onto another feature (two plain rounds whose context differs by two tokens: v0 = 0),
        # then the level of the prior's shape. The draft was priced at nothing there, and its
        # first timings, clipped to that price, kept it there for good.
        level = max(v[0] / _VERIFY_SHAPE[0], self.verify_fit.level())
        d = self.draft_fit.coef() if self.draft_fit.fitted else [x * level for x in _DRAFT_SHAPE]
        # The staircase up to the most tokens verified yet (0 past it, as for a count never seen):
        # each count's mean deviation from this line. Deviations kept from the line of their day
        # went stale at every refit, and a refit that moved the line by a few milliseconds left
        # the price of a width the batch rarely runs (a plain round, say) off by as much.
        top, w = self._step_top, self.cfg.step_prior_weight
        steps = [
            (y - v[0] * x[0] - v[1] * x[1] - v[2] * x[2] - v[3] * x[3]) / (n + w) if n else 0.0
            for y, x, n in zip(self._step_y[:top], self._step_x[:top], self._step_n[:top])
        ]
        return _cost(v, d, steps)

    # ------------------------------------------------------------------------- planning

    def plan(self, rows: Sequence[RowPlan], kmax: int) -> Choice:
        """Ks and drafters for this round's rows (kmax: the widest block any row may get)."""
        if all(r.forced_k < 0 and not r.deterministic for r in rows):  # every row is free
            if len(rows) == 1:
                return self._plan_one(rows[0], kmax)
            if len(rows) <= FEW_ROWS:
                return self._plan_few(rows, kmax)
        # Seeded sampled rows: planned alone, from their own history and fixed priors, so the same
        # request draws the same random numbers whatever shares its batch and however fast it runs.
        solo = [i for i, r in enumerate(rows) if r.deterministic and r.forced_k < 0]
        if len(solo) == len(rows) == 1:  # a seeded row alone: nothing else to price
            k, d = self._plan_seeded(rows[0], kmax)
            self.stats.rounds += 1
            self.stats.chosen_k = [k]
            return solo_choice(k, d)
        forced_k = np.array([r.forced_k for r in rows], dtype=int)
        forced_d = np.array([r.forced_drafter for r in rows], dtype=int)
        for i in solo:
            forced_k[i], forced_d[i] = self._plan_seeded(rows[i], kmax)
        priors = {g: self.global_acceptance(g) for g in {r.greedy for r in rows}}
        w = self.cfg.seq_prior_weight
        acc = np.array([_pulled(r.seq, priors[r.greedy], w, kmax) for r in rows])
        args = (
            acc,
            np.array([r.match_len for r in rows], dtype=int),
            np.array([r.model_ok for r in rows], dtype=bool),
            np.array([r.cap for r in rows], dtype=int),
            self.cost_model(),
            forced_k,
            forced_d,
        )
        keys = sum(r.context for r in rows)
        full = np.array([r.catch_up for r in rows], dtype=float)
        catch_up = full / self.cfg.catch_up_rounds
        if (forced_k >= 0).all():  # nothing left to decide (seeded or fixed-method rows only)
            choice = _forced_choice(acc, forced_k, forced_d, args[4], keys, catch_up)
            self.stats.rounds += 1
            self.stats.chosen_k = choice.ks.tolist()
            return choice
        return self._explore_and_count(
            choose_blocks(*args, keys=keys, catch_up=catch_up),
            bool(((args[1] > 0) | args[2]).any()),
            kmax,
            lambda width_range, one_off: choose_blocks(
                *args, width_range=width_range, keys=keys, catch_up=full if one_off else catch_up
            ),
            free=bool((forced_k < 0).all()),
            plain=lambda: plain_choice(len(rows), args[4], keys),
        )

    def drafts_at(self, rows: int, greedy: bool, keys: int, kmax: int) -> bool:
        """Whether a batch of ``rows`` free rows new to the controller (the engine-wide acceptance,
        the draft ready for each, no n-gram match, ``keys`` cached tokens between them) would be
        given the draft model at today's prices, the batch margin applied as :meth:`plan` applies
        it. Nothing is explored or counted: the engine asks this at admission, before it has the
        draft prefill prompts that a batch at rest would never draft for."""
        if rows <= 0 or kmax <= 0:
            return False
        kmax = min(kmax, self.cfg.kmax)
        acc = np.array([[d[:kmax] for d in self.global_acceptance(greedy)]] * rows)
        cost = self.cost_model()
        choice = choose_blocks(
            acc, np.zeros(rows, dtype=int), np.ones(rows, dtype=bool), np.full(rows, kmax), cost, keys=keys
        )
        if rows > 1:
            choice = self._with_margin(choice, lambda: plain_choice(rows, cost, keys))
        return choice.model_steps > 0

    def _with_margin(self, choice: Choice, plain: Callable[[], Choice]) -> Choice:
        """For a batch of free rows: ``choice``, or ``plain()`` where its guesses do not promise
        ``batch_margin`` more goodput than a round without them."""
        if self.cfg.batch_margin > 0 and choice.width > 0:
            # (Priced directly: the grid held at width 0 took 0.13 ms of a 16-row plan's 0.33.)
            without = plain()
            if choice.goodput < (1.0 + self.cfg.batch_margin) * without.goodput:
                return without
        return choice

    def _plan_seeded(self, row: RowPlan, kmax: int) -> tuple[int, int]:
        """:func:`choose_seeded` for a seeded row, at ``seeded_k`` guesses, priced by REFERENCE_COST."""
        k = min(self.cfg.seeded_k, kmax)
        acc = self._seeded_acceptance(row.seq, k)
        return choose_seeded(acc, row.match_len, row.model_ok, row.cap, k, REFERENCE_COST)

    def _seeded_acceptance(self, seq: SeqAcceptance, kmax: int) -> list[list[float]]:
        """``[2][kmax]`` a seeded row's acceptance, from its own history and fixed priors only: its
        recent counts pulled toward its longer memory (SeqAcceptance.own), as another row's are
        toward the engine-wide rate. Pulled toward one fixed prior instead, the positions a row
        seldom reaches inherited the rate before them, where conditional acceptance rises with the
        position, and seeded rows drafted too little."""
        cfg, own = self.cfg, seq.own
        w = cfg.global_prior_weight * own.unit
        prior = [_chained(a[:kmax], t[:kmax], w, cfg.prior_acceptance) for a, t in zip(own.accepted, own.tested)]
        return _pulled(seq, prior, cfg.seq_prior_weight, kmax)

    def _plan_few(self, rows: Sequence[RowPlan], kmax: int) -> Choice:
        """:meth:`plan` for a few free rows (see FEW_ROWS): the same choice, made without arrays."""
        priors = {g: self.global_acceptance(g) for g in {r.greedy for r in rows}}
        w = self.cfg.seq_prior_weight
        acc = [_pulled(r.seq, priors[r.greedy], w, kmax) for r in rows]
        match = [r.match_len for r in rows]
        model_ok = [r.model_ok for r in rows]
        cap = [r.cap for r in rows]
        cost = self.cost_model()
        keys = sum(r.context for r in rows)
        full = [float(r.catch_up) for r in rows]
        catch_up = [c / self.cfg.catch_up_rounds for c in full]
        return self._explore_and_count(
            _choose_few(acc, match, model_ok, cap, cost, None, keys, catch_up),
            any(m > 0 or ok for m, ok in zip(match, model_ok)),
            kmax,
            lambda width_range, one_off: _choose_few(
                acc, match, model_ok, cap, cost, width_range, keys, full if one_off else catch_up
            ),
            free=True,
            plain=lambda: plain_choice(len(rows), cost, keys),
        )

    def _explore_and_count(
        self,
        choice: Choice,
        can_guess: bool,
        kmax: int,
        choose_within: Callable[[tuple[int, int], bool], Choice],
        free: bool,
        plain: Callable[[], Choice],
    ) -> Choice:
        """A batch's round: ``choice`` (``plain()``, a round without guesses, where guesses do not
        promise ``batch_margin`` more goodput and every row is ``free`` to go without), or now and
        then the choice within an exploration range (``choose_within(range, one_off)``); counted
        in the stats.

        A trial from a plain choice (a probe of a batch at rest) prices the rows' catch-up on the
        draft in full (``one_off``): the batch goes back to rest after it, so the catch-up serves
        that one round, not the catch_up_rounds the plan spreads it over. Spread, a probe at 32
        real-pair rows in the stack chose the draft for rows 500-600 tokens behind it and took
        2-2.6 s where a plain round took 0.4 (docs/benchmarks.md)."""
        cfg = self.cfg
        batch = free and len(choice.ks) > 1  # a batch of free rows: the margin and dormancy apply
        if batch:
            choice = self._with_margin(choice, plain)
        rows = len(choice.ks)
        if cfg.explore_new_batch and batch and can_guess and self._new_shape(rows, 0):
            # A batch size met for the first time runs one plain round first (and plans again at
            # the next): every choice there is judged against a plain round's price, which the fit
            # only extrapolates from other sizes until one is timed, and it is the round "none"
            # would run anyway.
            choice = plain()
            self.stats.explored += 1
            self._dormant, self._rest = 0, cfg.dormant_rounds
        elif (explore := self._exploration_range(choice, can_guess, kmax)) is not None:
            lo, hi, bounded = explore
            choice = self._explored(choice, choose_within((lo, hi), choice.width == 0), bounded)
        elif choice.width > 0 or not batch:  # no rest, and the next one starts short
            self._dormant, self._rest = 0, cfg.dormant_rounds
        elif can_guess:
            probe = self._resting_probe(choice, choose_within, kmax)
            if probe is not None:
                choice = probe
            else:
                self._dormant = self._rest
                self._rest = min(2 * self._rest, cfg.dormant_rounds_max)
        # (A batch where no row could guess, its draft still prefilling every row say, chose
        # nothing about its load: resting then kept rows plain for rounds after the draft was ready.)
        self.stats.rounds += 1
        self.stats.chosen_k = choice.ks.tolist()
        return choice

    def _plan_one(self, row: RowPlan, kmax: int) -> Choice:
        """:meth:`plan` for a batch of one free row: :meth:`plan_one` with the match known."""
        return self.plan_one(
            row.seq, row.greedy, min(row.cap, kmax), row.model_ok, row.context, lambda: row.match_len, row.catch_up
        )

    def plan_one(
        self,
        seq: SeqAcceptance,
        greedy: bool,
        cap: int,
        model_ok: bool,
        context: int,
        match_len: Callable[[], int],
        catch_up: int = 0,
    ) -> Choice:
        """:meth:`plan` for a batch of one free row (neither forced nor seeded): k in 0..cap and the
        drafter, without the batch's arrays (see _choose_one). ``catch_up``: RowPlan.catch_up.

        ``match_len()`` gives the n-gram's match length, and is only called where an n-gram option
        could be chosen: priced as if the match reached ``cap``, an option that still loses to the
        draft model's (or to none) loses with any shorter match too, and the model's options and
        the width range do not depend on the match. Most rounds with a draft model never need the
        lookup, which costs more than the rest of the choice once a forward pass has left the
        caches cold. The choice is the same as with the match looked up first."""
        prior = self.global_acceptance(greedy)
        # Without the model the match is every option's, and whether the row can guess at all.
        known = -1 if model_ok else match_len()
        acc = _pulled(seq, prior, self.cfg.seq_prior_weight, cap, cap if known < 0 else min(known, cap))
        cost = self.cost_model()
        catch_up_share = catch_up / self.cfg.catch_up_rounds

        def choose(width_range: tuple[int, int] | None) -> Choice:
            nonlocal known
            c = _choose_one(acc, cap if known < 0 else known, model_ok, cap, cost, width_range, context, catch_up_share)
            # (A row's Choice answers in ints: alone, width is its k and model_steps is k or 0; a
            # numpy scalar read costs microseconds between forward passes.)
            if known < 0 and c.width > c.model_steps:  # the n-gram wins if its match is long enough: look
                known = match_len()
                c = _choose_one(acc, known, model_ok, cap, cost, width_range, context, catch_up_share)
            return c

        choice = choose(None)
        explore = self._exploration_range(choice, model_ok or known > 0, cap)
        if explore is not None:
            lo, hi, bounded = explore
            choice = self._explored(choice, choose((lo, hi)), bounded)
        self.stats.rounds += 1
        self.stats.chosen_k = [choice.width]
        return choice

    def _explored(self, best: Choice, trial: Choice, bounded: bool) -> Choice:
        """The exploratory choice, unless ``bounded`` and it is expected to lose more than
        explore_max_loss."""
        if bounded and trial.goodput < (1.0 - self.cfg.explore_max_loss) * best.goodput:
            return best
        self.stats.explored += 1
        return trial

    def dormant(self) -> bool:
        """Whether this round of a batch of more than one runs plain without a plan: for a rest
        after a plan that chose speculation off everywhere (``dormant_rounds``, doubling while the
        plans keep resting, up to ``dormant_rounds_max``). Rows whose plan must not depend on their
        batch (seeded sampled ones) are the caller's to exclude."""
        if self._dormant > 0:
            self._dormant -= 1
            return True
        return False

    def _exploration_range(self, choice: Choice, can_guess: bool, kmax: int) -> tuple[int, int, bool] | None:
        """Now and then verify a width off the optimum, so the cost fit sees how verify time grows
        with the verified tokens (a batch that always runs one width cannot tell): (lo, hi, and
        whether the trial is bounded by explore_max_loss). Only a width anywhere is bounded, and
        only past the young rounds and from explore_bounded_rows rows up: the neighbours and the
        first probe are what the fit learns slopes from, and at a small batch the staircase's steps
        are only found by trying widths far from the chosen one."""
        if not can_guess or kmax <= 0:
            return None
        u = self.rng.random()
        if choice.width == 0:  # speculation off (under load, say): only the cheapest probe
            return (1, 1, False) if u < self.cfg.explore_start else None
        cfg = self.cfg
        young = self._timed_round < cfg.young_rounds
        rows = len(choice.ks)
        alone = rows == 1
        if not alone:
            if u < cfg.explore_plain:
                return (0, 0, False) if self._unsettled(rows, 0) else None
            u = (u - cfg.explore_plain) / (1.0 - cfg.explore_plain)
        if young:
            anywhere, width = cfg.explore_anywhere_young, cfg.explore_width
        else:
            anywhere = cfg.explore_anywhere_alone if alone else cfg.explore_anywhere
            width = cfg.explore_width_alone if alone else cfg.explore_width
        if u < anywhere:
            w = self.rng.randint(1, kmax)
            return (w, w, not young and rows >= cfg.explore_bounded_rows) if self._unsettled(rows, w) else None
        u = (u - anywhere) / (1.0 - anywhere)
        if u < width:
            w = choice.width + (1 if self.rng.random() < 0.5 and choice.width < kmax else -1)
            return (w, w, False) if self._unsettled(rows, w) else None
        return None

    def _resting_probe(
        self, plain: Choice, choose_within: Callable[[tuple[int, int], bool], Choice], kmax: int
    ) -> Choice | None:
        """Instead of a rest after ``plain`` (explore_resting): the best round with guesses, where
        rounds of its shape were never timed. A batch at rest plans once per rest and times nothing
        in between, so without this a plain plan made from prices never timed at the batch's size
        was as good as final."""
        if self.rng.random() >= self.cfg.explore_resting:
            return None
        trial = choose_within((1, kmax), True)
        if trial.width == 0 or self._seen.get((len(trial.ks), trial.width), 0.0) > 0.0:
            return None
        return self._explored(plain, trial, bounded=False)

    def _new_shape(self, rows: int, width: int) -> bool:
        """Whether no round of ``rows`` rows at ``width`` has been timed, folded in or waiting to be,
        among the shapes the staircase keeps (fewer than step_tokens verified tokens; larger ones
        are never kept, so never counted as timed)."""
        if rows * (width + 1) >= self.cfg.step_tokens or (rows, width) in self._seen:
            return False
        return not any(t[0] == rows and t[1] == width for t in self._timings)

    def _unsettled(self, rows: int, width: int) -> bool:
        """Whether a trial of ``width`` at ``rows`` rows goes ahead: always where rounds of that
        shape were never timed, less often the more were (explore_settled). By shape, not by the
        staircase's count of verified tokens: 4 rows at k = 3 and 16 plain rows verify the same 16
        tokens, and the first must not keep a batch of 16 from timing the second at the full rate."""
        seen = self._seen.get((rows, width), 0.0)
        w = self.cfg.explore_settled
        return seen <= 0.0 or self.rng.random() * (seen + w) < w

    # ----------------------------------------------------------------------- observing

    def observe_rows(self, rows: Sequence[tuple[SeqAcceptance, bool, int, int, int]]) -> None:
        """After verification: per row (its stats, greedy, drafter code or -1, guesses made, accepted).

        Every row's own counts decay each of its rounds (so a drafter it stopped using drifts back to
        the engine-wide rate and gets tried again); the engine-wide counts decay per round.
        """
        for counts in self.global_counts:
            counts.decay(self.cfg.global_decay)
        self._global_age[0] += 1
        self._global_age[1] += 1
        seq_decay, own_decay = self.cfg.seq_decay, self.cfg.own_decay
        for seq, greedy, drafter, proposed, accepted in rows:
            seq.decay(seq_decay)
            seq.own.decay(own_decay)
            if drafter < 0 or proposed <= 0:
                continue
            seq.record(drafter, proposed, accepted)
            seq.own.record(drafter, proposed, accepted)
            self.global_counts[int(greedy)].record(drafter, proposed, accepted)

    def observe_costs(
        self,
        rows: int,
        width: int,
        verify_seconds: float,
        model_steps: int,
        model_rows: int,
        draft_seconds: float,
        keys: int = 0,
        caught_up: int = 0,
        tokens: int | None = None,
    ) -> None:
        """One round's timings: verification of ``rows`` rows at ``width`` over ``keys`` tokens of
        context (and the emit that follows), and ``model_steps`` draft-model steps for
        ``model_rows`` rows (0 if unused) after feeding them ``caught_up`` tokens of catch-up.
        ``tokens``: the tokens the forward computed (default ``rows * (width + 1)``; fewer where it
        skips the padding of rows that verify fewer guesses than the width). The fit is of those,
        so a plan pricing every row at the full width prices an upper bound of such a round."""
        self.cost_model()  # refits first if due: every timing waiting to be folded in is priced by one model
        first_verify = self._timed_round == 0
        drafted = model_steps > 0 and model_rows > 0
        first_draft = drafted and not self._draft_timed
        self._timed_round += 1
        self._draft_timed = self._draft_timed or drafted
        first_of_shape = self._new_shape(rows, width)
        verified = rows * (width + 1) if tokens is None else tokens
        took = verify_seconds + (draft_seconds if drafted else 0.0)
        if rows > 1 and took >= self.cfg.surprise_seconds and not self._stale:
            c = self._cost  # the model the round was planned with (cost_model() above set it)
            priced = c.verify_tokens(rows, verified, keys) + c.draft(model_steps, model_rows, caught_up)
            factor = self.cfg.surprise_factor
            self._stale = took > factor * priced or took * factor < priced
        self._timings.append(
            (
                rows,
                width,
                keys,
                verify_seconds,
                model_steps if drafted else 0,
                model_rows,
                draft_seconds,
                caught_up,
                verified,
            )
        )
        self._cost_age += 1
        if first_verify or first_draft or first_of_shape:
            # The first timings replace the prior at once; a shape's first timing is folded in at
            # the next plan too, so a batch resting at a new size probes each width once, not at
            # every plan until the periodic refit (see _resting_probe).
            self._stale = True

    def _fold_timings(self) -> None:
        """Fold the timings taken since the last refit into the fits, in order, each checked against
        the cost model they were taken under (one tight loop every ``refit_every`` rounds: between
        forward passes the caches are cold, and a pass over this code every round costs several
        times what it costs here)."""
        cfg, c = self.cfg, self._cost
        first = self._timed_round - len(self._timings)  # rounds timed before these
        for i, (
            rows,
            width,
            keys,
            verify_seconds,
            model_steps,
            model_rows,
            draft_seconds,
            caught_up,
            tokens,
        ) in enumerate(self._timings, start=first):
            timed_verify = i > 0
            predicted = c.verify_tokens(rows, tokens, keys)
            # A round far slower than predicted (another process took the core) is clipped, not trusted.
            limit = _clip_limit(predicted, cfg.outlier_factor) if timed_verify else float("inf")
            y = min(verify_seconds, limit)
            self.verify_fit.decay(cfg.cost_decay)
            self.draft_fit.decay(cfg.cost_decay)
            features = (1.0, rows, float(tokens), float(keys))
            self.verify_fit.add(features, y)
            if timed_verify and tokens < cfg.step_tokens:
                decay = cfg.step_decay
                self._step_y[tokens] = self._step_y[tokens] * decay + y
                sums = self._step_x[tokens]
                for j, f in enumerate(features):
                    sums[j] = sums[j] * decay + f
                self._step_n[tokens] = self._step_n[tokens] * decay + 1.0
                self._step_top = max(self._step_top, tokens + 1)
                shape = (rows, width)
                self._seen[shape] = self._seen.get(shape, 0.0) * decay + 1.0
            if model_steps > 0:
                # The first timing (a draft service's time-out, say) is checked against the prior.
                predicted = c.draft(model_steps, model_rows, caught_up)
                limit = _clip_limit(predicted, (1 if self.draft_fit.fitted else 2) * cfg.outlier_factor)
                x = (1.0, model_steps, model_steps * float(model_rows), float(caught_up))
                self.draft_fit.add(x, min(draft_seconds, limit))
        self._timings.clear()
