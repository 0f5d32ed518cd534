"""The values every process agrees on, defined once: speculation methods, block sizes, dtypes, the
demo pair. The gateway, the CLI, the engine and the services import them from here.

Standard library only: the CLI reads this before torch is imported, and the gateway never imports
torch at all.
"""

from __future__ import annotations

from pathlib import Path

# How a request speculates. "auto": the controller picks k and the drafter per sequence and round;
# "draft": the draft model; "ngram": prompt lookup inside the target; "hybrid": n-gram lookup
# first, the draft model in rounds where it finds nothing; "none": no guesses.
SPECULATION_METHODS = ("auto", "draft", "ngram", "hybrid", "none")
DEFAULT_SPECULATION_METHOD = "auto"
METHODS_USING_DRAFT_MODEL = ("draft", "hybrid")  # "auto" uses it too, when one is loaded

# Guesses per round (k). The largest block a request may ask for sizes every KV cache's headroom.
MAX_SPECULATIVE_TOKENS = 16
AUTO_NUM_TOKENS = 6  # the largest k "auto" may choose unless the request says otherwise
FIXED_NUM_TOKENS = 3  # k of the fixed methods by default (the best measured k for the demo pair, README)
# A round normally brings a draft model one or two committed tokens it has not fed (the bonus or the
# replaced guess; after a fully accepted block, the last guess too). More than this many, after rounds
# it was not asked in, and it catches up first: work a round pays for, which auto prices per token.
CATCH_UP_TOKENS = 2

# Seconds a draft service's prefill pass may take at its measured speed (DraftWorker.prefill_slice):
# a round that arrives meanwhile waits for the pass, and a target waits 2 s (--draft-timeout) for its
# blocks. Passes sized by tokens alone (512) took the real pair's draft 2.9 s: the target gave the
# draft up, dropped the stream and every sequence the draft had just prefilled on it.
DRAFT_PREFILL_SLICE_SECONDS = 0.1


def default_num_tokens(method: str) -> int:
    """The k a request of ``method`` gets when it names none ("auto": the largest it may choose)."""
    return AUTO_NUM_TOKENS if method == "auto" else FIXED_NUM_TOKENS


# SPECD_HUGE_PAGES=0 keeps every page at 4 KB (services/engine/kernels/huge_pages.h reads it when the
# first weights are placed; `specd generate` sets it unless given --huge-pages).
HUGE_PAGES_SWITCH = "SPECD_HUGE_PAGES"

# Model weights' dtypes, by the names the command line and the configs use.
DTYPE_NAMES = ("bfloat16", "float16", "float32")
DEFAULT_DTYPE = "bfloat16"

# Drafting ahead (--draft-ahead on|off on target and serve): the draft prepares each sequence's next
# block while the target verifies (services/draft/ahead.py). On by default since blocks are offered
# ahead of the round and a target never asks it of a draft that competes with it for cores or an
# accelerator (affinity.competes): unpinned on one machine it stays in turn; with cores of its own
# it won at one stream and tied at 16 (docs/benchmarks.md, "Drafting ahead").
DRAFT_AHEAD_DEFAULT = True

# How a draft made a block of guesses: drafted when the round came, drafted ahead and complete,
# drafted ahead in part and finished when the round came, or drafted ahead and sent before the
# round, so the target did not wait for it (services/draft/ahead.py). Metric labels.
BLOCK_SOURCES = ("fresh", "prepared", "continued", "offered")

# The bundled demo pair. The installed package mirrors the checkout (specd/services beside
# specd/models, as services/ beside models/; setup.py), so one relative path finds it in both.
DEMO_MODELS = Path(__file__).resolve().parents[2] / "models"
DEMO_TARGET = DEMO_MODELS / "demo-target"
DEMO_DRAFT = DEMO_MODELS / "demo-draft"
