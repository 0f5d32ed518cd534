"""The tokenizer the engine uses: Hugging Face's ``tokenizers`` library directly, ``transformers`` only
when something beyond encoding and decoding is asked for.

Importing ``transformers`` to build a tokenizer costs over a second of a cold start (its lazy module
scans every model package first), more than loading a 1.5B model's weights from a memory map. What
the engine does per request, encode text and decode ids, is the ``tokenizers`` library's own work,
which ``transformers``' fast tokenizers call with the same arguments. Everything else (the chat
template, special-token attributes) is delegated to the ``transformers`` tokenizer of the same folder,
built on first use: a chat template is rendered by exactly the code that would render it otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# tokenizer_config.json classes whose fast tokenizer is tokenizer.json as it is, with no cleanup of
# decoded text; tests/engine/test_tokenizer.py checks each against transformers' on real text.
PLAIN_CLASSES = ("Qwen2Tokenizer", "Qwen2TokenizerFast", "PreTrainedTokenizerFast", "TokenizersBackend")


class FastTokenizer:
    """Encode and decode with ``tokenizers``; any other attribute from the ``transformers`` tokenizer."""

    def __init__(self, folder: Path, for_chat: bool = False) -> None:
        from tokenizers import Tokenizer

        self.folder = folder
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._hf = None
        if for_chat:  # a server renders chat templates: load transformers now, not at the first request
            _ = self.hf

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> dict[str, list[int]]:
        if kwargs:  # anything beyond plain encoding (padding, tensors, ...): transformers' own
            return self.hf(text, add_special_tokens=add_special_tokens, **kwargs)
        return {"input_ids": self._tok.encode(text, add_special_tokens=add_special_tokens).ids}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def hf(self):
        """The ``transformers`` tokenizer of the same folder, loaded on first use."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(self.folder)
        return self._hf

    def __getattr__(self, name: str) -> Any:  # apply_chat_template, eos_token, save_pretrained, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)


def _plain(folder: Path) -> bool:
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        (folder / "tokenizer.json").is_file()
        and cfg.get("tokenizer_class") in PLAIN_CLASSES
        and not cfg.get("clean_up_tokenization_spaces", False)
    )


def load_tokenizer(folder_or_id: str, for_chat: bool = False):
    """A :class:`FastTokenizer` for a local folder whose tokenizer is plain ``tokenizer.json`` (see
    :data:`PLAIN_CLASSES`), else ``transformers``' ``AutoTokenizer``. ``for_chat``: it will render
    chat templates, so the ``transformers`` part is loaded now rather than on first use."""
    folder = Path(folder_or_id)
    if folder.is_dir() and _plain(folder):
        return FastTokenizer(folder, for_chat)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder_or_id)
