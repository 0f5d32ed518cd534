"""Build specd's demo model pair from text every machine of this kind has.

Stages (each resumable, outputs under ``models/.work/`` which git ignores):

    python models/build.py corpus      # stdlib source + chat examples from docstrings
    python models/build.py tokenizer   # byte-level BPE, 8k vocabulary, ChatML template
    python models/build.py train --role target --steps 600
    python models/build.py export-target   # fp32 copy of the target: the distillation teacher
    python models/build.py train --role draft --steps 1250 --teacher models/.work/target-export
    python models/build.py export      # bf16 HF checkpoints into models/demo-target, models/demo-draft
    python models/build.py all         # everything above, in order

Training saves a checkpoint every ``--save-every`` steps and on Ctrl-C or ``--minutes`` running out;
running the same command again resumes from it (model, optimiser, step). The draft is distilled from
the target: for its first 72% of steps it learns the data with plain cross-entropy (cheap),
then its loss mixes cross-entropy with KL(target || draft) on the target's logits, computed online
(one target forward per draft step, no gradients).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import signal
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
WORK = HERE / ".work"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTIONS = [
    "Explain `{name}`.",
    "What does `{name}` do?",
    "Describe the function `{name}` from the `{module}` module.",
    "How do I use `{name}`?",
]


@dataclass(frozen=True)
class ModelShape:
    """Llama hyper-parameters of one member of the pair."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


SHAPES = {
    # ~33M parameters with the 8k vocabulary and an untied lm_head.
    "target": ModelShape(512, 8, 8, 8, 1376),
    # ~2.5M parameters, most of them the embedding and lm_head. Two layers: per-layer overhead
    # dominates a tiny model's step on CPU. Measured here, one draft step costs 0.6 ms at d=128,
    # 1.2 ms at d=192 and 2.2 ms at d=256 (fp32 matmuls for those shapes are much slower).
    "draft": ModelShape(128, 2, 4, 4, 384),
}
VOCAB_SIZE = 8192
MAX_POSITIONS = 1024


# ----------------------------------------------------------------------------- corpus


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
    files = [p for p in sorted(root.rglob("*.py")) if not (set(p.relative_to(root).parts[:-1]) & skip)]
    return files


def _chat_examples(path: Path, source: str, module: str, rng: random.Random) -> list[str]:
    """Turn each documented public function/class into an 'explain X' chat exchange."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.name.startswith("_") or len(doc) < 40:
            continue
        name = f"{module}.{node.name}"
        question = rng.choice(QUESTIONS).format(name=name, module=module)
        out.append(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{doc.strip()}<|im_end|>\n")
    return out


def build_corpus(out: Path) -> None:
    """Write the training text: stdlib files and chat examples, separated by <|endoftext|>."""
    rng = random.Random(0)
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    chats: list[str] = []
    for path in tqdm(_stdlib_files(), desc="corpus", unit="file"):
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = path.relative_to(root)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        docs.append(f"# {rel}\n{source}")
        chats.extend(_chat_examples(path, source, module, rng))
    # Chat examples appear twice so the assistant turn format is learned well enough for a demo.
    items = docs + chats + chats
    rng.shuffle(items)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("<|endoftext|>".join(items), encoding="utf-8")
    print(f"corpus: {len(docs)} files, {len(chats)} chat examples, {out.stat().st_size / 1e6:.1f} MB")


# -------------------------------------------------------------------------- tokenizer


def build_tokenizer(corpus: Path, out_dir: Path) -> None:
    """Train a byte-level BPE and save it as a transformers fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    text = corpus.read_text(encoding="utf-8")
    chunks = (c for c in text.split("<|endoftext|>"))
    tok.train_from_iterator(chunks, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MAX_POSITIONS
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    print(f"tokenizer: {tok.get_vocab_size()} tokens -> {out_dir}")


def tokenize_corpus(corpus: Path, tok_dir: Path, out: Path) -> np.ndarray:
    """Encode the corpus once into a uint16 token stream (cached)."""
    if out.exists():
        return np.load(out, mmap_mode="r")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for doc in tqdm(corpus.read_text(encoding="utf-8").split("<|endoftext|>"), desc="tokenize"):
        ids.extend(tok(doc, add_special_tokens=False)["input_ids"])
        ids.append(eot)
    arr = np.asarray(ids, dtype=np.uint16)
    np.save(out, arr)
    print(f"tokens: {len(arr):,}")
    return arr


# ---------------------------------------------------------------------------- training


def make_config(role: str, tok_dir: Path):
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tok_dir)
    shape = SHAPES[role]
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )


@dataclass
class TrainArgs:
    role: str
    steps: int
    batch: int
    seq_len: int
    lr: float
    warmup: int
    save_every: int
    minutes: float
    teacher: str | None
    kl_weight: float
    kl_from: int  # distil (CE + KL) from this step on; plain CE before it is ~4x cheaper per token
    seed: int


def _lr_at(step: int, a: TrainArgs) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _batch(tokens: np.ndarray, step: int, a: TrainArgs) -> torch.Tensor:
    # Windows are drawn from a step-seeded generator so a resumed run sees the same data.
    g = np.random.default_rng(a.seed * 1_000_003 + step)
    starts = g.integers(0, len(tokens) - a.seq_len - 1, size=a.batch)
    return torch.from_numpy(np.stack([tokens[s : s + a.seq_len + 1].astype(np.int64) for s in starts]))


