"""Train deltaserve's tiny demo model: a ~3.7M-parameter Llama on CPython's own stdlib source.

Everything comes from text every machine has offline: the `.py` files of the running
interpreter's standard library (no site-packages, no test directories, UTF-8 only, sorted,
capped in size). The script

1. trains a byte-level BPE tokenizer (`tokenizers`) with the single special token
   `<|endoftext|>` (BOS, EOS and PAD at once; it also separates the files in the corpus),
2. trains a `LlamaForCausalLM` from scratch on random windows of the token stream
   (AdamW, linear warmup + cosine decay, gradient clipping, bf16 autocast on CPU),
3. saves tokenizer, config, generation config and bfloat16 `model.safetensors` into `--out`,
   reloads them with `AutoTokenizer` / `LlamaForCausalLM` and prints a greedy sample.

Run from the repository root:  python scripts/train_demo_model.py
It uses 2 CPU threads and takes about 20 minutes on an otherwise idle 2-core Xeon with
AMX/bf16 (corpus + tokenizer ~20 s, 800 training steps at ~1.3 s each, ~6k tokens/s); other
CPU-heavy processes slow it down a lot (41 min when it shared the machine). It is
deterministic for a given machine, Python version (the corpus is that version's stdlib) and
torch version: fixed seeds, sorted files, one process, `torch.use_deterministic_algorithms`,
and a fixed step count (`--minutes` is an optional wall-clock cap that trades that
determinism for a deadline).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

EOT = "<|endoftext|>"
SEED = 1234
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
SAMPLE_PROMPT = "def fibonacci(n):"


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch_size: int
    context: int
    lr: float
    min_lr: float
    warmup: int
    weight_decay: float
    grad_clip: float
    minutes: float | None
    bf16_autocast: bool


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="launch/model_cache/default_model", help="output directory")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps (the budget)")
    p.add_argument("--minutes", type=float, default=None,
                   help="optional wall-clock cap on training; stops early (non-deterministic)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--context", type=int, default=256, help="training window length in tokens")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--vocab-size", type=int, default=3072)
    p.add_argument("--corpus-mb", type=float, default=16.0, help="cap on corpus size (MB)")
    p.add_argument("--fp32", action="store_true", help="train without bf16 autocast")
    return p.parse_args()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)


# ----------------------------------------------------------------------------- corpus

def stdlib_files(root: Path) -> list[Path]:
    """Sorted `.py` files under the stdlib, skipping site-packages and test directories."""
    files = []
    for path in root.rglob("*.py"):
        rel_dirs = path.relative_to(root).parts[:-1]
        if any(d in EXCLUDED_DIRS for d in rel_dirs):
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(max_bytes: int) -> tuple[list[str], str]:
    """Texts of the stdlib files in sorted order (UTF-8 only, up to `max_bytes`) and a digest."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    digest = hashlib.sha256()
    total = 0
    for path in stdlib_files(root):
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if EOT in text or not text.strip():
            continue
        if total + len(raw) > max_bytes:
            break
        texts.append(text)
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + raw)
        total += len(raw)
    print(f"corpus: {len(texts)} files, {total / 1e6:.2f} MB from {root} "
          f"(sha256 {digest.hexdigest()[:16]})")
    return texts, digest.hexdigest()


# -------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte sequence round-trips, including indentation and newlines."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    eot = tok.token_to_id(EOT)
    # Like Llama: a BOS is prepended to every encoded text (the model saw one before each file).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot)])
    return tok


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT,
                                   pad_token=EOT, model_max_length=1024,
                                   clean_up_tokenization_spaces=False)


