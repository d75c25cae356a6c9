#!/usr/bin/env python
"""Fine-tune (or train) any fastzoo causal LM (GPT-2, Llama, Qwen2, Mistral) on text files, packed to a token budget.

    python scripts/finetune_causal_lm.py --model gpt2 --pretrained gpt2_hf_dir/ --tokenizer gpt2_hf_dir/ \\
        --train-files data/*.txt --max-tokens 16384 -b 8 --lr 5e-5 --amp bf16
    torchrun --nproc_per_node 8 scripts/finetune_causal_lm.py ...   # same global batch, DDP

Documents are the blank-line separated paragraphs of the files, each followed by the
end-of-text token and cut to ``--max-seq-len`` tokens. They are packed greedily into items
of at most ``--max-tokens`` tokens; a step takes ``--batch-size`` items (global) and feeds
them to the model as one packed row with ``cu_seqlens`` (varlen attention: no padding, no
cross-document attention), or padded with ``--padded``. The loss is the mean next-token
cross-entropy over all target tokens of the global batch; perplexity on the held-out split
is printed after every epoch.

Tokenizer: a local Hugging Face tokenizer directory (``--tokenizer DIR``; never the hub),
or bytes (ids 0..255, end-of-text 256) when none is given. The recipe comes from the model: its
longest sequence (a learned position table's ``n_positions``; a rotary model's
``max_position_embeddings``), within ``--max-tokens``. Checkpoints are directories transformers' ``from_pretrained``
reads (its ``config.json`` with ``model_type``, its keys) as well as ``pretrained=`` sources.
``--model`` takes any causal LM of ``fastzoo list`` (gpt2, llama, qwen2, mistral...).
"""
from __future__ import annotations

import math
import random
from pathlib import Path

import torch

