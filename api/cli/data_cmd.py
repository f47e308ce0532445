"""``foldtune data prepare``: tokenize local text files (byte-level, or a local Hugging Face tokenizer.json)
into memory-mapped training shards."""

from __future__ import annotations

import argparse

from api.cli.arguments import add
from spec.errors import SpecError

HELP = "prepare a tokenized training dataset from local text files"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help="tokenize text files (byte-level) into memory-mapped shards")
    prep.add_argument("inputs", nargs="+", help="text files, or directories searched for .txt/.md/.rst")
    add(prep, "--out", "a directory: index.json and *.bin shards", required=True)
    prep.add_argument("--heldout", type=float, default=0.1,
                      help="fraction of every document kept for evaluation (default: 0.1)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 26, help="tokens per shard file (default: 2^26)")
    prep.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")
    prep.add_argument("--tokenizer", metavar="DIR",
                      help="a local Hugging Face tokenizer (a directory with tokenizer.json, or the file); "
                           "default: the byte-level tokenizer (vocab 256)")
    prep.add_argument("--eos-id", type=int, help="the id separating documents (default: the tokenizer's EOS)")
    prep.add_argument("--pack", action="store_true",
                      help="pack documents into rows of --seq + 1 tokens with their boundaries (training then "
                           "attends within documents, RoPE restarts per document, padding has no loss)")
    add(prep, "--seq", "with --pack: the training sequence length the rows are packed for")


def run(args: argparse.Namespace) -> int:
    # imports torch: not for `foldtune --help`
    from executor.dataset.hf_tokenizer import HFTokenizer, token_dtype
    from executor.dataset.prepare import prepare_dataset

    if args.eos_id is not None and not args.tokenizer:
        raise SpecError("--eos-id needs --tokenizer (the byte tokenizer separates documents by a blank line)")
    if args.pack != (args.seq is not None):
        raise SpecError("--pack and --seq go together: --pack --seq N packs documents into rows of N + 1 tokens")
    tokenizer = HFTokenizer(args.tokenizer, args.eos_id) if args.tokenizer else None
    done = prepare_dataset(args.inputs, args.out, args.heldout, args.shard_tokens, args.overwrite, tokenizer,
                           args.seq)
    what = ("byte-level tokenizer, vocab 256" if tokenizer is None else
            f"{tokenizer.name}, vocab {tokenizer.vocab_size}, {token_dtype(tokenizer.vocab_size)} ids, "
            f"documents separated by EOS id {tokenizer.eos_id}")
    print(f"prepared {done.path}: {done.documents} documents, {done.train_tokens} training tokens, "
          f"{done.heldout_tokens} held-out tokens ({what})")
    if done.seq_length is not None:
        print(f"packed into rows of {done.seq_length} + 1 tokens with document boundaries; "
              f"{done.train_padding} of the training tokens are padding")
    return 0
