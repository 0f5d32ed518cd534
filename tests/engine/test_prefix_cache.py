"""Prefix caching: the block pool's accounting (pure), and the engine's output with it on and off."""

from __future__ import annotations

import pytest

from specd.services.engine.builder import ModelSpec, build_engine
from specd.services.engine.drafters import DraftRow
from specd.services.engine.engine import Engine, EngineConfig, Request, SpecConfig
from specd.services.engine.kv_cache import BlockTable
from specd.services.engine.sampling import SamplingParams

BS = 4  # positions per block in the pool tests


class _Pool(BlockTable):
    """The accounting of a pool whose storage could be shared (as PagedKVCache's is)."""

    @property
    def can_fork(self) -> bool:
        return True

    def _copy_block(self, src_block: int, dst_block: int) -> None:
        pass


def _pool(blocks: int = 8, slots: int = 4) -> _Pool:
    pool = _Pool(slots, blocks, BS, max_len=64)
    pool.enable_prefix_caching()
    return pool


def _run(pool: _Pool, tokens: list[int]) -> tuple[int, list[int], int]:
    """A sequence over ``tokens`` as the engine runs one: attach, reserve, K/V final up to the last."""
    slot = pool.allocate()
    hit = pool.attach_prefix(slot, tokens, len(tokens) - 1)
    assert pool.reserve(slot, len(tokens))
    pool.register(slot, tokens, len(tokens) - 1)
    return slot, list(pool.blocks[slot]), hit


def test_a_prompt_seen_before_takes_its_full_blocks_and_only_those() -> None:
    pool = _pool()
    first = list(range(100, 111))  # 11 tokens: blocks 0-1 full and final, block 2 partly used
    slot, blocks, hit = _run(pool, first)
    assert hit == 0
    pool.release(slot)
    assert pool.free_blocks == 8  # cached blocks count as free
    slot, again, hit = _run(pool, first)
    assert hit == 2 * BS and again[:2] == blocks[:2]
    pool.release(slot)
    # The same first block, another second one: only the first is shared.
    other = first[:BS] + [7] * BS + [8, 9]
    slot, blocks2, hit = _run(pool, other)
    assert hit == BS and blocks2[0] == blocks[0] and blocks2[1] != blocks[1]
    pool.release(slot)
    # A hit never reaches the limit's block: the last prompt token is computed, not reused.
    slot = pool.allocate()
    assert pool.attach_prefix(slot, first[: 2 * BS], 2 * BS - 1) == BS
    pool.release(slot)
    assert pool.free_blocks == 8


def test_a_block_is_shared_while_held_and_returns_with_its_last_holder() -> None:
    pool = _pool()
    tokens = list(range(9))
    a, blocks_a, _ = _run(pool, tokens)
    b, blocks_b, hit = _run(pool, tokens)
    assert hit == 2 * BS and blocks_b[:2] == blocks_a[:2] and blocks_b[2] != blocks_a[2]
    assert pool.free_blocks == 8 - 4  # two shared blocks, one own block each
    pool.release(a)
    assert pool.free_blocks == 8 - 3  # b still holds the shared ones
    pool.release(b)
    assert pool.free_blocks == 8


def test_idle_cached_blocks_are_taken_last_and_least_recently_used_first() -> None:
    pool = _pool(blocks=6)
    old, _, _ = _run(pool, [1] * 9)  # registers 2 blocks
    pool.release(old)
    new, _, _ = _run(pool, [2] * 9)
    pool.release(new)
    assert pool.free_blocks == 6
    # 6 blocks for a fresh text: the 2 never-cached ones, then the 4 idle cached, oldest first.
    slot = pool.allocate()
    assert pool.reserve(slot, 6 * BS)
    pool.release(slot)
    assert pool.attach_prefix(pool.allocate(), [1] * 9, 8) == 0  # evicted: never a stale hit
    # The pool evicts the oldest idle blocks first: a text fills 4 blocks, the older prefix goes.
    pool = _pool(blocks=6)
    for text in ([1] * 9, [2] * 9):
        s, _, _ = _run(pool, text)
        pool.release(s)
    s = pool.allocate()
    assert pool.reserve(s, 4 * BS)  # 2 never cached + the 2 blocks of [1] * 9
    pool.release(s)
    assert pool.attach_prefix(pool.allocate(), [2] * 9, 8) == 2 * BS
    assert pool.attach_prefix(pool.allocate(), [1] * 9, 8) == 0


