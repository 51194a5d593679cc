"""Train the repository's tiny default model: a 4-layer Qwen3 on the King James Bible.

What it does, end to end, on CPU only and without any network access:

1. Builds the corpus from Debian's ``bible-kjv`` package (``bible -f gen1:1-rev22:21``),
   strips the verse references and joins the verses of each book into running text.
   Books are separated by ``<|endoftext|>``, so the model rarely emits EOS mid-passage.
   Validation split (fixed): the last 2% of each book's verses (at least one verse).
2. Trains a byte-level BPE tokenizer (vocab 4096) on the training split.
3. Builds a ``Qwen3ForCausalLM`` with about 4.2M parameters (hidden 256, 4 layers,
   8 query heads / 4 KV heads of dim 32, tied embeddings).
4. Trains it with AdamW and a warmup + cosine learning-rate schedule on 256-token
   blocks, in a seeded, deterministic order.
5. Saves model (float32 safetensors), tokenizer and a README into ``--out``.

How long it takes: ``--minutes`` is the wall-clock training budget (default 35).
The step count is fixed early, from the time of the first training steps, so that the
cosine schedule ends exactly when the budget does; the run is then reproducible with
``--steps N``, which the script prints at the end. Corpus and tokenizer take < 1 min.
On a machine busy with other work, ``--threads 1`` trains faster than the default 2.

A draft model for speculative decoding (L10) must share the target's tokenizer: pass
``--tokenizer assets/tiny-qwen3-kjv`` to reuse that folder's tokenizer instead of training
one, and ``--hidden-size``/``--layers`` for a smaller model (the MLP is 3x hidden, heads
of dim 32, half as many KV heads as query heads).

Usage:
    python scripts/train_tiny_model.py [--out DIR] [--minutes M | --steps N]
                                       [--seed S] [--lr LR] [--batch-size B] [--threads T]
                                       [--tokenizer DIR] [--hidden-size H] [--layers L]
"""

import argparse
import json
import math
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

EOS = "<|endoftext|>"
VOCAB_SIZE = 4096
SEQ_LEN = 256
VAL_FRACTION = 0.02
WARMUP_STEPS = 50
TIMING_STEPS = 20
NUM_EVALS = 10
MIN_LR_RATIO = 0.1
VERSE_RE = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")


# ---------------------------------------------------------------- corpus


def read_bible():
    """Return the KJV as a list of (book, verse text) pairs, in canonical order."""
    if shutil.which("bible") is None:
        sys.exit("error: the `bible` program is missing; run `apt-get install bible-kjv`")
    out = subprocess.run(["bible", "-f", "gen1:1-rev22:21"],
                         capture_output=True, text=True, check=True).stdout
    verses = []
    for line in out.splitlines():
        match = VERSE_RE.match(line)
        if match:
            verses.append((match.group(1), match.group(4).strip()))
    return verses


def split_books(verses):
    """Group verses by book and split each book into (train text, validation text)."""
    books = {}
    for book, text in verses:
        books.setdefault(book, []).append(text)
    train, val = [], []
    for book_verses in books.values():
        n_val = max(1, round(len(book_verses) * VAL_FRACTION))
        train.append(" ".join(book_verses[:-n_val]))
        val.append(" ".join(book_verses[-n_val:]))
    return train, val


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts):
    """Train a byte-level BPE tokenizer with `<|endoftext|>` as its only special token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer, out_dir):
    """Write tokenizer.json and a tokenizer_config.json that AutoTokenizer loads offline."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def check_round_trip(out_dir, texts):
    """Reload the saved tokenizer with transformers and check decode(encode(x)) == x."""
    hf_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    for text in texts:
        ids = hf_tokenizer.encode(text, verbose=False)
        if hf_tokenizer.decode(ids) != text:
            sys.exit("error: tokenizer does not round-trip the text")


def encode_stream(tokenizer, texts, eos_id):
    """Encode the books into one token stream with EOS between books."""
    stream = []
    for i, text in enumerate(texts):
        if i:
            stream.append(eos_id)
        stream.extend(tokenizer.encode(text).ids)
    return torch.tensor(stream, dtype=torch.long)


def to_blocks(stream):
    """Cut a token stream into non-overlapping blocks of SEQ_LEN + 1 tokens."""
    n_blocks = (len(stream) - 1) // SEQ_LEN
    starts = torch.arange(n_blocks) * SEQ_LEN
    return torch.stack([stream[s:s + SEQ_LEN + 1] for s in starts.tolist()])


# ---------------------------------------------------------------- model


def build_model(eos_id, hidden_size=256, num_layers=4):
    """The tiny Qwen3 architecture (about 4.2M parameters at the defaults)."""
    num_heads = hidden_size // 32
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=32,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return Qwen3ForCausalLM(config)


# ---------------------------------------------------------------- training


def lr_at(step, total_steps, peak_lr):
    """Linear warmup for WARMUP_STEPS, then cosine decay to MIN_LR_RATIO * peak."""
    if step < WARMUP_STEPS:
        return peak_lr * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return peak_lr * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * cosine)


