"""Tiny model pairs for tests, built in about a second, saved in standard Hugging Face format.

- :func:`build_tiny_pair`: a 512-token BPE tokenizer trained on a few stdlib modules, a random
  Llama target (GQA) and a draft that is the target with noise on its weights (so guesses are
  accepted often but not always, giving varied accept counts).
- :func:`random_hf_model`: an in-memory random ``transformers`` model of a given family, with
  non-zero biases, for comparing forwards.
- :func:`build_micro_pair`: a 12-token vocabulary for statistical tests, where the joint law of
  the first few tokens can be enumerated exactly; its draft is an unrelated random model, so many
  guesses are rejected and a wrong sampler shows.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _fast_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_bpe_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((root / name).read_text(encoding="utf-8") for name in ("textwrap.py", "bisect.py", "colorsys.py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([text], trainer=trainer)
    return _fast_tokenizer(tok)


def micro_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = SPECIALS + [chr(ord("a") + i) for i in range(9)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    return _fast_tokenizer(tok)


def _llama(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, seed: int, logit_scale: float):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=[2, 0],
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)  # sharper distributions: fewer near-ties, clearer argmax
    return model


def _save(model, tokenizer, path: Path) -> Path:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(eos_token_id=[2, 0], pad_token_id=0, bos_token_id=None)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_pair(root: Path, noise: float = 0.05) -> tuple[Path, Path]:
    """Write tiny-target/ and tiny-draft/ under root; returns their paths."""
    tok = tiny_bpe_tokenizer()
    target = _llama(len(tok), 64, 2, 4, 2, seed=0, logit_scale=8.0)
    draft = _llama(len(tok), 64, 2, 4, 2, seed=0, logit_scale=8.0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g))  # noise relative to each weight's scale
    return _save(target, tok, root / "tiny-target"), _save(draft, tok, root / "tiny-draft")


def build_micro_pair(root: Path, draft_noise: float | None = None) -> tuple[Path, Path]:
    """Write micro-target/ and micro-draft/ (12-token vocabulary) under root.

    ``draft_noise``: the draft is the target with this much noise on its weights (relative to each
    weight's scale), so it guesses the target's likely tokens; None: an unrelated random model."""
    tok = micro_tokenizer()
    target = _llama(len(tok), 32, 2, 4, 4, seed=3, logit_scale=4.0)
    if draft_noise is None:
        draft = _llama(len(tok), 32, 1, 4, 4, seed=4, logit_scale=4.0)
    else:
        draft = _llama(len(tok), 32, 2, 4, 4, seed=3, logit_scale=4.0)
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            for p in draft.parameters():
                p.add_(draft_noise * p.std() * torch.randn(p.shape, generator=g))
    return _save(target, tok, root / "micro-target"), _save(draft, tok, root / "micro-draft")


def random_hf_model(model_type: str = "llama", **overrides):
    """A small random ``transformers`` causal LM (4 heads, 2 kv heads, MLP 96), seeded; config
    ``overrides`` on top. Biases are drawn non-zero, so a missing, or a repeated, bias shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    kw.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model
