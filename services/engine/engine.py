"""The batched speculative round loop: admit, draft, verify, emit, evict.

One :meth:`Engine.step` is one round for every running sequence:

1. **admit** waiting requests while a slot and KV blocks for their prompt are free (continuous
   batching), and prefill one chunk of the admitted prompts (chunked prefill: several prompts in one
   batched pass, ``prefill_chunk`` tokens at most; a long prompt takes several steps);
2. **draft**: each sequence's drafter (model, n-gram, or none) guesses up to k tokens;
3. **verify**: the target scores ``[last token, guesses...]`` for all sequences in one forward pass;
   greedy rows go through :func:`greedy_verify`, sampled rows through :func:`rejection_sample`;
4. **emit** the verified tokens (one host sync per round), applying EOS, max_tokens, context length
   and stop strings; roll every KV cache back to the accepted prefix;
5. **evict** finished sequences and free their slots.

Speculation off (method "none") runs the very same path with zero guesses, so it is the baseline.
Method "auto" (the default) lets :mod:`specd.services.engine.controller` pick each round, per sequence,
k in 0..num_tokens and the drafter (n-gram where it has a match, the draft model, or none) from
what earlier rounds measured; k depends only on the past, so the output law is unchanged.

Cache invariant: for every decoding sequence, both caches hold all committed tokens but the last;
the last one is the first input of the next round. A sequence still prefilling holds fewer.

KV memory is one block pool per model sized by a byte budget (:mod:`specd.services.engine.kv_cache`). A
decoding sequence takes blocks as it grows; when the pool runs dry the youngest sequence is
preempted (vLLM's recompute preemption): its blocks go back, and it is prefilled again, its
tokens so far as the prompt, when blocks free up. Nothing fails for want of memory; it waits.

Prefix caching (``EngineConfig.prefix_caching``, on by default where the target's pool keeps its own
storage): full blocks of final K/V are kept after their sequence ends, and a prompt that starts with
the same tokens (a system prompt, an earlier turn of the conversation, a preempted sequence coming
back) takes them instead of prefilling them again. The target's own forward is batch invariant, so
reused K/V are the very values a fresh prefill would write (bf16 and the fused forward; in float32
above 32 rows the matmul's blocking may differ in the last bit). An in-process draft model keeps
its own prompts' blocks the same way (ModelDrafter).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from specd.services.common.constants import (
    AUTO_NUM_TOKENS,
    CATCH_UP_TOKENS,
    DEFAULT_SPECULATION_METHOD,
    MAX_SPECULATIVE_TOKENS,
    METHODS_USING_DRAFT_MODEL,
    SPECULATION_METHODS,
)
from specd.services.engine.controller import (
    DRAFTER_NAMES,
    MODEL,
    NGRAM,
    ControllerConfig,
    RowPlan,
    SeqAcceptance,
    SpeculationController,
)
from specd.services.engine.detokenize import Detokenizer
from specd.services.engine.drafters import Drafter, DraftRow, ModelDrafter, NGramDrafter
from specd.services.engine.errors import ErrorCode, Field, RequestError
from specd.services.engine.kv_cache import DEFAULT_KV_BLOCK_SIZE, DEFAULT_KV_CACHE_MEMORY, pool_blocks
from specd.services.engine.model import CausalLM, check_same_vocab
from specd.services.engine.prefill import DEFAULT_PREFILL_CHUNK, PrefillRow, chunk_budget, plan_chunk, prefill_pass
from specd.services.engine.rejection import greedy_verify, rejection_sample
from specd.services.engine.sampling import BatchSampling, SamplingParams, draw_seed, make_generator, processed_probs
from specd.services.engine.sparse import SparseProbs
from specd.services.engine.stats import SpecStats
from specd.services.engine.transfer import to_device
from specd.services.engine.warmup import warm_up

log = logging.getLogger(__name__)

# Who made a row's verified guesses, by the controller's drafter code (NGRAM, MODEL, -1 = nobody).
DRAFTER_LABELS = (*DRAFTER_NAMES, "none")


@dataclass(frozen=True)
class SpecConfig:
    """How one request speculates."""

    method: str = DEFAULT_SPECULATION_METHOD  # one of SPECULATION_METHODS (services/common/constants.py)
    num_tokens: int = AUTO_NUM_TOKENS  # for "auto": the largest k allowed

    def __post_init__(self) -> None:
        if self.method not in SPECULATION_METHODS:
            raise RequestError(
                f"speculation method must be one of {SPECULATION_METHODS}, got {self.method!r}", Field.SPECULATION
            )
        if not 0 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise RequestError(f"num_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}]", Field.SPECULATION)

    @property
    def k(self) -> int:
        return 0 if self.method == "none" else self.num_tokens


@dataclass(frozen=True)
class Request:
    """A generation request as the engine sees it: token ids in, token ids out."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    spec: SpecConfig = SpecConfig()
    cache_salt: str = ""  # prefix caching: reuse only what requests with the same salt cached


