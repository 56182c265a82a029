"""Train a tokenizer on local files, for offline training from scratch (no Hub needed).

    python recipes/tokenizer.py --files ../shared/data/mnli/dev.jsonl --columns premise hypothesis \\
        --output_dir outputs/tokenizer
    python recipes/tokenizer.py --kind bpe --files ../shared/data/wikitext-2/valid.txt --output_dir outputs/bpe
"""

from __future__ import annotations

import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # imported from outside recipes/ (bench/language_model.py)
    sys.path.insert(0, _HERE)

from common import builder_for_file  # noqa: E402


def _iter_texts(files: list[str], columns: list[str] | None):
    import csv

    for path in files:
        builder = builder_for_file(path, text=True)
        with open(path, newline="" if builder == "csv" else None, encoding="utf-8") as f:
            if builder == "text":
                for line in f:
                    if line.strip():
                        yield line
                continue
            rows = csv.DictReader(f, delimiter="\t" if path.endswith(".tsv") else ",") if builder == "csv" else (
                json.loads(line) for line in f if line.strip()
            )
            for row in rows:
                for key in columns or [k for k, v in row.items() if isinstance(v, str)]:
                    if row.get(key):
                        yield row[key]


def train_tokenizer(
    files: list[str],
    output_dir: str,
    vocab_size: int = 8000,
    kind: str = "wordpiece",
    columns: list[str] | None = None,
    model_max_length: int = 512,
):
    """Train a tokenizer on local files and save it where ``--tokenizer_name`` can load it.

    ``kind="wordpiece"``: an uncased BERT tokenizer (for classification); ``kind="bpe"``: a
    byte-level BPE tokenizer as GPT-2's (for language modelling). Text files give one example a
    line; csv / json / jsonl give the string ``columns`` (default: every string column).
    """
    from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer
    from transformers import BertTokenizerFast, GPT2TokenizerFast

    os.makedirs(output_dir, exist_ok=True)
    texts = _iter_texts(files, columns)
    if kind == "wordpiece":
        special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        raw = BertWordPieceTokenizer(lowercase=True)
        raw.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=special)
        raw.save_model(output_dir)  # vocab.txt
        tokenizer = BertTokenizerFast.from_pretrained(
            output_dir, do_lower_case=True, model_max_length=model_max_length
        )
    elif kind == "bpe":
        raw = ByteLevelBPETokenizer()
        raw.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=["<|endoftext|>"])
        raw.save_model(output_dir)  # vocab.json, merges.txt
        tokenizer = GPT2TokenizerFast.from_pretrained(output_dir, model_max_length=model_max_length)
    else:
        raise ValueError(f"kind must be 'wordpiece' or 'bpe', got {kind!r}.")
    tokenizer.save_pretrained(output_dir)
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    import argparse

    tok = argparse.ArgumentParser(prog="python recipes/tokenizer.py", description=__doc__.split("\n")[0])
    tok.add_argument("--files", nargs="+", required=True, help="Text, csv, json or jsonl files.")
    tok.add_argument("--output_dir", required=True)
    tok.add_argument("--vocab_size", type=int, default=8000)
    tok.add_argument("--kind", choices=("wordpiece", "bpe"), default="wordpiece")
    tok.add_argument("--columns", nargs="+", default=None, help="Columns of csv/json files to read.")
    tok.add_argument("--model_max_length", type=int, default=512)
    args = tok.parse_args(argv)
    tokenizer = train_tokenizer(
        args.files, args.output_dir, args.vocab_size, args.kind, args.columns, args.model_max_length
    )
    print(f"Saved a {args.kind} tokenizer with {len(tokenizer)} tokens to {args.output_dir}")


if __name__ == "__main__":
    main()