def test_two_equal_prompts_side_by_side_register_one_copy() -> None:
    pool = _pool()
    a = pool.allocate()
    b = pool.allocate()
    tokens = list(range(9))
    for s in (a, b):  # both admitted before either was prefilled: no hit
        assert pool.attach_prefix(s, tokens, 8) == 0
        assert pool.reserve(s, 9)
    pool.register(a, tokens, 8)
    pool.register(b, tokens, 8)
    pool.release(a)
    pool.release(b)
    c = pool.allocate()
    assert pool.attach_prefix(c, tokens, 8) == 2 * BS
    pool.release(c)
    assert pool.free_blocks == 8


def test_a_salt_partitions_the_cache() -> None:
    """A sequence finds only blocks registered under its own salt (no salt is a salt of its own),
    and registers its blocks under it; a slot taken again starts unsalted."""
    pool = _pool()
    tokens = list(range(100, 111))

    def run(salt: str) -> int:
        slot = pool.allocate()
        hit = pool.attach_prefix(slot, tokens, len(tokens) - 1, salt)
        assert pool.reserve(slot, len(tokens))
        pool.register(slot, tokens, len(tokens) - 1)
        pool.release(slot)
        return hit

    assert run("tenant-a") == 0
    assert run("tenant-b") == 0 and run("") == 0  # each its own copy now
    assert run("tenant-a") == run("tenant-b") == run("") == 2 * BS
    assert pool.free_blocks == 8


@pytest.mark.parametrize("length", [3, 6])
def test_a_fork_registers_under_its_sources_salt(length: int) -> None:
    """A fork (a prepared branch the draft service adopts) is the same sequence: what it registers
    is found under the source's salt and nowhere else (forked inside the first block, or past it)."""
    pool = _pool()
    tokens = list(range(200, 211))
    src = pool.allocate()
    assert pool.attach_prefix(src, tokens, len(tokens) - 1, "tenant-a") == 0
    assert pool.reserve(src, length)
    dst = pool.allocate()
    assert pool.fork(src, dst, length)
    pool.release(src)
    assert pool.reserve(dst, len(tokens))
    pool.register(dst, tokens, len(tokens) - 1)
    pool.release(dst)

    def hit(salt: str) -> int:
        slot = pool.allocate()
        found = pool.attach_prefix(slot, tokens, len(tokens) - 1, salt)
        pool.release(slot)
        return found

    assert hit("") == 0 and hit("tenant-b") == 0
    assert hit("tenant-a") == 2 * BS
    assert pool.free_blocks == 8


def test_prefix_caching_is_off_unless_enabled_and_refused_where_blocks_cannot_be_shared() -> None:
    plain = _Pool(2, 8, BS, 64)
    slot, _, hit = _run(plain, list(range(9)))
    plain.release(slot)
    assert hit == 0 and plain.attach_prefix(plain.allocate(), list(range(9)), 8) == 0
    with pytest.raises(ValueError):
        BlockTable(2, 8, BS, 64).enable_prefix_caching()  # no storage of its own to share
    mirrored = _Pool(2, 8, BS, 64)
    mirrored.mirrored = True  # tensor-parallel ranks zero every block new to a row
    assert not mirrored.supports_prefix_caching


# ----------------------------------------------------------------------------------- the engine

SYSTEM = "import os\nimport sys\nfrom collections import deque\n\n\ndef _helper(x):\n    return x + 1\n\n"
TAILS = ["def wrap(text, width=70):\n", "class TextWrapper:\n", "def insort(a, x):\n    lo = 0\n", "x"]


def _engine(tiny_pair, prefix_caching: bool, device: str = "cpu", **cfg) -> Engine:
    target, draft = tiny_pair
    spec = ModelSpec(str(target), str(draft), "float32", "float32", device=device)
    defaults = {"max_batch_size": 4, "max_model_len": 256, "kv_block_size": 8, "prefix_caching": prefix_caching}
    return build_engine(spec, EngineConfig(**(defaults | cfg)))


