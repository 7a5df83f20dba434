"""An EAGLE-3 head on the bench's held-out prompts: acceptance while decoding beside agreement by prefill.

Decodes held-out Spec-Bench prompts greedily with the head alone (a chain of K drafts, lookup first off), which
gives the live acceptance by draft position and tau, and the target's greedy answers (the output is exactly
plain decoding's). Then one prefill pass over each prompt and answer gives the features and the target's
labels the training validation reads, and the head's agreement there (`heads.eagle3_train.validate`, K
unrolled steps). The two should agree: a gap means the head drafts from other inputs than it was trained and
validated on.

    python benchmarks/head_heldout.py --per-category 2 --max-new-tokens 96 [--head DIR] [--out FILE.json]

With --tree-budget N (a dynamic tree) or --temperature T the live figures only: tokens per target pass, and
acceptance by depth (for trees, how often the accepted path reached it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.datasets import HELDOUT, load_prompts
from verispec.head_training.eagle3_run import EmbeddingTable
from verispec.head_training.eagle3_train import EagleTrainConfig, prefill_samples, validate
from verispec.models.heads.eagle3_ttt import tau

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "spec_bench" / "question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--categories", default="coding,translation,summarization,qa,math_reasoning,rag",
                    help="comma-separated (default: %(default)s; coding is MT-Bench's coding questions)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--tree-budget", type=int, default=None, help="a dynamic tree of this many nodes, depth K")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling (seeded per prompt); 0 is greedy")
    ap.add_argument("--no-prefill", action="store_true", help="live figures only")
    ap.add_argument("--head", default=None, help="a head folder (default: the shipped head)")
    ap.add_argument("--lookup", action="store_true", help="keep the head's lookup first (default: the head alone)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    cats = args.categories.split(",")
    prompts = load_prompts(args.prompts, categories=cats, per_category=args.per_category, split=HELDOUT)
    decoder = SpeculativeDecoder.load(draft="eagle" if args.head is None else f"eagle:{args.head}")
    drafter = decoder.drafter
    if not args.lookup:
        drafter.lookup = None
    from verispec.config import TreeConfig

    tree = TreeConfig(budget=args.tree_budget) if args.tree_budget else None
    spec = SpecConfig(num_draft_tokens=args.k, max_new_tokens=args.max_new_tokens, tree=tree)
    sampling = SamplingConfig(temperature=args.temperature)
    by_cat: dict[str, dict] = {}
    for n, prompt in enumerate(prompts):
        ids = decoder.encode(prompt.text)
        result = decoder.generate(ids, sampling, spec, seed=n)
        s = result.stats
        row = by_cat.setdefault(prompt.category, {"live": [], "records": []})
        row["live"].append((s.accepted_per_position, s.drafted_per_position, s.new_tokens, s.target_forward_passes))
        row["records"].append({"prompt": ids, "answer": list(result.token_ids)})
    config = EagleTrainConfig(tokens=args.max_new_tokens, window=4096, ttt=args.k)
    head = drafter.source  # the head as trained (float32); drafting runs a copy on the native kernels
    report = {}
    for cat, row in by_cat.items():
        acc = [sum(a[i] if i < len(a) else 0 for a, _, _, _ in row["live"]) for i in range(args.k)]
        dr = [sum(d[i] if i < len(d) else 0 for _, d, _, _ in row["live"]) for i in range(args.k)]
        live = [round(a / d, 4) if d else 0.0 for a, d in zip(acc, dr)]
        conditional = [round(acc[i] / acc[i - 1], 4) if i and acc[i - 1] else (live[0] if not i else 0.0)
                       for i in range(args.k)]
        passes = sum(p - 1 for *_, p in row["live"])  # the steps after the prompt's pass (which gives one token)
        tokens = sum(n - 1 for _, _, n, _ in row["live"])
        row.update(tokens=tokens, passes=passes)
        report[cat] = {"live_accepted_by_position": live, "live_conditional": conditional,
                       "live_tokens_per_pass": round(tokens / max(passes, 1), 3), "live_tau_conditional": round(tau(conditional), 3)}
        if args.no_prefill or tree is not None or args.temperature > 0:  # prefill agreement is the greedy chain's
            print(json.dumps({cat: report[cat]}))
            continue
        samples = prefill_samples(decoder.runner, row["records"], config, tuple(head.config.aux_layers), show=False)
        val = validate(head, samples, EmbeddingTable(decoder.runner, samples), args.k, 1)
        report[cat].update(prefill_agreement=val["agreement"], prefill_tau=val["tau"])
        print(json.dumps({cat: report[cat]}))
    keys = [k for k in ("live_tokens_per_pass", "live_tau_conditional", "prefill_tau") if k in next(iter(report.values()))]
    rows = list(report.values())
    report["median"] = {key: round(statistics.median(r[key] for r in rows), 3) for key in keys}
    report["all"] = {"live_tokens_per_pass": round(sum(by_cat[c]["tokens"] for c in by_cat) /
                                                   max(1, sum(by_cat[c]["passes"] for c in by_cat)), 3)}
    print(json.dumps({"median": report["median"], "all": report["all"]}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
