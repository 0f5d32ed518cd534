"""Drafting ahead: the draft prepares a sequence's next block while the target verifies this one.

After the draft sends a block ``d1..dk`` for a committed prefix ``x``, the target commits one of

- ``x d1..dk b``: every guess accepted, then its bonus token ``b``;
- ``x d1..d(j-1) t``: guess ``j`` rejected and replaced by the target's token ``t``.

Between rounds the draft guesses the likeliest of these outcomes and drafts the block for each
(a *branch*), one batched model step at a time, so that a round's arrival is noticed within a step:

- the main line: all accepted, with the draft's own best bonus token (its step runs first, in the
  sequence's own cache, feeding ``dk``);
- a rejection at position ``j``, replaced by the draft's runner-up token there (a slot of its own
  that shares the cache blocks of the common prefix: ModelDrafter.fork), and then by its third
  likeliest token;
- all accepted with the draft's second-best bonus token.

How many branches each sequence gets (its *width*, in that order of likelihood: main, rejection at
1, second bonus, rejection at 2, ..., rejection at k; then the rejections with the third likeliest
token at 1, ..., k) is set per stream by :class:`AheadPolicy` from whether the
prepared work finished before the target's next round (for offered blocks: whether the outcome's
block reached the target before it asked for one); with no spare time at all it switches drafting
ahead off for a while.

When the outcome arrives, the branch whose assumed prefix *is* the committed prefix serves its
block (finished first when it is short of the guesses asked for); every other branch is dropped
and, if none matched, the draft drafts afresh from the committed prefix.

Offering (the round's ``offer_prepared``): a branch is also sent to the target the moment it is
complete (:class:`Offer`), so a target that commits the outcome it assumes verifies it at once,
without the round trip; its next round says so (``offer_taken``) and the draft serves that same
branch, as it would have anyway.

Lossless. A branch's guesses are drawn on its exact prefix, with the same processing and
truncation as a fresh block, from the uniforms of the seed the next round will carry (the target
sends it one round early: ProposeRow.next_round_seed), and a branch is served only when its prefix
is the committed one and the round's seed is that seed. A prepared block is therefore the block a
fresh draft would make on the same prefix in the same round (up to float rounding from another
batch shape, as with any change of batch companions), each guess goes out with the q it was drawn
from, and neither the law of the output nor a seeded request's tokens depend on whether, or how
far, the draft got ahead.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from specd.services.engine.drafters import ALTERNATIVES, ModelDrafter, likeliest, other_than_list
from specd.services.engine.sampling import BatchSampling, SamplingParams, processed_probs, sample_from, uniforms
from specd.services.engine.sparse import to_sparse, truncate_probs
from specd.services.engine.transfer import to_device

# Most branches per sequence: the main line, the second bonus token, and rejections at positions
# 1..6 (past those a rejection is rarely the outcome), each with ALTERNATIVES replacement tokens.
MAX_WIDTH = 2 + 6 * ALTERNATIVES
START_WIDTH = 2
# Rounds in a row that arrive before a single prepared step is useful (<= 1 step done) before
# drafting ahead pauses, and how many rounds the pause lasts before it tries again.
STARVED_ROUNDS = 8
PAUSE_ROUNDS = 64
# Offering plans: rounds in a row not late (see OfferTiming) before the width grows by one; a late
# round shrinks it at once. Their branches step together and are offered together, so each extra
# branch delays every offer by its share of a step. Widening on idle time alone, as plans that are
# not offered do, grew the demo pair's width to 9-14, where 28% of rounds found their block
# prepared but not yet offered (it came a round trip too late) and the target waited; capped at 6,
# 3% (pinned stack, one stream, k = 4: 554 tok/s against 544 at 9, 515 at 14, 486 at 3).
GROW_AFTER_ON_TIME = 8


class OfferTiming(enum.Enum):
    """What a round says about the timing of an offering plan's offers."""

    NONE = 0  # no offering plan's branch matched the outcome: nothing to judge by
    ON_TIME = 1  # the target verified the offered block without asking
    LATE = 2  # the outcome's branch was prepared but not offered before the target asked