def _ids(engine: Engine, text: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def _requests(engine: Engine, tag: str, n: int = 24) -> list[Request]:
    """Prompts sharing a long prefix, draft, n-gram, none and auto, greedy and seeded sampling."""
    methods = [("draft", 3), ("ngram", 4), ("none", 0), ("auto", 4)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=n, seed=11, ignore_eos=True),
    ]
    return [
        Request(f"{tag}{i}", _ids(engine, SYSTEM + tail), params[i % 2], SpecConfig(*methods[i]))
        for i, tail in enumerate(TAILS)
    ]


def _outputs(engine: Engine, reqs: list[Request], one_by_one: bool) -> dict[str, list[int]]:
    if one_by_one:
        return {r.request_id[1:]: engine.generate([r])[r.request_id].token_ids for r in reqs}
    return {k[1:]: v.token_ids for k, v in engine.generate(reqs).items()}


def test_engine_output_is_the_same_with_prefix_caching_and_the_pool_comes_back(tiny_pair) -> None:
    check_output_with_prefix_caching(tiny_pair, "cpu")


def check_output_with_prefix_caching(tiny_pair, device: str) -> None:
    """Greedy and seeded rows over a shared system prompt, each method, alone and batched, and a
    second turn that repeats a first turn's answer: token for token what an engine without the
    cache produces, with hits counted, and every block free (cached or never used) at the end
    (tests/test_cuda.py runs it on a GPU)."""
    cold, warm = _engine(tiny_pair, False, device), _engine(tiny_pair, True, device)
    assert not cold.cache.prefix_caching and warm.cache.prefix_caching
    want = _outputs(cold, _requests(cold, "a"), one_by_one=True)
    first = _outputs(warm, _requests(warm, "a"), one_by_one=True)  # the later ones hit the system prompt
    assert first == want
    prompts = [r.prompt_ids for r in _requests(warm, "a")]
    shared = next(i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1)
    assert shared >= 16 and warm.cached_prompt_tokens >= 3 * 8 * (shared // 8)
    again = warm.generate(_requests(warm, "b"))  # all four at once, each a hit
    assert {k[1:]: v.token_ids for k, v in again.items()} == want
    assert all(r.cached_prompt_tokens > 0 for r in again.values())
    # A second turn: the first turn's prompt and answer, then more. Its answer is cached too.
    turn1 = _requests(warm, "t")[0]
    answer = warm.generate([turn1])["t0"].token_ids
    turn2 = Request("t2", turn1.prompt_ids + tuple(answer) + _ids(warm, "\n\ndef more():\n"), turn1.params)
    got = warm.generate([turn2])["t2"]
    assert got.cached_prompt_tokens >= 8 * ((len(turn1.prompt_ids) + len(answer) - 1) // 8)
    assert got.token_ids == cold.generate([turn2])["t2"].token_ids
    for e in (cold, warm):
        assert e.active_slots == 0 and e.cache.free_blocks == e.cache.num_blocks


def test_requests_share_cached_prefixes_only_under_the_same_salt(tiny_pair) -> None:
    """Request.cache_salt (the API's cache_salt): a request is served from the cache only what
    requests with its salt left there, in the target and the in-process draft alike; the output
    is the same either way."""
    engine = _engine(tiny_pair, True)
    base = _requests(engine, "s")[0]

    def run(tag: str, salt: str):
        req = Request(tag, base.prompt_ids, base.params, base.spec, cache_salt=salt)
        return engine.generate([req])[tag]

    first = run("a1", "alice")
    others = [run("b1", "bob"), run("n1", "")]
    assert first.cached_prompt_tokens == 0 and all(r.cached_prompt_tokens == 0 for r in others)
    again = [run("a2", "alice"), run("b2", "bob"), run("n2", "")]
    assert all(r.cached_prompt_tokens >= 8 * ((len(base.prompt_ids) - 1) // 8) for r in again)
    assert all(r.token_ids == first.token_ids for r in others + again)
    draft = engine.model_drafter
    draft.add("d", list(base.prompt_ids), cache_salt="carol")
    assert draft.seqs["d"].cache_len == 0  # the draft's cache is partitioned the same way
    draft.remove("d")
    draft.add("d", list(base.prompt_ids), cache_salt="alice")
    assert draft.seqs["d"].cache_len > 0
    draft.remove("d")
    assert engine.active_slots == 0 and engine.cache.free_blocks == engine.cache.num_blocks


def test_a_prompt_whose_prefix_running_sequences_hold_needs_only_its_own_blocks(tiny_pair) -> None:
    """Admission counts the blocks a newcomer would share with running sequences as already there:
    with 9 blocks of 8, a running request over a 32-token system prompt (5 blocks) leaves 4 free,
    too few for another 5-block prompt plus headroom, but its own block and headroom fit. Both run
    at once, and each gives what it gives alone."""
    cold = _engine(tiny_pair, False)
    pool = _engine(tiny_pair, True, kv_cache_memory=cold.target.kv_bytes_per_token * 8 * 9)
    assert pool.cache.num_blocks == 9
    head = _ids(cold, SYSTEM)[:32]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    a, b = (Request(n, head + _ids(cold, t)[:6], params, SpecConfig("none", 0)) for n, t in zip("ab", TAILS))
    assert pool.cache.blocks_to_admit(b.prompt_ids, len(b.prompt_ids) - 1) == 5  # nothing cached yet
    got: dict[str, list[int]] = {"a": [], "b": []}
    pool.add_request(a)
    for o in pool.step():  # a's prompt prefilled, its four full blocks registered
        got[o.request_id] += o.token_ids
    assert pool.cache.blocks_to_admit(b.prompt_ids, len(b.prompt_ids) - 1) == 1
    assert pool.cache.blocks_to_admit(b.prompt_ids, len(b.prompt_ids) - 1, "other salt") == 5
    pool.add_request(b)
    both_ran = False
    while pool.has_work():
        for o in pool.step():
            got[o.request_id] += o.token_ids
        both_ran = both_ran or len(pool.running) == 2
    assert both_ran and pool.cached_prompt_tokens == 32
    assert got == {r.request_id: cold.generate([r])[r.request_id].token_ids for r in (a, b)}
    assert pool.active_slots == 0 and pool.cache.free_blocks == pool.cache.num_blocks


def test_preemption_with_prefix_caching_keeps_the_output(tiny_pair) -> None:
    """A pool of 12 blocks of 8 for three growing sequences over a shared prefix: the youngest are
    preempted, their blocks registered as they leave, so they come back partly through the cache;
    the output is each request's alone without the cache, and every block is free at the end."""
    cold = _engine(tiny_pair, False)
    tight = _engine(tiny_pair, True, kv_cache_memory=cold.target.kv_bytes_per_token * 8 * 12, prefill_chunk=16)
    head = _ids(cold, SYSTEM)[:16]
    reqs = [
        Request(f"p{i}", head + _ids(cold, tail)[:6], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                SpecConfig(*method))
        for i, (tail, method) in enumerate(zip(TAILS, [("draft", 3), ("ngram", 4), ("none", 0), ("auto", 4)]))
    ]  # fmt: skip
    got = _outputs(tight, reqs, one_by_one=False)
    assert tight.preemptions > 0 and tight.cached_prompt_tokens > 0
    assert got == _outputs(cold, reqs, one_by_one=True)
    assert tight.active_slots == 0 and tight.cache.free_blocks == tight.cache.num_blocks


def _draft_models(tiny_pair):
    """Two in-process draft models over the tiny pair's draft, 8-position blocks: without prefix
    caching and with it."""
    import torch

    from specd.services.engine.drafters import ModelDrafter
    from specd.services.engine.model import load_model

    model = load_model(str(tiny_pair[1]), torch.float32, "cpu")
    return tuple(ModelDrafter(model, 4, 256, block_size=8, prefix_caching=on) for on in (False, True))


def test_the_draft_model_reuses_its_prompts_blocks_and_proposes_the_same(tiny_pair) -> None:
    """The draft's own pool (in-process, and in the draft service, which runs the same ModelDrafter):
    a prompt it prefilled before is taken from its cache, and its guesses are unchanged."""
    cold, warm = _draft_models(tiny_pair)
    prompt = list(range(3, 60))
    guesses: dict[bool, list[list[int]]] = {False: [], True: []}
    for drafter, on in ((cold, False), (warm, True)):
        for i in range(2):
            drafter.add(f"s{i}", prompt)
            assert drafter.seqs[f"s{i}"].cache_len == (0 if i == 0 or not on else 8 * ((len(prompt) - 1) // 8))
            while drafter.prefill(16):
                pass
            prop = drafter.propose([DraftRow(f"s{i}", prompt, 4, True)], None)
            guesses[on].append(prop.token_ids[0].tolist())
            drafter.remove(f"s{i}")
        assert drafter.cache.free_blocks == drafter.cache.num_blocks
    assert guesses[True] == guesses[False] and guesses[True][0] == guesses[True][1]


def test_the_draft_model_reuses_what_it_generated_in_a_next_turn(tiny_pair) -> None:
    """A finished sequence leaves its committed blocks cached in the draft, the answer included
    (accepted guesses and the target's tokens alike): a next turn, whose prompt repeats it, is
    prefilled only past them, and its guesses are those of a draft that computed everything."""
    cold, warm = _draft_models(tiny_pair)
    prompt = list(range(3, 20))
    tokens = list(prompt)  # the committed context, grown in place as an engine's is
    warm.add("turn1", tokens)
    while warm.prefill(16):
        pass
    for round_ in range(8):  # the first two guesses pass, then the target says 7 + round_
        guesses = warm.propose([DraftRow("turn1", tokens, 4, True)], None).token_ids[0].tolist()
        tokens.extend([*guesses[:2], 7 + round_])
        warm.accepted("turn1", 2)
    warm.remove("turn1")
    assert len(tokens) == len(prompt) + 24

    nxt = [*tokens, 30, 31, 32]
    got = {}
    for drafter in (cold, warm):
        drafter.add("turn2", nxt)
        got[drafter is warm, "cached"] = drafter.seqs["turn2"].cache_len
        while drafter.prefill(16):
            pass
        got[drafter is warm] = drafter.propose([DraftRow("turn2", nxt, 4, True)], None).token_ids[0].tolist()
        drafter.remove("turn2")
    # Every full block of what the draft's cache holds of the first turn: all of it but the last
    # token (the target's, never fed to the draft).
    assert got[True, "cached"] == 8 * ((len(tokens) - 1) // 8) > 8 * (len(prompt) // 8)
    assert got[False, "cached"] == 0
    assert got[True] == got[False]


def test_a_waiting_prompt_is_hashed_once_however_long_it_waits(tiny_pair) -> None:
    """A request that waits for blocks is looked up by the digest chain made when it first reached
    the head of the queue: not hashed again at every step it waits (work that grows with the
    prompt, every round), nor again at admission. It still attaches what the running request
    registered under its prefix, and gives what it gives alone."""
    cold = _engine(tiny_pair, False)
    pool = _engine(tiny_pair, True, kv_cache_memory=cold.target.kv_bytes_per_token * 8 * 9)
    head = _ids(cold, SYSTEM)[:32]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # a: 5 blocks, 7 by its end; b shares a's first 2 blocks and needs 3 of its own plus headroom,
    # so once a holds 6 it waits for a to finish.
    a = Request("a", head + _ids(cold, TAILS[0])[:6], params, SpecConfig("none", 0))
    b = Request("b", head[:16] + _ids(cold, TAILS[1] * 4)[:22], params, SpecConfig("none", 0))
    hashed: list[tuple[int, ...]] = []
    chain_of = pool.cache.prefix_chain

    def counted(tokens, limit, salt=""):
        hashed.append(tuple(tokens))
        return chain_of(tokens, limit, salt)

    pool.cache.prefix_chain = counted
    got: dict[str, list[int]] = {"a": [], "b": []}
    pool.add_request(a)
    for _ in range(5):
        for o in pool.step():
            got[o.request_id] += o.token_ids
    pool.add_request(b)
    waited = 0
    while pool.has_work():
        for o in pool.step():
            got[o.request_id] += o.token_ids
        waited += "b" not in pool.running and any(r.request_id == "b" for r in pool.waiting)
    assert waited >= 3  # b waited for a's blocks over several steps
    assert hashed.count(b.prompt_ids) == 1 and hashed.count(a.prompt_ids) == 1
    assert pool.cached_prompt_tokens == 16  # b attached a's registered blocks through its one chain
    assert got == {r.request_id: cold.generate([r])[r.request_id].token_ids for r in (a, b)}
    assert pool.active_slots == 0 and pool.cache.free_blocks == pool.cache.num_blocks
