"""``foldtune data prepare``: tokenize local text files (byte-level) into memory-mapped training shards."""

from __future__ import annotations

import argparse

HELP = "prepare a tokenized training dataset from local text files"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help="tokenize text files (byte-level) into memory-mapped shards")
    prep.add_argument("inputs", nargs="+", help="text files, or directories searched for .txt/.md/.rst")
    prep.add_argument("--out", required=True, help="output directory (index.json + *.bin shards)")
    prep.add_argument("--heldout", type=float, default=0.1,
                      help="fraction of every document kept for evaluation (default: 0.1)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 26, help="tokens per shard file (default: 2^26)")
    prep.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")


def run(args: argparse.Namespace) -> int:
    from executor.dataset.prepare import prepare_dataset  # imports torch: not for `foldtune --help`

    done = prepare_dataset(args.inputs, args.out, args.heldout, args.shard_tokens, args.overwrite)
    print(f"prepared {done.path}: {done.documents} documents, {done.train_tokens} training tokens, "
          f"{done.heldout_tokens} held-out tokens (byte-level tokenizer, vocab 256)")
    return 0