from fastzoo.losses import IGNORE_INDEX, next_token_targets
from fastzoo.tasks import CAUSAL_LM
from fastzoo.train import Task, UsageError, parse_args, run_main, setup, train, train_parser
from fastzoo.train.cli import create_model, positive_int


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and 256 as end-of-text: needs no files, covers any text."""

    eos_token_id = 256

    def __len__(self):
        return 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def load_tokenizer(path: Path | None):
    if path is None:
        return ByteTokenizer()
    if not Path(path).is_dir():
        raise UsageError(f"--tokenizer {path}: not a directory (give a local Hugging Face tokenizer directory)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise UsageError(f"--tokenizer {path}: cannot load a tokenizer from it: {e}") from e
    if tok.eos_token_id is None:
        raise UsageError(f"--tokenizer {path}: the tokenizer has no end-of-text (eos) token")
    return tok


def tokenizer_vocabulary(tok) -> dict:
    """A fresh model's vocabulary as the tokenizer's: its size and its end-of-text (and beginning-of-text)
    ids, so that ``generate`` on the saved checkpoint stops where the training text ended (a variant's
    own ids, Qwen's 151645, lie outside a byte vocabulary)."""
    return {"vocab_size": len(tok), "eos_token_id": tok.eos_token_id, "bos_token_id": getattr(tok, "bos_token_id", None)}


def read_documents(files: list[Path], tok, max_seq_len: int) -> list[torch.Tensor]:
    """Blank-line separated paragraphs -> token tensors (+ eos), cut to ``max_seq_len``."""
    docs = []
    for f in files:
        try:
            text = Path(f).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read text file {f}: {e}") from e
        for para in text.split("\n\n"):
            if para.strip():
                ids = torch.tensor(tok.encode(para.strip()) + [tok.eos_token_id], dtype=torch.long)
                docs.extend(p for p in ids.split(max_seq_len) if len(p) > 1)
    return docs


def pack_to_budget(docs: list[torch.Tensor], max_tokens: int, seed: int) -> list[list[torch.Tensor]]:
    """Greedy packing in a seeded random order: each item holds documents totalling at most
    ``max_tokens`` tokens."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    items, current, used = [], [], 0
    for i in order:
        if current and used + len(docs[i]) > max_tokens:
            items.append(current)
            current, used = [], 0
        current.append(docs[i])
        used += len(docs[i])
    if current:
        items.append(current)
    return items


def build_parser():
    p = train_parser(__doc__.splitlines()[1], model_default="gpt2")
    p.set_defaults(attn="varlen", lr=5e-5, weight_decay=0.0, batch_size=8)
    g = p.add_argument_group("data")
    g.add_argument("--train-files", type=Path, nargs="+", help="UTF-8 text files")
    g.add_argument("--validation-file", type=Path, default=None, help="held-out text (default: a split of the train files)")
    g.add_argument("--validation-split-percentage", type=float, default=5.0,
                   help="percent of documents held out when no --validation-file is given")
    g.add_argument("--tokenizer", type=Path, default=None, help="local Hugging Face tokenizer directory; default: bytes")
    g.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="longest document piece (default: the model's longest position)")
    g.add_argument("--max-tokens", type=positive_int, default=8192, help="token budget of one packed item")
    g.add_argument("--padded", action="store_true", help="pad each batch instead of packing it (attention_mask)")
    return p


def main(argv=None) -> int:
    from fastzoo.data import pack, pad_to_longest

    parser = build_parser()
    args = parse_args(parser, argv)
    if not args.train_files and args.replay is None:
        parser.error("give the text: --train-files FILE [FILE ...]")
    for f in [*(args.train_files or []), *([args.validation_file] if args.validation_file else [])]:
        if not Path(f).is_file():
            raise UsageError(f"no such text file: {f}")
    world = setup(args)
    tok = load_tokenizer(args.tokenizer)
    vocab = {} if args.pretrained or "vocab_size" in args.model_kwargs else {
        k: v for k, v in tokenizer_vocabulary(tok).items() if k not in args.model_kwargs}
    model = create_model(args, device=world.device, task=CAUSAL_LM, **vocab)
    if len(tok) > model.config.vocab_size:
        raise UsageError(f"the tokenizer has {len(tok)} ids but {args.model} has vocab_size {model.config.vocab_size}")
    longest = model.n_positions  # a learned position table's length; None: rotary, no hard limit
    if longest is not None and args.max_seq_len and args.max_seq_len > longest:
        raise UsageError(f"--max-seq-len {args.max_seq_len} exceeds the model's n_positions {longest}")
    if args.max_seq_len and args.max_seq_len > args.max_tokens:
        raise UsageError(f"--max-seq-len {args.max_seq_len} exceeds --max-tokens {args.max_tokens}: a document piece "
                         f"must fit in one packed item; raise --max-tokens or lower --max-seq-len")
    # a document piece: the model's longest sequence, within one item's budget
    max_seq_len = args.max_seq_len or min(longest or getattr(model.config, "max_position_embeddings", None) or 1024,
                                          args.max_tokens)

    train_items = eval_items = None
    if args.replay is None:
        docs = read_documents(args.train_files, tok, max_seq_len)
        if args.validation_file:
            held = read_documents([args.validation_file], tok, max_seq_len)
        else:
            random.Random(args.seed).shuffle(docs)
            n_held = max(1, int(len(docs) * args.validation_split_percentage / 100)) if len(docs) > 1 else 0
            held, docs = docs[:n_held], docs[n_held:]
        if not docs:
            raise UsageError(f"no text in {', '.join(map(str, args.train_files))}")
        train_items = pack_to_budget(docs, args.max_tokens, args.seed)
        eval_items = pack_to_budget(held, args.max_tokens, args.seed) if held else None

    def collate(items):
        seqs = [doc for item in items for doc in item]
        b = pad_to_longest(seqs) if args.padded else pack(seqs)
        return {**b.model_inputs(), "labels": b.labels}

    def nll(model, batch):
        # HF's labels convention (shifted inside the model, never across a packed boundary);
        # num_items_in_batch=1 asks for the summed loss: the loop divides by the global count.
        # In train mode the model fuses the loss with the LM head (no logits materialised).
        out = model(**batch, num_items_in_batch=1)
        targets = next_token_targets(batch["labels"], cu_seqlens=batch.get("cu_seqlens"))
        return out.loss, (targets != IGNORE_INDEX).sum()

    task = Task(model=model, train_items=train_items, collate=collate, loss=nll,
                eval_items=eval_items, eval_step=lambda m, b: {"loss": nll(m, b)},
                eval_finish=lambda r: {**r, "ppl": math.exp(min(r["loss"], 50.0))}, unit="tok")
    return train(args, task, world)


if __name__ == "__main__":
    run_main(main)