@dataclass
class Branch:
    """One guessed outcome and the block drafted for it so far."""

    holder: str  # the ModelDrafter entry whose cache it writes (the sequence's own key: the main line)
    suffix: tuple[int, ...]  # committed tokens it assumes after its plan's base prefix
    position: int  # cache position of the next input
    feed: int  # the next input token
    tokens: list[int] = field(default_factory=list)
    sparse_ids: list[np.ndarray] = field(default_factory=list)  # per guess, sampled rows: the q it was drawn from
    sparse_probs: list[np.ndarray] = field(default_factory=list)
    alternatives: list[list[int]] = field(default_factory=list)  # per guess, its likeliest replacements
    offered: bool = False  # sent to the target (offering plans), once complete


@dataclass(frozen=True)
class Offer:
    """A complete branch sent ahead of the round: its block and the outcome it assumes."""

    key: str
    base: int  # committed length of the round that served the plan's block
    assumed: tuple[int, ...]  # committed tokens it assumes after ``base``
    seed: int  # the round seed its guesses were drawn with (0: greedy)
    tokens: tuple[int, ...]
    sparse_ids: tuple[np.ndarray, ...]  # per guess, sampled rows: the q it was drawn from
    sparse_probs: tuple[np.ndarray, ...]


@dataclass
class SeqPlan:
    """What one sequence prepares for its next round."""

    key: str
    base: int  # committed length the served block was drafted on
    block: tuple[int, ...]  # the served block d1..dk
    alternatives: tuple[tuple[int, ...], ...]  # per position of the block, its likeliest replacements
    params: SamplingParams
    seed: int  # the next round's seed (sampled rows)
    want: int  # guesses per branch (the k of the round just served)
    width: int  # branches to prepare
    u: torch.Tensor | None  # [max_k] float64: the next round's uniforms (sampled rows), as a fresh block draws them
    offer: bool = False  # send each branch to the target once complete
    probing: bool = True  # the main line's bonus step is still to run
    forked: bool = False  # the rejection branches exist
    branches: list[Branch] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def complete(self) -> bool:
        return not self.probing and all(len(b.tokens) >= self.want for b in self.branches)


@dataclass(frozen=True)
class Window:
    """The prepared work between two rounds of a lane, as the policy judges it."""

    steps: int  # prepared steps run before the round came
    complete: bool  # every branch was finished
    idle_seconds: float  # from the work's end to the round
    step_seconds: float  # mean step time
    offering: bool  # its plans offered their branches


@dataclass
class Claim:
    """A prepared branch that matches a round's outcome."""

    branch: Branch
    plan: SeqPlan
    ready: bool  # it already holds every guess asked for (else it is finished this round)


@dataclass
class AheadPolicy:
    """Per stream: how many branches a sequence gets, from how the previous window went.

    Grows the width when the prepared work finished with a step to spare before the round came,
    shrinks it when the round came first, and pauses drafting ahead when the rounds keep arriving
    before more than one step is done (the draft has no spare time: a step in flight only delays
    the round).
    """

    width: int = START_WIDTH
    max_width: int = MAX_WIDTH
    starved: int = 0
    paused: int = 0
    on_time: int = 0  # offering plans: rounds in a row not late

    def planned_width(self) -> int:
        """Branches per sequence for the next window (0: paused)."""
        return 0 if self.paused else self.width

    def round(self) -> None:
        """A round arrived (called once per round with rows, after :meth:`observe` if any)."""
        if self.paused:
            self.paused -= 1

    def observe(
        self,
        steps: int,
        complete: bool,
        idle_seconds: float,
        step_seconds: float,
        offering: bool = False,
        timing: OfferTiming = OfferTiming.NONE,
    ) -> None:
        """One window: ``steps`` prepared steps ran before the round came; ``complete``: every
        branch was finished, ``idle_seconds`` before the round came; ``step_seconds``: mean step
        time; ``offering``: its plans offer their branches, and ``timing`` says whether in time.

        A plan that is offered has to beat the target's verify pass, not the round's message, which
        comes a round trip later (after the pass when the offer was late): its width grows only
        after GROW_AFTER_ON_TIME rounds in a row that were not late, and shrinks on a late one."""
        if offering and timing is OfferTiming.LATE:
            self.on_time = 0
            self.starved = 0
            self.width = max(1, self.width - 1)
            return
        if complete:
            self.starved = 0
            if offering:
                self.on_time += 1
                if self.on_time >= GROW_AFTER_ON_TIME:
                    self.on_time = 0
                    self.width = min(self.width + 1, self.max_width)
            elif idle_seconds >= step_seconds:
                self.width = min(self.width + 1, self.max_width)
            return
        self.on_time = 0
        self.width = max(1, self.width - 1)
        self.starved = self.starved + 1 if steps <= 1 else 0
        if self.starved >= STARVED_ROUNDS:
            self.starved, self.paused, self.width = 0, PAUSE_ROUNDS, 1