def batches(train_blocks, batch_size, seed):
    """Endless batches: each epoch is a seeded permutation of the training blocks."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(train_blocks), generator=generator)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield train_blocks[order[i:i + batch_size]]


def loss_on(model, block):
    """Mean next-token cross-entropy on a (batch, SEQ_LEN + 1) block."""
    logits = model(input_ids=block[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), block[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, val_blocks, batch_size):
    """Mean validation loss over all validation blocks."""
    model.eval()
    total = 0.0
    for i in range(0, len(val_blocks), batch_size):
        block = val_blocks[i:i + batch_size]
        total += loss_on(model, block).item() * len(block)
    model.train()
    return total / len(val_blocks)


def train_step(model, optimizer, block, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = loss_on(model, block)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def steps_for_budget(args, elapsed, step_time, eval_time):
    """Number of steps that fits the remaining budget, evaluations included."""
    remaining = args.minutes * 60 - elapsed - NUM_EVALS * eval_time
    return max(WARMUP_STEPS + TIMING_STEPS, int(remaining / step_time))


def train(model, train_blocks, val_blocks, args):
    """Run the training loop; return (loss history, total steps, seconds)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    data = batches(train_blocks, args.batch_size, args.seed)
    start = time.time()
    history = [(0, float("nan"), evaluate(model, val_blocks, args.batch_size))]
    eval_time = time.time() - start
    # In budget mode the step count is provisional until the timing steps are done.
    total_steps = args.steps or WARMUP_STEPS + TIMING_STEPS
    eval_every = max(1, total_steps // NUM_EVALS) if args.steps else total_steps
    since_eval, recent = [], []
    bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True)
    step = 0
    while step < total_steps:
        step += 1
        if step == 2:
            timing_start = time.time()
        loss = train_step(model, optimizer, next(data), lr_at(step - 1, total_steps, args.lr))
        since_eval.append(loss)
        recent = (recent + [loss])[-50:]
        bar.update(1)
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}")
        if args.steps is None and step == TIMING_STEPS + 1:
            step_time = (time.time() - timing_start) / TIMING_STEPS
            total_steps = steps_for_budget(args, time.time() - start, step_time, eval_time)
            eval_every = max(1, total_steps // NUM_EVALS)
            bar.total = total_steps
            bar.refresh()
            tqdm.write(f"step time {step_time:.2f}s -> total steps fixed at {total_steps}")
        if step % eval_every == 0 or step == total_steps:
            val_loss = evaluate(model, val_blocks, args.batch_size)
            history.append((step, sum(since_eval) / len(since_eval), val_loss))
            since_eval = []
            tqdm.write(f"step {step:5d}  train {history[-1][1]:.3f}  val {val_loss:.3f}")
    bar.close()
    return history, total_steps, time.time() - start


# ---------------------------------------------------------------- output


def print_curve(history):
    print("\n  step | train loss | val loss")
    print("-------+------------+---------")
    for step, train_loss, val_loss in history:
        train_str = "      -" if math.isnan(train_loss) else f"{train_loss:7.3f}"
        print(f"{step:6d} |    {train_str} |  {val_loss:6.3f}")


def reproduce_command(args, total_steps):
    parts = ["python", "scripts/train_tiny_model.py", "--out", str(args.out),
             "--steps", str(total_steps), "--seed", str(args.seed),
             "--lr", str(args.lr), "--batch-size", str(args.batch_size),
             "--threads", str(args.threads)]
    if args.tokenizer is not None:
        parts += ["--tokenizer", str(args.tokenizer), "--hidden-size", str(args.hidden_size),
                  "--layers", str(args.layers)]
    return shlex.join(parts)


ROLE_DEFAULT = """It is the repository's embedded default model: small
enough to ship in git and to run on CPU, big enough to produce KJV-flavoured text and to
exercise a real KV cache. It is a teaching toy, not a useful language model."""
ROLE_DRAFT = """It shares the tokenizer of `{}` and drafts
tokens for it in speculative decoding (L10): a smaller model that guesses the larger one's
next tokens, cheaply. It is a teaching toy, not a useful language model."""


def write_readme(out_dir, info):
    text = f"""# {out_dir.name}

A tiny causal language model (Qwen3 architecture, {info['params']:,} parameters) trained
from scratch on the King James Bible. {info['role']}

## Architecture (`Qwen3ForCausalLM`, float32)

| setting | value |
|---|---|
| vocab size | {VOCAB_SIZE} |
| hidden size | {info['hidden_size']} |
| intermediate (MLP) size | {3 * info['hidden_size']} |
| layers | {info['layers']} |
| attention heads (query / key-value) | {info['hidden_size'] // 32} / \
{max(1, info['hidden_size'] // 64)} (grouped-query attention) |
| head dim | 32 |
| max positions | 2048 (trained on {SEQ_LEN}-token blocks) |
| RoPE theta | 10000 |
| RMSNorm eps | 1e-6 |
| tied input/output embeddings | yes |
| parameters | {info['params']:,} |

## Training data

The King James Version text from Debian's `bible-kjv-text` package, read with
`bible -f gen1:1-rev22:21` (package `bible-kjv`), verse references removed. The verses of
each book are joined by spaces into running text; books are separated by `<|endoftext|>`.
The package's copyright file, `/usr/share/doc/bible-kjv-text/copyright`, grants
unrestricted use of the text (users may copy, modify or distribute it at will, keeping
the legend) and notes that the copyright on the 1611 translation has expired.

Validation split: the last 2% of each book's verses (at least one verse per book),
{info['val_tokens']:,} tokens; the remaining {info['train_tokens']:,} tokens are training data.

## Tokenizer

{info['tokenizer_note']}Byte-level BPE (`tokenizers` library, ByteLevel pre-tokenizer and decoder) trained on
the training split, vocabulary {VOCAB_SIZE}. The only special token is `<|endoftext|>`
(id {info['eos_id']}), used as EOS and padding; no BOS token is added.

## Training

- AdamW, betas 0.9/0.95, weight decay 0.1, gradient clipping 1.0
- peak learning rate {info['lr']}, {WARMUP_STEPS} warmup steps,
  cosine decay to {MIN_LR_RATIO:g} x peak
- batch {info['batch_size']} x {SEQ_LEN} tokens, {info['steps']} steps \
({info['epochs']:.1f} epochs), seed {info['seed']}
- CPU, {info['threads']} torch thread(s), {info['minutes']:.1f} minutes of training

Final loss (nats per token): train {info['train_loss']:.3f}, validation {info['val_loss']:.3f}.

Remade with:

    {info['command']}
"""
    (out_dir / "README.md").write_text(text)


# ---------------------------------------------------------------- main


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("assets/tiny-qwen3-kjv"))
    parser.add_argument("--minutes", type=float, default=35.0,
                        help="wall-clock training budget (ignored with --steps)")
    parser.add_argument("--steps", type=int, default=None,
                        help="fix the number of training steps exactly (reproducible)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads; 1 is faster on a machine busy with other work")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="reuse this model folder's tokenizer (a draft model must share "
                             "its target's) instead of training one")
    parser.add_argument("--hidden-size", type=int, default=256, help="a multiple of 64")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if args.steps is not None and args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be larger than the {WARMUP_STEPS} warmup steps")
    if args.hidden_size % 64 or args.hidden_size <= 0 or args.layers <= 0:
        parser.error("--hidden-size must be a positive multiple of 64 and --layers positive")
    if args.tokenizer is not None and not (args.tokenizer / "tokenizer.json").is_file():
        parser.error(f"--tokenizer {args.tokenizer}: no tokenizer.json there; "
                     "pass a model folder that has one")
    return args