@dataclass(frozen=True)
class EngineConfig:
    """Capacity of one engine instance."""

    max_batch_size: int = 16
    max_model_len: int | None = None  # prompt + generated tokens; None: the target's own context
    ngram_min: int = 2
    ngram_max: int = 4
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # most prompt tokens per prefill pass (prefill.chunk_budget)
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY  # bytes of the target's block pool (an in-process
    # draft gets a pool of as many positions)
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE
    prefix_caching: bool = True  # reuse the target's K/V of earlier prompts' common prefixes
    warm_up: bool = True  # run each model once at start (services/engine/warmup.py)
    # A seeded sampled "auto" request's plan: from its own history and fixed costs, so its text
    # repeats whatever shares its batch (True), or from measured timings and load like any other
    # request's (False: faster under load, its text then depends on what shares its batch).
    pin_seeded: bool = True

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        if self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")


@dataclass(frozen=True)
class EngineLimits:
    """What a request must fit, fixed for the engine's lifetime: what a front end (the target's
    servicer) may know of the engine without touching it."""

    max_len: int  # prompt + generated tokens
    vocab_size: int
    has_model_drafter: bool  # the "draft" and "hybrid" methods are available

    @property
    def speculation_methods(self) -> tuple[str, ...]:
        return tuple(m for m in SPECULATION_METHODS if self.has_model_drafter or m not in METHODS_USING_DRAFT_MODEL)


@dataclass
class StepOutput:
    """What one round produced for one request."""

    request_id: str
    token_ids: list[int]  # newly verified tokens, in order
    num_from_draft: int  # the first num_from_draft of token_ids were accepted guesses
    text: str  # newly final text (stop strings and partial UTF-8 held back)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stats: SpecStats | None = None
    proposed: int = 0  # guesses verified for this request this round
    accepted: int = 0  # of which the target kept this many
    k: int = 0  # block size asked of the drafter this round (0: decoded without speculation)
    drafter: str = "none"  # who made the verified guesses: "draft", "ngram" or "none"
    cached_prompt_tokens: int = 0  # prompt positions whose K/V the prefix cache held (not computed)


@dataclass
class RoundInfo:
    """Timings of the last round, for exporters (the engine itself keeps no metrics)."""

    batch_size: int = 0
    draft_seconds: float = 0.0  # proposing, including any network round trip to a draft service
    verify_seconds: float = 0.0  # target forward pass, verification and the round's host sync