class AheadLane:
    """The prepared blocks of one Draft stream, and the steps that draft them.

    Used from the draft's one model thread, like the worker that owns it.
    """

    def __init__(self, drafter: ModelDrafter, support: int, max_k: int, spare_blocks: Callable[[], int]) -> None:
        """``spare_blocks()``: cache blocks a fork may take without starving fresh work."""
        self.drafter = drafter
        self.support = support
        self.max_k = max_k
        self.spare_blocks = spare_blocks
        self.plans: dict[str, SeqPlan] = {}
        self.offers: list[Offer] = []  # complete branches of offering plans, not yet sent
        self.policy = AheadPolicy()
        # This window (since the last round was served): steps run, their time, when the work ran out.
        self._steps = 0
        self._step_seconds = 0.0
        self._done_at: float | None = None
        # The window that a round ended, judged once the round's claims say how the offers went.
        self._ended: Window | None = None
        self._timing = OfferTiming.NONE

    # ------------------------------------------------------------------ rounds

    def round_started(self, keys: set[str]) -> None:
        """A round with rows arrived: note the window that ends (judged in :meth:`round_claimed`),
        drop plans it cannot use (a sequence missing from the round commits one more token without
        guesses, so no branch can match it any more)."""
        self._ended, self._timing = None, OfferTiming.NONE
        if self.plans:
            complete = all(p.complete() for p in self.plans.values())
            idle = time.perf_counter() - self._done_at if self._done_at is not None else 0.0
            mean = self._step_seconds / self._steps if self._steps else 0.0
            offering = any(p.offer for p in self.plans.values())
            self._ended = Window(self._steps, complete, idle, mean, offering)
        self.offers = []  # not sent before the round: the target no longer waits for them
        for key in [k for k in self.plans if k not in keys]:
            self.drop(key)
        self._steps, self._step_seconds, self._done_at = 0, 0.0, None

    def claim(self, key: str, committed: list[int], round_seed: int, k: int, taken: bool = False) -> Claim | None:
        """The branch prepared for exactly this committed prefix and seed, if any; every other
        branch of the sequence is freed. The claimed branch's KV entry is not touched.
        ``taken``: the target verified the block this lane offered for the outcome."""
        plan = self.plans.pop(key, None)
        if plan is None:
            return None
        match = None
        if len(committed) > plan.base and (plan.greedy or round_seed == plan.seed):
            suffix = tuple(committed[plan.base :])
            match = next((b for b in plan.branches if b.suffix == suffix), None)
        self._free(plan, keep=match)
        if match is None:
            return None
        if plan.offer and self._timing is not OfferTiming.LATE:
            self._timing = OfferTiming.ON_TIME if taken else OfferTiming.LATE
        return Claim(match, plan, len(match.tokens) >= k)

    def round_claimed(self) -> None:
        """The round's outcomes are claimed: judge the window that ended with it."""
        w = self._ended
        if w is not None:
            self.policy.observe(w.steps, w.complete, w.idle_seconds, w.step_seconds, w.offering, self._timing)
        self.policy.round()

    def finish(self, claims: list[tuple[Claim, int]]) -> None:
        """Draft the claimed branches on until each holds ``k`` guesses (their holders are the
        sequences' own entries by now)."""
        plans = []
        for c, k in claims:
            c.plan.branches, c.plan.want, c.plan.probing, c.plan.forked = [c.branch], k, False, True
            plans.append(c.plan)
        while self._step(plans):
            pass

    def plan(
        self,
        key: str,
        base: int,
        block: list[int],
        alternatives: list[list[int]],
        params: SamplingParams,
        seed: int,
        offer: bool = False,
    ) -> None:
        """Prepare the next round of ``key``, whose block ``block`` was just served on a committed
        prefix of length ``base`` (``seed``: the next round's seed, sampled rows; ``offer``: send
        each branch to the target once complete)."""
        width = self.policy.planned_width()
        k = len(block)
        if width == 0 or k == 0 or len(alternatives) < k or (not params.greedy and not seed):
            return
        u = None
        if not params.greedy:
            # Exactly the uniforms a fresh block of the next round draws (one generator per row,
            # seeded by the round's seed; a longer draw starts with the shorter one).
            u = uniforms((self.max_k,), [seed], 1, "cpu")[0]
        alts = tuple(tuple(a) for a in alternatives)
        self.plans[key] = SeqPlan(key, base, tuple(block), alts, params, seed, k, width, u, offer)

    def drop(self, key: str) -> None:
        """Forget a sequence's prepared work (released, re-opened, out of sync)."""
        plan = self.plans.pop(key, None)
        if plan is not None:
            self._free(plan)

    def drop_all(self) -> None:
        for key in list(self.plans):
            self.drop(key)

    # ------------------------------------------------------------------ drafting ahead

    def pending(self) -> bool:
        """Whether a step would do anything."""
        return any(not p.complete() for p in self.plans.values())

    @torch.inference_mode()
    def step(self) -> bool:
        """One batched model step over every unfinished branch of this lane; False when nothing
        was left to do."""
        t0 = time.perf_counter()
        worked = self._step(list(self.plans.values()))
        if worked:
            self._steps += 1
            self._step_seconds += time.perf_counter() - t0
            self._collect_offers()
            if not self.pending():
                self._done_at = time.perf_counter()
        return worked

    def take_offers(self) -> list[Offer]:
        """The branches completed since the last call, to send to the target now."""
        offers, self.offers = self.offers, []
        return offers

    def _collect_offers(self) -> None:
        for p in self.plans.values():
            if not p.offer:
                continue
            for b in p.branches:
                if not b.offered and len(b.tokens) >= p.want:
                    b.offered = True
                    n = p.want
                    self.offers.append(
                        Offer(
                            p.key,
                            p.base,
                            b.suffix,
                            0 if p.greedy else p.seed,
                            tuple(b.tokens[:n]),
                            tuple(b.sparse_ids[:n]),
                            tuple(b.sparse_probs[:n]),
                        )
                    )

    def _step(self, plans: list[SeqPlan]) -> bool:
        for p in plans:
            if not p.forked:
                self._fork_rejections(p)
        # Rows: (plan, branch) for a branch's next guess, (plan, None) for the main line's bonus step.
        rows: list[tuple[SeqPlan, Branch | None]] = []
        holders, positions, feeds = [], [], []
        for p in plans:
            if p.probing:
                cand = [(None, p.key, p.base + len(p.block) - 1, p.block[-1])]
            else:
                cand = []
            cand += [(b, b.holder, b.position, b.feed) for b in p.branches if len(b.tokens) < p.want]
            for b, holder, pos, feed in cand:
                if not self.drafter.cache.reserve(self.drafter.slot_of(holder), pos + 1):
                    self._give_up(p, b)
                    continue
                rows.append((p, b))
                holders.append(holder)
                positions.append(pos)
                feeds.append(feed)
        if not rows:
            return False
        model = self.drafter.model
        device = model.device
        cache = self.drafter.cache
        slots = [self.drafter.slot_of(h) for h in holders]
        logits = model.forward(
            to_device(feeds, device, torch.long).view(-1, 1),
            cache,
            cache.layout(slots, positions, 1, device),
            "all",
        )[:, 0]  # [R, V]
        for h, pos in zip(holders, positions):
            self.drafter.wrote(h, pos + 1)
        tokens, top = likeliest(logits)  # argmax, and [R, A + 1] for the bonus branches' tokens
        sampled = [i for i, (p, b) in enumerate(rows) if b is not None and not p.greedy]
        ids = probs = None
        if sampled:
            tokens = tokens.clone()  # sampled rows overwrite theirs
            # The same processing, truncation and inverse-CDF draw as ModelDrafter._propose.
            idx = to_device(sampled, device)
            sampling = BatchSampling.from_params([rows[i][0].params for i in sampled], device)
            q = processed_probs(logits[idx].unsqueeze(1), sampling)[:, 0]
            if self.support:
                q = truncate_probs(q, self.support)
            u = to_device(torch.stack([rows[i][0].u[len(rows[i][1].tokens)] for i in sampled]), device)
            tokens[idx] = sample_from(q, u)
            ids, probs = (t.cpu().numpy() for t in to_sparse(q, self.support))
        host_tokens, host_top = tokens.tolist(), top.tolist()  # one sync
        where = {i: n for n, i in enumerate(sampled)}
        for i, (p, b) in enumerate(rows):
            if b is None:
                self._branch_on_bonus(p, host_top[i])
                continue
            b.tokens.append(host_tokens[i])
            b.alternatives.append(other_than_list(host_top[i], host_tokens[i]))  # as ModelDrafter's
            if i in where:
                keep = probs[where[i]] > 0.0  # the wire carries only the support
                b.sparse_ids.append(ids[where[i]][keep])
                b.sparse_probs.append(probs[where[i]][keep])
            b.feed, b.position = host_tokens[i], b.position + 1
        return True

    def _order(self, p: SeqPlan) -> list[str]:
        """Branch names in order of likelihood, cut to the plan's width: "main", "bonus2", and
        "reject<j>.<a>" (rejected at position j, replaced by the a-th likeliest other token)."""
        k = len(p.block)
        names = ["main", "reject1.1", "bonus2"] + [f"reject{j}.1" for j in range(2, k + 1)]
        names += [f"reject{j}.{a}" for a in range(2, ALTERNATIVES + 1) for j in range(1, k + 1)]
        return names[: p.width]

    def _fork_rejections(self, p: SeqPlan) -> None:
        p.forked = True
        for name in self._order(p):
            if not name.startswith("reject"):
                continue
            j, a = (int(n) for n in name[len("reject") :].split("."))
            length = p.base + j - 1  # the cache holds x d1..d(j-1)
            b = self._fork(p, name, length, p.block[: j - 1] + (p.alternatives[j - 1][a - 1],))
            if b is None:
                return

    def _branch_on_bonus(self, p: SeqPlan, top: list[int]) -> None:
        """The main line's bonus step ran: branch on the draft's two likeliest bonus tokens (``top``:
        its likeliest tokens there, likeliest first)."""
        p.probing = False
        end = p.base + len(p.block)  # the cache now holds x d1..dk
        names = self._order(p)
        if "main" in names:
            p.branches.insert(0, Branch(p.key, p.block + (top[0],), end, top[0]))
        if "bonus2" in names:
            self._fork(p, "bonus2", end, p.block + (top[1],))

    def _fork(self, p: SeqPlan, name: str, length: int, suffix: tuple[int, ...]) -> Branch | None:
        holder = f"{p.key}#{name}"
        cache = self.drafter.cache
        need = cache.blocks_for(length + p.want + 1) - length // cache.block_size
        if need > self.spare_blocks() or not self.drafter.fork(p.key, holder, length):
            return None
        b = Branch(holder, suffix, length, suffix[-1])
        p.branches.append(b)
        return b

    def _give_up(self, p: SeqPlan, b: Branch | None) -> None:
        """No cache blocks for the next position: stop this branch (or the main line's step)."""
        if b is None:
            p.probing = False
        else:
            p.branches.remove(b)
            if b.holder != p.key:
                self.drafter.remove(b.holder)

    def _free(self, plan: SeqPlan, keep: Branch | None = None) -> None:
        for b in plan.branches:
            if b is not keep and b.holder != plan.key:
                self.drafter.remove(b.holder)