def main():
    args = parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    train_texts, val_texts = split_books(read_bible())
    if args.tokenizer is None:
        tokenizer = train_tokenizer(train_texts)
    else:
        tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    save_tokenizer(tokenizer, args.out)
    check_round_trip(args.out, train_texts + val_texts)
    eos_id = tokenizer.token_to_id(EOS)
    train_stream = encode_stream(tokenizer, train_texts, eos_id)
    val_stream = encode_stream(tokenizer, val_texts, eos_id)
    train_blocks, val_blocks = to_blocks(train_stream), to_blocks(val_stream)

    model = build_model(eos_id, args.hidden_size, args.layers)
    params = sum(p.numel() for p in model.parameters())
    budget = f"{args.steps} steps" if args.steps else f"{args.minutes:g} minutes"
    print(f"corpus: {len(train_stream):,} train / {len(val_stream):,} val tokens "
          f"({len(train_blocks)} / {len(val_blocks)} blocks of {SEQ_LEN})")
    print(f"model: Qwen3, {params:,} parameters; out: {args.out}")
    print(f"training: budget {budget}, batch {args.batch_size} x {SEQ_LEN}, lr {args.lr}, "
          f"warmup {WARMUP_STEPS}, cosine to {MIN_LR_RATIO:g}x, seed {args.seed}, "
          f"{args.threads} thread(s)")

    history, total_steps, seconds = train(model, train_blocks, val_blocks, args)
    print_curve(history)

    model.generation_config.do_sample = False
    model.save_pretrained(args.out, safe_serialization=True)
    command = reproduce_command(args, total_steps)
    write_readme(args.out, {
        "params": params, "train_tokens": len(train_stream), "val_tokens": len(val_stream),
        "eos_id": eos_id, "lr": args.lr, "batch_size": args.batch_size, "steps": total_steps,
        "epochs": total_steps * args.batch_size / len(train_blocks), "seed": args.seed,
        "threads": args.threads, "minutes": seconds / 60,
        "train_loss": history[-1][1], "val_loss": history[-1][2],
        "command": command, "hidden_size": args.hidden_size, "layers": args.layers,
        "role": ROLE_DEFAULT if args.tokenizer is None else ROLE_DRAFT.format(args.tokenizer),
        "tokenizer_note": "" if args.tokenizer is None else
        f"Copied from `{args.tokenizer}` (same ids, so it can draft for that model). ",
    })
    print(f"\nsaved to {args.out} ({seconds / 60:.1f} min of training)")
    print(f"reproduce with: {command}")


if __name__ == "__main__":
    main()
