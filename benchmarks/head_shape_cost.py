"""What an EAGLE-3 head's shape costs per drafted token: the draft vocabulary and the MLP width, side by side.

For each shape a head for the default target is made (the target's own LM head rows for the N ids most frequent
in a corpus's training answers, the rest random: the cost does not depend on the weights), drafts K = 4 chains
on the native kernels for a few prompts, and its milliseconds per drafted token are read from the run's
statistics, beside the target's milliseconds per pass. With --corpus, also each vocabulary's coverage: the share
of the corpus's held-out answer tokens it contains (a draft token outside the vocabulary is never proposed, so
coverage bounds the first draft's agreement).

    python benchmarks/head_shape_cost.py --corpus artifacts/corpus-qwen2.5-coder-1.5b \
        --vocabs 4096,8192,16384,32768 --intermediates 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import Counter
from pathlib import Path

import torch

from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.head_training.eagle3_train import EagleTrainConfig, aux_layers_for, new_head
from verispec.models.heads.shipped import final_norm, lm_head_rows

PROMPTS = ["Write a Python function that merges two sorted lists and explain how it works.",
           "Summarize the causes of the French Revolution in a short paragraph.",
           "What is the derivative of x^3 sin(x)? Show the steps."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=None)
    ap.add_argument("--vocabs", default="4096,8192,16384,32768")
    ap.add_argument("--intermediates", default="2048")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    plain = SpeculativeDecoder.load(draft="none")
    runner = plain.runner
    counts, held = Counter(), []
    if args.corpus is not None:
        from verispec.head_training.corpus import read_corpus

        _, records = read_corpus(args.corpus)
        for r in records:
            (counts.update(r["answer"]) if r["split"] == "train" else held.extend(r["answer"]))
    ranked = [t for t, _ in counts.most_common()]
    seen = set(ranked)
    ranked += [t for t in range(runner.vocab_size) if t not in seen]
    aux = aux_layers_for(runner)
    rows = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        ids = torch.tensor(sorted(ranked[:vocab]), dtype=torch.long)
        vocabulary = set(ids.tolist())
        coverage = round(sum(t in vocabulary for t in held) / len(held), 4) if held else None
        for intermediate in (int(i) for i in args.intermediates.split(",")):
            config = EagleTrainConfig(draft_vocab=vocab, intermediate=intermediate)
            head = new_head(runner, config, aux, ids, lm_head_rows(runner, ids), final_norm(runner))
            with tempfile.TemporaryDirectory() as folder:
                head.save(folder)
                decoder = SpeculativeDecoder(plain.target, f"eagle:{folder}")  # its own runner, the head on it
                draft_ms, target_ms = [], []
                for _ in range(args.repeats):
                    for prompt in PROMPTS:
                        s = decoder.generate(prompt, SamplingConfig(temperature=0.0),
                                             SpecConfig(num_draft_tokens=4, max_new_tokens=args.tokens)).stats
                        draft_ms.append(1000 * s.draft_seconds / max(1, s.draft_tokens))
                        target_ms.append(1000 * s.target_seconds / max(1, s.target_forward_passes))
            row = {"draft_vocab": vocab, "intermediate": intermediate, "coverage": coverage,
                   "ms_per_drafted_token": round(statistics.median(draft_ms), 3),
                   "ms_per_target_pass": round(statistics.median(target_ms), 2),
                   "params_millions": round(sum(p.numel() for p in head.parameters()) / 1e6, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
