"""Build the token ranking a cut draft head keeps from (`--draft-vocab N` keeps the N first): token ids by how often
the target itself wrote them, counted over the train split of a corpus `verispec collect` wrote.

    .venv/bin/python scripts/build_token_ranks.py --corpus artifacts/corpus-qwen2.5-coder-1.5b \\
        --out src/verispec/assets/qwen2.5-token-ranks

Writes ranks.safetensors: "ids" (int32, the ids written at least once, most frequent first, ties by id) and
"counts", with the tokenizer's sha256 in its header; ids never written follow at use time in id order (a
byte-pair vocabulary's low ids are its earliest, most frequent merges).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from verispec.head_training.corpus import read_corpus
from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_TARGET
from verispec.ngram.table import tokenizer_fingerprint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--target", default=DEFAULT_TARGET, help="whose tokenizer the ids are (default: %(default)s)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    manifest, records = read_corpus(Path(args.corpus))
    counts = Counter(t for r in records if r["split"] == "train" for t in r["answer"])
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    tokenizer = load_model(args.target).tokenizer
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = {"tokenizer": getattr(tokenizer, "name_or_path", args.target), "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
              "corpus": Path(args.corpus).name, "answers": str(sum(r["split"] == "train" for r in records)),
              "tokens": str(sum(counts.values()))}
    save_file({"ids": np.array(ranked, np.int32), "counts": np.array([counts[t] for t in ranked], np.int64)},
              str(out / "ranks.safetensors"), metadata=header)
    print(f"{out / 'ranks.safetensors'}: {len(ranked)} ids ranked from {header['tokens']} answer tokens "
          f"of {header['answers']} answers")


if __name__ == "__main__":
    main()
