"""The draft service's edge: DraftRound in, DraftBlocks out; no other module sees a draft message."""

from __future__ import annotations

from specd.services.common.convert import sampling_from_pb
from specd.services.draft.ahead import Offer
from specd.services.draft.worker import BlockError, BlockOut, OpenSeq, ProposeReq
from specd.v1 import draft_pb2

_ERRORS = {e: draft_pb2.DraftError.Value(f"DRAFT_ERROR_{e.name}") for e in BlockError if e is not BlockError.NONE}
_ERRORS[BlockError.NONE] = draft_pb2.DRAFT_ERROR_UNSPECIFIED
_SOURCES = {
    "fresh": draft_pb2.BLOCK_SOURCE_FRESH,
    "prepared": draft_pb2.BLOCK_SOURCE_PREPARED,
    "continued": draft_pb2.BLOCK_SOURCE_CONTINUED,
    "offered": draft_pb2.BLOCK_SOURCE_OFFERED,
}


def opens_from_pb(rnd: draft_pb2.DraftRound) -> list[OpenSeq]:
    return [OpenSeq(o.sequence_id, list(o.token_ids), sampling_from_pb(o.sampling), o.cache_salt) for o in rnd.open]


def rows_from_pb(rnd: draft_pb2.DraftRound) -> list[ProposeReq]:
    return [
        ProposeReq(
            r.sequence_id,
            r.num_accepted,
            list(r.new_token_ids),
            r.committed_length,
            r.num_tokens,
            r.round_seed,
            r.next_round_seed,
            r.offer_taken,
        )
        for r in rnd.rows
    ]


def block_to_pb(b: BlockOut) -> draft_pb2.Block:
    msg = draft_pb2.Block(sequence_id=b.seq_id, token_ids=b.token_ids, error=_ERRORS[b.error], prefilling=b.prefilling)
    if b.token_ids:
        msg.source = _SOURCES[b.source]
    for ids, probs in zip(b.sparse_ids, b.sparse_probs):
        msg.probs.add(token_ids=ids.tolist(), probs=probs.tolist())
    return msg


def blocks_to_pb(round_id: int, blocks: list[BlockOut], prefilled_tokens: int = 0) -> draft_pb2.DraftBlocks:
    return draft_pb2.DraftBlocks(
        round_id=round_id, blocks=[block_to_pb(b) for b in blocks], prefilled_tokens=prefilled_tokens
    )


def offers_to_pb(offers: list[Offer]) -> draft_pb2.DraftBlocks:
    """Blocks drafted ahead, sent between rounds (round_id 0)."""
    msg = draft_pb2.DraftBlocks(round_id=0)
    for o in offers:
        seq_id = o.key.split("/", 1)[1]
        b = BlockOut(seq_id, list(o.tokens), list(o.sparse_ids), list(o.sparse_probs), source="prepared")
        msg.offered.add(block=block_to_pb(b), base_length=o.base, assumed_token_ids=o.assumed, round_seed=o.seed)
    return msg