def train(a: TrainArgs, tokens: np.ndarray, tok_dir: Path) -> Path:
    """Train (or resume training) one member of the pair; returns its checkpoint path."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(a.seed)
    ckpt = WORK / f"{a.role}.pt"
    config = make_config(a.role, tok_dir)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        print(f"resuming {a.role} at step {step}")
    teacher = None
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{a.role}: {n_params / 1e6:.2f}M parameters, {a.batch * a.seq_len} tokens/step")

    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "args": asdict(a)}, tmp)
        os.replace(tmp, ckpt)

    deadline = time.monotonic() + a.minutes * 60 if a.minutes > 0 else math.inf
    model.train()
    bar = tqdm(total=a.steps, initial=step, desc=f"train {a.role}", unit="step")
    ema = None
    while step < a.steps and not stop["now"] and time.monotonic() < deadline:
        if a.teacher and teacher is None and step >= a.kl_from:
            teacher = LlamaForCausalLM.from_pretrained(a.teacher, dtype=torch.float32).eval()
            if teacher.config.vocab_size != config.vocab_size:
                raise SystemExit("teacher and student vocabularies differ")
            print(f"distilling from {a.teacher} from step {step}")
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, a)
        batch = _batch(tokens, step, a)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=inputs).logits
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        loss = ce
        if teacher is not None:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(input_ids=inputs).logits, dim=-1)
            s_logp = F.log_softmax(logits, dim=-1)
            kl = F.kl_div(s_logp.flatten(0, 1), t_logp.flatten(0, 1), log_target=True, reduction="batchmean")
            loss = (1 - a.kl_weight) * ce + a.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = ce.item() if ema is None else 0.95 * ema + 0.05 * ce.item()
        bar.update(1)
        bar.set_postfix(ce=f"{ema:.3f}", lr=f"{_lr_at(step, a):.2e}")
        if step % a.save_every == 0:
            save()
    bar.close()
    save()
    print(f"{a.role}: saved step {step}/{a.steps} to {ckpt}")
    return ckpt


def export(role: str, tok_dir: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """Write a standard HF checkpoint (config, safetensors, tokenizer, chat template)."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    config = make_config(role, tok_dir)
    model = LlamaForCausalLM(config)
    state = torch.load(WORK / f"{role}.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    model = model.to(dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out_dir)
    # Newer transformers write the template to chat_template.jinja; older ones read it only from
    # tokenizer_config.json. Keep it in both so any version loads the chat format.
    tcfg_path = out_dir / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    tcfg["chat_template"] = CHAT_TEMPLATE
    tcfg_path.write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")
    meta = {"trained_steps": state["step"], "train_args": state["args"]}
    (out_dir / "specd_training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"exported {role} ({dtype}) step {state['step']} -> {out_dir}")


# --------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["corpus", "tokenizer", "train", "export-target", "export", "all"])
    p.add_argument("--role", choices=["target", "draft"], default="target")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--minutes", type=float, default=0.0, help="stop (and checkpoint) after this long")
    p.add_argument("--teacher", default=None, help="HF dir of the target to distill from (draft)")
    p.add_argument("--kl-weight", type=float, default=0.7)
    p.add_argument("--kl-from", type=int, default=None, help="first distillation step (default: 72%% of --steps)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    corpus, tok_dir, tokens_path = WORK / "corpus.txt", WORK / "tokenizer", WORK / "tokens.npy"
    stages = ["corpus", "tokenizer", "train-target", "export-target", "train-draft", "export"]
    todo = stages if args.stage == "all" else [args.stage]
    for stage in todo:
        if stage == "corpus" and not (args.stage == "all" and corpus.exists()):
            build_corpus(corpus)
        elif stage == "tokenizer" and not (args.stage == "all" and tok_dir.exists()):
            build_tokenizer(corpus, tok_dir)
        elif stage in ("train", "train-target", "train-draft"):
            role = args.role if stage == "train" else stage.split("-")[1]
            teacher = args.teacher
            if role == "draft" and teacher is None and args.stage == "all":
                teacher = str(WORK / "target-export")
            defaults = {"target": (600, 1e-3), "draft": (1250, 3e-3)}[role]
            steps = args.steps or defaults[0]
            targs = TrainArgs(
                role=role,
                steps=steps,
                batch=args.batch,
                seq_len=args.seq_len,
                lr=args.lr or defaults[1],
                warmup=args.warmup,
                save_every=args.save_every,
                minutes=args.minutes,
                teacher=teacher if role == "draft" else None,
                kl_weight=args.kl_weight,
                kl_from=args.kl_from if args.kl_from is not None else (steps * 18) // 25,
                seed=args.seed,
            )
            train(targs, tokenize_corpus(corpus, tok_dir, tokens_path), tok_dir)
        elif stage == "export-target":
            # fp32 copy used as the distillation teacher.
            export("target", tok_dir, WORK / "target-export", torch.float32)
        elif stage == "export":
            export("target", tok_dir, HERE / "demo-target", torch.bfloat16)
            export("draft", tok_dir, HERE / "demo-draft", torch.bfloat16)


if __name__ == "__main__":
    sys.exit(main())