@dataclass
class _Seq:
    req: Request
    slot: int
    tokens: list[int]
    generator: torch.Generator  # the request's random stream: one seed per round for the verification
    draft_generator: torch.Generator  # and one per round for the draft model's guesses
    detok: Detokenizer
    prompt_len: int
    order: int  # admission order: the youngest is preempted first
    cached: int = 0  # positions of tokens in the target cache (len(tokens) - 1 once decoding)
    cached_prompt: int = 0  # of the prompt's positions, how many the prefix cache held at admission
    has_blocks: bool = False  # blocks for the prompt are reserved (false again after a preemption)
    stats: SpecStats = field(default_factory=SpecStats)
    acceptance: SeqAcceptance = field(default_factory=lambda: SeqAcceptance(MAX_SPECULATIVE_TOKENS))

    @property
    def decoding(self) -> bool:
        return self.cached == len(self.tokens) - 1

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class Engine:
    """Continuous-batching speculative decoder over one target and optional drafters."""

    def __init__(
        self,
        target: CausalLM,
        tokenizer,
        draft: CausalLM | None = None,
        config: EngineConfig = EngineConfig(),
        drafter: Drafter | None = None,
    ) -> None:
        """``draft`` is an in-process draft model (the engine sizes its drafter's cache like its own);
        ``drafter`` any other model drafter object (e.g. a client of remote draft services) serving
        the "draft" and "hybrid" methods. At most one of the two; :meth:`close` closes it."""
        self.target = target
        self.tokenizer = tokenizer
        self.config = config
        self.max_len = min(config.max_model_len or target.info.max_context, target.info.max_context)
        bs = config.kv_block_size
        # Room for a full block of guesses past the last committed position.
        cache_len = self.max_len + MAX_SPECULATIVE_TOKENS + 2
        blocks = pool_blocks(config.kv_cache_memory, target.kv_bytes_per_token, bs, config.max_batch_size, cache_len)
        if blocks * bs < cache_len:
            # A budget below one full-length sequence: serve shorter ones rather than refuse to start.
            self.max_len = max(1, blocks * bs - MAX_SPECULATIVE_TOKENS - 2)
            log.warning(
                "KV budget of %d bytes holds %d positions: max_model_len capped to %d",
                config.kv_cache_memory,
                blocks * bs,
                self.max_len,
            )
        self.cache = target.new_paged_cache(config.max_batch_size, blocks, bs, cache_len)
        self.ngram = NGramDrafter(config.ngram_min, config.ngram_max)
        if draft is not None and drafter is not None:
            raise ValueError("pass a draft model or a drafter, not both")
        if draft is not None:
            check_same_vocab(target.info, draft.info)
            # As many positions as the target's pool: the draft is never the tighter limit.
            draft_memory = blocks * bs * draft.kv_bytes_per_token
            drafter = ModelDrafter(
                draft, config.max_batch_size, cache_len, 0, draft_memory, bs, prefix_caching=config.prefix_caching
            )
        self.model_drafter: Drafter | None = drafter  # the draft model, here or remote; None: n-gram only
        if config.warm_up:
            warm_up(target, self.cache)
            if isinstance(drafter, ModelDrafter):
                drafter.warm_up()
        if config.prefix_caching and self.cache.supports_prefix_caching:
            self.cache.enable_prefix_caching()
        self.eos = frozenset(target.info.eos_token_ids)
        self.waiting: deque[Request] = deque()
        # The request at the head of the queue and its prompt's digest chain (KV prefix lookups).
        self._head_chain: tuple[Request, list[bytes]] | None = None
        self.running: dict[str, _Seq] = {}
        self._aborted: set[str] = set()
        self.totals = SpecStats()  # summed over requests (per-request verification counts)
        self.rounds = 0  # batched target forward passes (decode rounds; prefill passes are counted apart)
        # When the last decode round ended with sequences still decoding (so the next round follows
        # at once): the caller's work in between (streaming the outputs, metrics) is a cost of
        # every round too, and the controller prices it.
        self._decoding_since: float | None = None
        self.prefill_passes = 0
        self.preemptions = 0
        self.prompt_tokens = 0  # of admitted requests
        self.cached_prompt_tokens = 0  # of those, held by the prefix cache at admission
        self._admitted = 0
        self.last_round = RoundInfo()
        self.device = target.device
        self.controller = SpeculationController(ControllerConfig(kmax=MAX_SPECULATIVE_TOKENS))

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(self.max_len, self.target.info.vocab_size, self.model_drafter is not None)

    def close(self) -> None:
        """Close the model drafter (a remote one's streams and channels)."""
        if self.model_drafter is not None:
            self.model_drafter.close()

    # -------------------------------------------------------------------------- requests

    def validate(self, req: Request) -> None:
        """Raise :class:`RequestError` for a request this engine can never serve (independent of
        engine state)."""
        if not req.prompt_ids:
            raise RequestError("prompt is empty", Field.PROMPT)
        if len(req.prompt_ids) >= self.max_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_len} tokens; "
                f"the prompt has {len(req.prompt_ids)} tokens",
                Field.PROMPT,
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            )
        vocab = self.target.info.vocab_size
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})", Field.PROMPT)
        if req.spec.method in METHODS_USING_DRAFT_MODEL and req.spec.k > 0 and self.model_drafter is None:
            raise RequestError(
                f"speculation method {req.spec.method!r} needs a draft model; none is loaded", Field.SPECULATION
            )

    def add_request(self, req: Request) -> None:
        """Validate and queue a request (:class:`RequestError` if it cannot be served); it joins the
        batch at the next round with a free slot."""
        self.validate(req)
        if req.request_id in self.running or any(w.request_id == req.request_id for w in self.waiting):
            raise RequestError(f"request id {req.request_id!r} is already running")
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        """Stop a request; its caches are freed at the start of the next step."""
        self._aborted.add(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------------ step

    def step(self) -> list[StepOutput]:
        """Run one round for all running sequences; returns what each produced."""
        called = time.perf_counter()
        between = called - self._decoding_since if self._decoding_since is not None else 0.0
        self._decoding_since = None
        outputs = self._evict_aborted()
        self._admit()
        self._prefill()
        # The controller prices the whole round: planning, proposing and emitting cost time per
        # round too, and a cost model blind to them would undervalue the rounds it saves.
        t_round = time.perf_counter()
        seqs = self._reserve_round([s for s in self.running.values() if s.decoding])
        if not seqs:
            return outputs
        ks = [self._block_size(s) for s in seqs]
        # The round's sampling settings as tensors, once (greedy rounds need none); drafting and
        # verifying take their rows.
        sampled = any(not s.req.params.greedy for s in seqs)
        sampling = BatchSampling.from_params([s.req.params for s in seqs], self.device) if sampled else None
        routes = [s.req.spec.method for s in seqs]  # per row: who guesses this round
        planned = any(r == "auto" for r in routes) and max(ks) > 0
        if planned and len(seqs) > 1 and self._may_rest(seqs, routes) and self.controller.dormant():
            # Speculation was off everywhere a moment ago: a plain round for the "auto" rows, unplanned.
            ks = [0 if r == "auto" else k for r, k in zip(routes, ks)]
            routes = ["none" if r == "auto" else r for r in routes]
            planned = False
        matched: dict[int, torch.Tensor] = {}
        if planned:
            ks, routes, matched = self._plan(seqs, ks, routes)
            keys = sum(len(s.tokens) for s in seqs)  # the round's context, before it grows
        t0 = time.perf_counter()
        # [B, K], [B, K, V] | None, per row NGRAM / MODEL / -1, and the draft model's share of the work
        guesses, q, drafted, model_work = self._propose(seqs, ks, routes, matched, sampling)
        from_model = [d == MODEL for d in drafted]
        t1 = time.perf_counter()
        K = guesses.shape[1]
        last = to_device([[s.tokens[-1]] for s in seqs], self.device)
        inputs = torch.cat([last, guesses.clamp_min(0)], dim=1)  # [B, K+1], stays on the device
        verified = self._verified_per_row(guesses) if K > 0 and self.target.skips_padding else None
        layout = self.cache.layout(
            [s.slot for s in seqs], [len(s.tokens) - 1 for s in seqs], K + 1, self.device, verified
        )
        logits = self.target.forward(inputs, self.cache, layout, "all")  # [B, K+1, V]
        self.rounds += 1
        token_ids, num_emitted = self._verify(seqs, logits, guesses, q, from_model, sampling)
        # The one host sync of the round: tokens, how many to emit, how many guesses were made.
        guessed = (guesses >= 0).sum(dim=1, keepdim=True)
        host = torch.cat([token_ids, num_emitted.unsqueeze(1), guessed], dim=1).tolist()
        self.last_round = RoundInfo(len(seqs), t1 - t0, time.perf_counter() - t1)
        for seq, row, d, k in zip(seqs, host, drafted, ks):
            outputs.append(self._emit(seq, row[: row[-2]], proposed=row[-1], drafter=d, k=k))
        if planned:
            tokens = sum(verified) if verified is not None else len(seqs) * (K + 1)
            self._observe(seqs, host, drafted, K, tokens, model_work, time.perf_counter() - t_round + between, keys)
        if any(s.decoding for s in self.running.values()):
            self._decoding_since = time.perf_counter()
        return outputs

    def _pinned(self, seq: _Seq) -> bool:
        """Whether the row's plan must not depend on timings or its batch: a seeded sampled request,
        unless the engine plans those from measurements too (EngineConfig.pin_seeded)."""
        return seq.req.params.seeded_sampling and self.config.pin_seeded

    def _may_rest(self, seqs: list[_Seq], routes: list[str]) -> bool:
        """Whether the "auto" rows may skip a plan: not when one is pinned (a seeded sampled request,
        whose plan comes from its own history alone, whatever shares the batch)."""
        return not any(r == "auto" and self._pinned(s) for s, r in zip(seqs, routes))

    def _evict_aborted(self) -> list[StepOutput]:
        outs = []
        for rid in list(self._aborted):
            self._aborted.discard(rid)
            if rid in self.running:
                seq = self.running[rid]
                self._release(seq)
                outs.append(StepOutput(rid, [], 0, "", True, "abort", seq.stats))
            else:
                self.waiting = deque(r for r in self.waiting if r.request_id != rid)
        return outs

    def _admit(self) -> None:
        """Waiting requests join, first come first, while a slot and the blocks for their prompt are
        free (plus one block of headroom per running sequence, so the newcomer does not at once
        force a preemption); the rest wait. A prompt's blocks that running sequences hold already
        (a shared system prompt, with prefix caching) are shared, not taken."""
        drafted: list[_Seq] = []  # admitted now, for the draft model
        while self.waiting and self.cache.free_slots > 0:
            req = self.waiting[0]
            headroom = len(self.running)
            # The last prompt token is fed by the first decode round (the cache invariant).
            limit = len(req.prompt_ids) - 1
            if self._head_chain is None or self._head_chain[0] is not req:
                # Hashed once, not at every step the request waits (a 32k-token prompt: ~4 ms here).
                self._head_chain = (req, self.cache.prefix_chain(req.prompt_ids, limit, req.cache_salt))
            chain = self._head_chain[1]
            need = self.cache.blocks_to_admit(req.prompt_ids, limit, req.cache_salt, chain)
            if need + headroom > self.cache.free_blocks:
                break
            self.waiting.popleft()
            self._head_chain = None
            slot = self.cache.allocate()
            prompt = list(req.prompt_ids)
            hit = self.cache.attach_prefix(slot, prompt, limit, req.cache_salt, chain)
            self.cache.reserve(slot, len(prompt))
            seed = req.params.seed
            seq = _Seq(
                req=req,
                slot=slot,
                tokens=prompt,
                # On the CPU whatever the device (sampling.py says why).
                generator=make_generator(seed),
                # The draft consumes its own stream, derived from the seed, so both repeat exactly.
                draft_generator=make_generator(None if seed is None else seed ^ 0x5DEECE66D),
                detok=Detokenizer(self.tokenizer, req.params.stop),
                prompt_len=len(prompt),
                order=self._admitted,
                cached=hit,
                cached_prompt=hit,
                has_blocks=True,
            )
            self._admitted += 1
            self.prompt_tokens += len(prompt)
            self.cached_prompt_tokens += hit
            if self._may_use_model(req):
                drafted.append(seq)
            self.running[req.request_id] = seq
        if drafted:
            self._add_to_draft(drafted)

    def _add_to_draft(self, seqs: list[_Seq]) -> None:
        """Hand the draft model the sequences just admitted. An "auto" one has its prompt prefilled
        ahead (beside the target) only where the controller would give a batch of this size the
        draft model at all: a wave of requests met by a batch at rest had the real pair's draft
        prefill 32 prompts for nothing, 3.6 s of its CPU on the cores the target decodes on
        (docs/benchmarks.md). Its prompt is fed at its first ask instead, priced as a catch-up.
        Fixed methods and pinned rows (seeded sampled ones, EngineConfig.pin_seeded) are always
        prefilled ahead: their plans do not depend on the load."""
        keys = sum(len(s.tokens) for s in self.running.values())
        drafts: dict[bool, bool] = {}  # by greedy: whether a batch this size would draft
        for seq in seqs:
            req = seq.req
            ahead = True
            if req.spec.method == "auto" and not self._pinned(seq):
                greedy = req.params.greedy
                if greedy not in drafts:
                    drafts[greedy] = self.controller.drafts_at(len(self.running), greedy, keys, req.spec.k)
                ahead = drafts[greedy]
            self.model_drafter.add(req.request_id, seq.tokens, req.params, req.cache_salt, prefill_ahead=ahead)

    def _may_use_model(self, req: Request) -> bool:
        if self.model_drafter is None:
            return False
        return req.spec.method in METHODS_USING_DRAFT_MODEL or req.spec.method == "auto"

    def _prefill(self) -> None:
        """One chunked-prefill pass of the target over the sequences still prefilling, and one of
        the in-process draft."""
        pending = sorted((s for s in self.running.values() if not s.decoding), key=lambda s: s.order)
        # A preempted sequence starts again once the blocks for all its tokens are free.
        pending = [s for s in pending if s.has_blocks or self._take_blocks(s)]
        # Tokens the decode round after this pass verifies: the pass is sized to cost about as much.
        decoding = sum(self._block_size(s) + 1 for s in self.running.values() if s.decoding)
        budget = chunk_budget(self.config.prefill_chunk, decoding)
        # The draft first: a remote one is sent the prompts admitted this step now, and prefills
        # them while this target does.
        if self.model_drafter is not None:
            self.model_drafter.prefill(budget)
        if pending:
            take = plan_chunk([len(s.tokens) - 1 - s.cached for s in pending], budget)
            rows = [(s, n) for s, n in zip(pending, take) if n > 0]
            prefill_pass(
                self.target,
                self.cache,
                [PrefillRow(s.slot, s.cached, s.tokens[s.cached : s.cached + n]) for s, n in rows],
            )
            self.prefill_passes += 1
            for s, n in rows:
                s.cached += n
                self.cache.register(s.slot, s.tokens, s.cached)

    def _take_blocks(self, seq: _Seq) -> bool:
        seq.cached = self.cache.attach_prefix(seq.slot, seq.tokens, len(seq.tokens) - 1, seq.req.cache_salt)
        seq.has_blocks = self.cache.reserve(seq.slot, len(seq.tokens))
        if not seq.has_blocks:
            self.cache.free_positions(seq.slot)
            seq.cached = 0
        return seq.has_blocks

    def _reserve_round(self, seqs: list[_Seq]) -> list[_Seq]:
        """Blocks for this round's positions of every decoding sequence; when the pool runs dry the
        youngest sequence gives its blocks back (and is prefilled again later). Returns the
        sequences that decode this round."""
        seqs = sorted(seqs, key=lambda s: s.order)
        out: list[_Seq] = []
        for s in seqs:
            if not s.has_blocks:
                continue  # preempted a moment ago, for an older sequence
            need = len(s.tokens) + self._block_size(s)
            while not self.cache.reserve(s.slot, need):
                victims = [v for v in self.running.values() if v.has_blocks and v is not s]
                victim = max(victims, key=lambda v: v.order, default=s)
                if victim.order < s.order:
                    victim = s  # never preempt an older sequence for a younger one
                self._preempt(victim)
                if victim is s:
                    break
            out.append(s)
        return [s for s in out if s.has_blocks]

    def _preempt(self, seq: _Seq) -> None:
        self.cache.register(seq.slot, seq.tokens, seq.cached)
        self.cache.free_positions(seq.slot)
        seq.cached, seq.has_blocks = 0, False
        self.preemptions += 1
        log.info("KV pool full: preempted %s (%d tokens, prefilled again later)", seq.req.request_id, len(seq.tokens))

    def _block_size(self, seq: _Seq) -> int:
        """Guesses worth making: never past max_tokens or the context."""
        remaining = min(seq.req.params.max_tokens - seq.generated, self.max_len - len(seq.tokens))
        return max(0, min(seq.req.spec.k, remaining - 1))

    def _plan(
        self, seqs: list[_Seq], ks: list[int], routes: list[str]
    ) -> tuple[list[int], list[str], dict[int, torch.Tensor]]:
        """The controller's choice for the "auto" rows: their k and route ("draft", "ngram", "none"),
        and their n-gram guesses where the n-gram was chosen. Other rows keep their method and k
        and are priced in as they are (they set a minimum width of the round)."""
        if len(seqs) == 1 and routes[0] == "auto" and not self._pinned(seqs[0]):
            return self._plan_alone(seqs[0], ks[0])
        lookup = self.ngram
        have_model = self.model_drafter is not None
        matches: dict[int, list[int]] = {}
        rows = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            p = seq.req.params
            if routes[i] == "auto":
                # A seeded sampled request is planned from its own history alone, so it repeats
                # exactly whatever shares its batch and however fast the rounds run (unless the
                # engine plans seeded rows from measurements: EngineConfig.pin_seeded).
                deterministic = self._pinned(seq)
                # A draft not ready for the row (prefilling it, or past its context) is no option.
                model_ok = have_model and self._draft_may_guess(seq)
                # (A seeded row with the model never uses the n-gram: controller.choose_seeded.)
                if k > 0 and not (deterministic and model_ok):
                    match = lookup.lookup(seq.tokens, k, seq.req.request_id)  # as "ngram" does
                    if match:
                        matches[i] = match
                rows.append(
                    RowPlan(
                        seq.acceptance,
                        p.greedy,
                        k,
                        len(matches.get(i, ())),
                        model_ok,
                        deterministic=deterministic,
                        context=len(seq.tokens),
                        catch_up=self._catch_up(seq) if model_ok and not deterministic else 0,
                    )
                )
            else:
                drafter = {"draft": MODEL, "hybrid": MODEL, "ngram": NGRAM}.get(routes[i], -1)
                rows.append(
                    RowPlan(
                        seq.acceptance,
                        p.greedy,
                        k,
                        0,
                        False,
                        k if drafter >= 0 else 0,
                        drafter,
                        context=len(seq.tokens),
                    )
                )
        choice = self.controller.plan(rows, max(ks))
        ks, routes = list(ks), list(routes)
        pre: dict[int, torch.Tensor] = {}
        for i in range(len(seqs)):
            if routes[i] != "auto":
                continue
            k, d = int(choice.ks[i]), int(choice.drafters[i])
            ks[i] = k
            if k == 0:
                routes[i] = "none"
            elif d == NGRAM:
                routes[i] = "ngram"
                pre[i] = torch.tensor(matches[i][:k], dtype=torch.long)
            else:
                routes[i] = "draft"
        return ks, routes, pre

    def _plan_alone(self, seq: _Seq, cap: int) -> tuple[list[int], list[str], dict[int, torch.Tensor]]:
        """:meth:`_plan` for a batch of one unseeded "auto" row (a seeded one is planned from fixed
        priors, with the batch's rows): the n-gram lookup only where the controller asks for it
        (see SpeculationController.plan_one)."""
        rid = seq.req.request_id
        found: list[int] = []

        def match_len() -> int:
            found.extend(self.ngram.lookup(seq.tokens, cap, rid))
            return len(found)

        model_ok = self.model_drafter is not None and self.model_drafter.ready(rid)
        choice = self.controller.plan_one(
            seq.acceptance,
            seq.req.params.greedy,
            cap,
            model_ok,
            len(seq.tokens),
            match_len,
            self._catch_up(seq) if model_ok else 0,
        )
        k = choice.width  # alone, the row's k; model_steps is k when the model drafts, else 0
        if k == 0:
            return [0], ["none"], {}
        if choice.model_steps == 0:
            return [k], ["ngram"], {0: torch.tensor(found[:k], dtype=torch.long)}
        return [k], ["draft"], {}

    def _catch_up(self, seq: _Seq) -> int:
        """Tokens the draft model would feed the row before guessing, past the usual (RowPlan.catch_up)."""
        return max(0, self.model_drafter.unseen(seq.req.request_id, len(seq.tokens)) - CATCH_UP_TOKENS)

    def _observe(
        self,
        seqs: list[_Seq],
        host: list[list[int]],
        drafted: list[int],
        width: int,
        tokens: int,
        model_work,
        seconds: float,
        keys: int,
    ) -> None:
        """Feed the controller what this round did: per row who guessed, how many, how many passed;
        and the round's timings (``seconds``: the whole round, and the caller's work since the
        last one; what the proposal took is the draft's, the rest is priced as verification of
        ``tokens`` tokens)."""
        rows = []
        for seq, row, d in zip(seqs, host, drafted):
            proposed, emitted = row[-1], row[-2]
            if d == MODEL and proposed == 0:
                # Asked and got nothing (out of time, or its blocks ran out; a remote draft still
                # prefilling the row says so and is no guess at all: Proposal.prefilling):
                # a first guess that failed, so what the model is expected to give counts how
                # often it gives anything. Else a row the draft never serves looks as good as
                # one it does, and a round verifies a width nobody fills.
                rows.append((seq.acceptance, seq.req.params.greedy, MODEL, 1, 0))
                continue
            rows.append((seq.acceptance, seq.req.params.greedy, d if proposed > 0 else -1, proposed, emitted - 1))
        self.controller.observe_rows(rows)
        steps, model_rows, model_seconds, caught_up = model_work
        self.controller.observe_costs(
            len(seqs), width, seconds - model_seconds, steps, model_rows, model_seconds, keys, caught_up, tokens
        )

    def _propose(
        self,
        seqs: list[_Seq],
        ks: list[int],
        routes: list[str],
        planned: dict[int, torch.Tensor],
        sampling: BatchSampling | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[int], tuple[int, int, float, int]]:
        """Guesses [B, K] (-1 = none), model-draft probabilities [B, K, V] (None if no model drafted),
        per row who guessed (MODEL: the draft model; NGRAM: point masses; -1: nobody), and the draft
        model's work (steps, rows, seconds, tokens caught up: Proposal.caught_up).

        ``routes`` says per row who is asked ("draft", "ngram", "hybrid", "none"); ``planned`` holds
        n-gram guesses already looked up (by the controller's planning).
        K is the widest block actually proposed, so rounds without guesses verify a single token.
        """
        B = len(seqs)
        active = [i for i, k in enumerate(ks) if k > 0]
        # n-gram lookup first (plain "ngram" rows, and "hybrid" rows, which fall back to the model).
        ngram_idx = [i for i in active if routes[i] in ("ngram", "hybrid") and i not in planned]
        matched: dict[int, torch.Tensor] = {i: g for i, g in planned.items() if ks[i] > 0}
        if ngram_idx:
            rows = [self._draft_row(seqs[i], ks[i], sampled_draft=False) for i in ngram_idx]
            prop = self.ngram.propose(rows, None)
            for row, i in enumerate(ngram_idx):
                if prop.token_ids.shape[1] and prop.token_ids[row, 0] >= 0:  # host tensor: no sync
                    matched[i] = prop.token_ids[row]
        model_idx = [
            i
            for i in active
            if (routes[i] == "draft" or (routes[i] == "hybrid" and i not in matched)) and self._draft_may_guess(seqs[i])
        ]
        model_prop = None
        model_seconds = 0.0
        if model_idx:
            t0 = time.perf_counter()
            rows = [self._draft_row(seqs[i], ks[i], sampled_draft=True) for i in model_idx]
            model_prop = self.model_drafter.propose(rows, sampling.select(model_idx) if sampling else None)
            model_seconds = time.perf_counter() - t0
        width_model = model_prop.token_ids.shape[1] if model_prop is not None else 0
        K = max([width_model] + [int((g >= 0).sum()) for g in matched.values()])
        guesses = torch.full((B, K), -1, dtype=torch.long)
        for i, g in matched.items():
            guesses[i, : g.shape[0]] = g
        guesses = to_device(guesses, self.device)
        q: torch.Tensor | None = None
        if model_prop is not None:
            idx_t = to_device(model_idx, self.device)
            guesses[idx_t, :width_model] = to_device(model_prop.token_ids, self.device)
            if isinstance(model_prop.probs, SparseProbs):
                # q crossed the network sparse: densified once, straight into the round's q.
                sp = model_prop.probs
                q = torch.zeros((B, K, self.target.info.vocab_size), device=self.device)
                ids = torch.zeros((B, K, sp.ids.shape[-1]), dtype=torch.long, device=self.device)
                probs = torch.zeros(ids.shape, device=self.device)
                ids[idx_t, :width_model] = to_device(sp.ids, self.device)
                probs[idx_t, :width_model] = to_device(sp.probs, self.device)
                q.scatter_add_(-1, ids, probs)
            elif model_prop.probs is not None:
                q = torch.zeros((B, K, model_prop.probs.shape[-1]), device=self.device)
                q[idx_t, :width_model] = model_prop.probs
        # A row whose draft service is still prefilling it was guessed for by nobody (Proposal.prefilling).
        waiting = model_prop.prefilling if model_prop is not None else frozenset()
        model_set = {i for j, i in enumerate(model_idx) if j not in waiting}
        drafted = [MODEL if i in model_set else NGRAM if i in matched else -1 for i in range(B)]
        if model_prop is None or not model_prop.timed:  # (Proposal.timed)
            return guesses, q, drafted, (0, 0, model_seconds, 0)
        steps = max(ks[i] for i in model_idx)
        return guesses, q, drafted, (steps, len(model_idx), model_seconds, model_prop.caught_up)

    def _verified_per_row(self, guesses: torch.Tensor) -> list[int]:
        """Tokens each row of a round verifies, its last token and the guesses before its first -1
        (nothing past that is read: the verifier stops at a guess of -1). Asked only of a forward
        that skips padding (a CPU one: the count is read on the host)."""
        return ((guesses >= 0).cumprod(dim=1).sum(dim=1) + 1).tolist()

    def _draft_may_guess(self, seq: _Seq) -> bool:
        """Whether the draft model is asked for this row's guesses (planned and proposed alike): not
        while it is still prefilling the prompt (or past its context), except for a seeded sampled
        row, which is asked anyway (the draft feeds the rest of the prompt first). Whether the draft
        is ready depends on what else it prefilled, and a seeded row's output must not (with prefix
        caching the target may be ready first)."""
        return seq.req.params.seeded_sampling or self.model_drafter.ready(seq.req.request_id)

    def _draft_row(self, seq: _Seq, k: int, sampled_draft: bool) -> DraftRow:
        greedy = seq.req.params.greedy
        # A model draft of a sampled row draws from a generator of its own, seeded by one draw from
        # the request's draft stream (sampling.py says why a round's draws are kept apart); n-gram
        # lookups and greedy rows use no randomness, so they take no draw.
        seed = draw_seed(seq.draft_generator) if sampled_draft and not greedy else None
        return DraftRow(seq.req.request_id, seq.tokens, k, greedy, seed)

    def _verify(
        self,
        seqs: list[_Seq],
        logits: torch.Tensor,
        guesses: torch.Tensor,
        q: torch.Tensor | None,
        from_model: list[bool],
        sampling: BatchSampling | None,  # None only when every row is greedy
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, K1 = logits.shape[0], logits.shape[1]
        greedy_rows = [i for i, s in enumerate(seqs) if s.req.params.greedy]
        if len(greedy_rows) == B:  # the usual batch: nothing to assemble
            return greedy_verify(logits, guesses)
        token_ids = torch.full((B, K1), -1, dtype=torch.long, device=self.device)
        num_emitted = torch.zeros(B, dtype=torch.long, device=self.device)
        if greedy_rows:
            g = self._rows_index(greedy_rows, B)
            t, n = greedy_verify(logits[g], guesses[g])
            token_ids[g], num_emitted[g] = t, n
        # Sampled rows: model-drafted ones compare against q; n-gram / no-guess rows are point masses.
        sampled = [i for i, s in enumerate(seqs) if not s.req.params.greedy]
        for with_q in (True, False):
            rows = [i for i in sampled if from_model[i] == with_q]
            if not rows:
                continue
            r = self._rows_index(rows, B)
            p = processed_probs(logits[r], sampling.select(rows))  # [b, K+1, V]
            # q is None when no model row got guesses this round (every draft service down, say):
            # those rows verify no guesses, so there is nothing to compare against.
            draft_probs = q[r] if with_q and q is not None else None
            # One seed per row and round from the request's own stream (sampling.py says why).
            t, n = rejection_sample(p, guesses[r], draft_probs, [draw_seed(seqs[i].generator) for i in rows])
            token_ids[r], num_emitted[r] = t, n
        return token_ids, num_emitted

    def _rows_index(self, rows: list[int], batch: int) -> slice | torch.Tensor:
        """An index of ``rows`` (ascending) of a batch of ``batch`` rows: every row as a slice, so
        indexing the round's logits is a view, not a copy (16 demo rows verifying 3 guesses: 2 MB,
        0.23 ms on one CPU thread of the Intel VM, in a ~20 ms round)."""
        return slice(None) if len(rows) == batch else to_device(rows, self.device)

    def _emit(self, seq: _Seq, new: list[int], proposed: int, drafter: int, k: int) -> StepOutput:
        accepted = len(new) - 1
        seq.stats.record_round(proposed, accepted, len(new), k)
        self.totals.record_round(proposed, accepted, len(new), k)
        if drafter == MODEL:
            self.model_drafter.accepted(seq.req.request_id, accepted)
        params = seq.req.params
        reason = None
        if not params.ignore_eos:
            for i, t in enumerate(new):
                if t in self.eos:
                    new, reason = new[: i + 1], "stop"
                    break
        budget = min(params.max_tokens - seq.generated, self.max_len - len(seq.tokens))
        if len(new) >= budget:
            if len(new) > budget or reason is None:
                new, reason = new[:budget], "length"
        text, keep = seq.detok.push(new)
        if seq.detok.stopped:
            new, reason = new[:keep], "stop"
        seq.tokens.extend(new)
        seq.cached = len(seq.tokens) - 1
        if reason is not None:
            text += seq.detok.flush()
            self._release(seq)
        return StepOutput(
            seq.req.request_id,
            new,
            min(accepted, len(new)),
            text,
            reason is not None,
            reason,
            seq.stats,
            proposed=proposed,
            accepted=accepted,
            k=k,
            drafter=DRAFTER_LABELS[drafter] if proposed > 0 else "none",
            cached_prompt_tokens=seq.cached_prompt,
        )

    def _release(self, seq: _Seq) -> None:
        self.running.pop(seq.req.request_id, None)
        if seq.has_blocks:
            self.cache.register(seq.slot, seq.tokens, seq.cached)  # the generated text too: a next turn
        self.cache.release(seq.slot)
        self.ngram.remove(seq.req.request_id)
        if self._may_use_model(seq.req):
            self.model_drafter.remove(seq.req.request_id)

    # ------------------------------------------------------------------------ helpers

    def generate(self, requests: list[Request]) -> dict[str, GenerationResult]:
        """Run requests to completion (all queued at once); returns results by request id."""
        results = {r.request_id: GenerationResult(r.request_id) for r in requests}
        for r in requests:
            self.add_request(r)
        for out in self.stream():
            res = results[out.request_id]
            res.token_ids.extend(out.token_ids)
            res.text += out.text
            if out.finished:
                res.finish_reason = out.finish_reason
                res.stats = out.stats
                res.cached_prompt_tokens = out.cached_prompt_tokens
        return results

    def stream(self) -> Iterator[StepOutput]:
        """Step until no work is left, yielding each output as soon as it is verified."""
        while self.has_work():
            yield from self.step()

    @property
    def active_slots(self) -> int:
        return self.cache.used_slots


@dataclass
class GenerationResult:
    """A finished request, assembled from its step outputs."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stats: SpecStats | None = None
    cached_prompt_tokens: int = 0  # prompt positions the prefix cache held