def encode_corpus(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """One stream: <|endoftext|> file <|endoftext|> file ... (the post-processor adds the BOS)."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
    ids.append(tok.token_to_id(EOT))
    stream = torch.tensor(ids, dtype=torch.int64)
    chars = sum(len(t) for t in texts)
    print(f"tokens: {len(stream):,} ({chars / len(stream):.2f} chars/token)")
    return stream


def check_round_trip(tok: Tokenizer, texts: list[str]) -> None:
    for text in texts[:50]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text, "round trip"


# ------------------------------------------------------------------------------ model

def model_config(vocab_size: int, eot_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_act="silu",
        max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=True, initializer_range=0.02,
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id,
        architectures=["LlamaForCausalLM"])


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: torch.nn.Module, s: TrainSettings) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms (1-D parameters)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def sample_batch(stream: torch.Tensor, s: TrainSettings, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - s.context, (s.batch_size,), generator=gen)
    return torch.stack([stream[i:i + s.context] for i in starts.tolist()])


def train(model: LlamaForCausalLM, stream: torch.Tensor, s: TrainSettings) -> dict[str, float]:
    """The training loop; returns loss / throughput statistics."""
    opt = make_optimizer(model, s)
    gen = torch.Generator().manual_seed(SEED)
    losses: list[float] = []
    deadline = time.monotonic() + s.minutes * 60 if s.minutes else math.inf
    start = time.monotonic()
    model.train()
    bar = tqdm(range(s.steps), desc="train", dynamic_ncols=True)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        batch = sample_batch(stream, s, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.bf16_autocast):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tok_s = len(losses) * batch.numel() / (time.monotonic() - start)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", avg50=f"{np.mean(losses[-50:]):.3f}",
                        lr=f"{lr_at(step, s):.1e}", tok_s=f"{tok_s:.0f}")
        if time.monotonic() > deadline:
            print(f"--minutes budget reached after {step + 1} steps")
            break
    bar.close()
    elapsed = time.monotonic() - start
    return {"steps": len(losses), "final_loss": float(np.mean(losses[-50:])),
            "tokens": len(losses) * s.batch_size * s.context, "train_seconds": elapsed,
            "tokens_per_s": len(losses) * s.batch_size * s.context / elapsed}


# ------------------------------------------------------------------------ save, check

def save(out: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # transformers 5 writes its new class name "TokenizersBackend"; "PreTrainedTokenizerFast"
    # is an alias for it in v5 and the real class in v4, so either version can load the dir.
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    cfg = model.config
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                     pad_token_id=cfg.pad_token_id, do_sample=False,
                     max_new_tokens=64).save_pretrained(out)


def greedy_sample(out: Path, prompt: str, new_tokens: int = 60) -> str:
    """Reload the saved directory the way a user would and greedily complete `prompt`."""
    tok = AutoTokenizer.from_pretrained(out)
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(gen[0], skip_special_tokens=True)


def dir_size(out: Path) -> int:
    return sum(f.stat().st_size for f in out.iterdir() if f.is_file())


def main() -> None:
    args = parse_args()
    wall_start = time.monotonic()
    seed_everything(SEED)
    settings = TrainSettings(steps=args.steps, batch_size=args.batch_size, context=args.context,
                             lr=args.lr, min_lr=args.lr / 10, warmup=args.warmup,
                             weight_decay=0.1, grad_clip=1.0, minutes=args.minutes,
                             bf16_autocast=not args.fp32)
    texts, _ = load_corpus(int(args.corpus_mb * 1e6))
    tok = train_tokenizer(texts, args.vocab_size)
    check_round_trip(tok, texts)
    stream = encode_corpus(tok, texts)
    eot_id = tok.token_to_id(EOT)
    model = LlamaForCausalLM(model_config(tok.get_vocab_size(), eot_id))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters; {settings}")
    stats = train(model, stream, settings)
    out = Path(args.out)
    save(out, model, wrap_tokenizer(tok))
    sample = greedy_sample(out, SAMPLE_PROMPT)
    wall = time.monotonic() - wall_start
    summary = {"parameters": n_params, **stats, "wall_seconds": wall,
               "dir_bytes": dir_size(out), "python": sys.version.split()[0],
               "torch": torch.__version__}
    print(json.dumps(summary, indent=2))
    print(f"--- greedy sample ---\n{sample}\n---")


if __name__ == "__main__":
    main()
