"""Turning bench runs into numbers: per category and overall, medians over prompts, ratios per prompt."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from verispec.bench.systems import Run
from verispec.stats import GenerationStats

# what speedups are measured against, where they ran: verispec's own plain decoding (on torch, and on
# llama.cpp's kernels), the Hugging Face peers, and llama.cpp's own decoding alone and with its prompt lookup
BASELINES = ("verispec-plain", "verispec-llamacpp-plain", "hf-generate", "hf-assisted", "llamacpp-generate", "llamacpp-prompt-lookup")
# a peer's best speculative setting, chosen from what ran: its speculative systems (a name, or a name with
# "-k<K>" when `peer_num_draft_tokens` swept K) whose median decoding rate over all prompts is highest;
# a baseline of its own where two or more ran
BEST_SPECULATIVE = {"llamacpp-best-speculative": ("llamacpp-prompt-lookup", "llamacpp-draft-model"),
                    "hf-best-speculative": ("hf-assisted", "hf-prompt-lookup")}
# (median key, speedup key, rate of a Run or None): end to end, and after the first output (decoding only)
RATES = (("median_tokens_per_second", "speedup", lambda run: run.tokens_per_second),
         ("median_decode_tokens_per_second", "decode_speedup", lambda run: run.decode_tokens_per_second))


@dataclass
class Record:
    system: str
    question_id: int
    category: str
    run: Run


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _rate(run: Run) -> float | None:
    """What a best setting is chosen by: decoding tok/s after the first output, else end to end."""
    return run.decode_tokens_per_second if run.decode_tokens_per_second is not None else run.tokens_per_second


def best_speculative(records: list[Record]) -> dict[str, str]:
    """Per peer (a BEST_SPECULATIVE key), its speculative system with the highest median rate over all
    prompts, where two or more of them ran."""
    best = {}
    for alias, families in BEST_SPECULATIVE.items():
        rates = {}
        for system in dict.fromkeys(r.system for r in records):
            if any(system == f or system.startswith(f + "-k") for f in families):
                rates[system] = _median([x for r in records if r.system == system and (x := _rate(r.run)) is not None])
        rates = {s: x for s, x in rates.items() if x is not None}
        if len(rates) >= 2:
            best[alias] = max(rates, key=rates.__getitem__)
    return best


def greedy_reference(system: str, systems: list[str], reference: str = "verispec-plain") -> str:
    """The plain decoding a system's greedy output is compared with: llama.cpp's own loop for the other
    systems on llama.cpp's kernels where it ran (the same kernels; their logits, not torch's, decide near
    ties), else `reference` (llama.cpp's own loop too: the two implementations of the target compared)."""
    on_llamacpp = "llamacpp" in system and system != "llamacpp-generate"
    return "llamacpp-generate" if on_llamacpp and "llamacpp-generate" in systems else reference


def summarize(records: list[Record], greedy: bool, reference: str = "verispec-plain") -> dict:
    """Per system, per category (and "all"): medians, speedups, acceptance, time split, equality."""
    by_prompt: dict[tuple[str, int], Record] = {(r.system, r.question_id): r for r in records}
    best = best_speculative(records)
    for alias, system in best.items():  # the best setting's runs, under the peer's alias too
        by_prompt.update({(alias, r.question_id): r for r in records if r.system == system})
    systems = list(dict.fromkeys(r.system for r in records))
    categories = list(dict.fromkeys(r.category for r in records))
    summary: dict = {}
    for system in systems:
        summary[system] = {}
        for category in categories + ["all"]:
            rows = [r for r in records if r.system == system and (category == "all" or r.category == category)]
            if not rows:
                continue
            entry: dict = {"prompts": len(rows), "faults": sum(len(r.run.faults) for r in rows)}
            for median_key, speedup_key, rate in RATES:  # end to end, then decoding only
                entry[median_key] = _median([x for r in rows if (x := rate(r.run)) is not None])
                entry[speedup_key] = {}
                for base in (*BASELINES, *best):
                    ratios = [x / y for r in rows if (b := by_prompt.get((base, r.question_id)))
                              and (x := rate(r.run)) is not None and (y := rate(b.run))]
                    if ratios and base != system and best.get(base) != system:
                        entry[speedup_key][base] = _median(ratios)
            stats = [r.run.stats for r in rows if r.run.stats is not None]
            if stats:
                merged = GenerationStats.merge(stats)
                wall = sum(s.wall_seconds for s in stats)
                draft = sum(s.draft_seconds for s in stats)
                target = sum(s.target_seconds for s in stats)
                entry.update(
                    acceptance_rate=merged.acceptance_rate,
                    tokens_per_target_pass=merged.tokens_per_target_pass,
                    mean_accepted_length=merged.mean_accepted_length,
                    accepted_per_position=[a / d if d else 0.0 for a, d in
                                           zip(merged.accepted_per_position, merged.drafted_per_position)],
                    time_split={"draft": draft / wall, "target": target / wall, "overhead": 1 - (draft + target) / wall}
                    if wall > 0 else None,
                )
            if greedy:
                base = greedy_reference(system, systems, reference)
                same = [r.run.token_ids == by_prompt[(base, r.question_id)].run.token_ids for r in rows
                        if (base, r.question_id) in by_prompt]
                if same:  # without a plain decoding in the run there is nothing to compare with
                    entry["greedy_equal_to_plain"] = f"{sum(same)}/{len(same)}"
                    entry["greedy_reference"] = base
            summary[system][category] = entry
    return summary


def markdown(summary: dict, categories: list[str], best: dict[str, str] | None = None,
             records: list[Record] | None = None) -> str:
    """Rows are systems, columns are categories: tok/s and speedups end to end, then after the first
    output (decoding only), then tokens per target pass, acceptance and time split. best: the peers'
    best speculative settings (`best_speculative`), baselines of their own. records: the runs, for a line on each
    system that absorbed faults (its count, and the first fault's line)."""
    lines = []
    header = "| system | " + " | ".join(categories + ["all"]) + " |"
    best = best or {}
    bases = [b for b in (*BASELINES, *best) if b in summary or b in best]  # the baselines that ran
    for title, rate, speedup in [
        (f"median tokens/s, end to end: prompt processing included (median per-prompt speedup vs {' / '.join(bases)})",
         "median_tokens_per_second", "speedup"),
        ("median decoding tokens/s, after the first output: prompt processing excluded (speedups as above)",
         "median_decode_tokens_per_second", "decode_speedup"),
    ]:
        lines += ([""] if lines else []) + [title, "", header, "|" + "---|" * (len(categories) + 2)]
        for system, cats in summary.items():
            cells = []
            for c in categories + ["all"]:
                e = cats.get(c)
                if not e or e.get(rate) is None:
                    cells.append("-")
                    continue
                sp = " / ".join(f"{e[speedup][b]:.2f}x" if b in e[speedup] else "-" for b in bases)
                cells.append(f"{e[rate]:.2f} ({sp})" if bases else f"{e[rate]:.2f}")
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
    lines += ["", "tokens per target pass (mean accepted length + 1; for trees, acceptance is per drafted node)", "",
              header, "|" + "---|" * (len(categories) + 2)]
    for system, cats in summary.items():
        if "tokens_per_target_pass" in cats.get("all", {}):
            cells = [f"{cats[c]['tokens_per_target_pass']:.2f}" if c in cats else "-" for c in categories + ["all"]]
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
    lines += ["", "| system | acceptance | tokens/target pass | time split draft/target/overhead | greedy = plain (which) |",
              "|---|---|---|---|---|"]
    for system, cats in summary.items():
        e = cats["all"]
        split = e.get("time_split")
        split_text = f"{split['draft']:.0%} / {split['target']:.0%} / {split['overhead']:.0%}" if split else "-"
        acc = f"{e['acceptance_rate']:.3f}" if "acceptance_rate" in e else "-"
        tpp = f"{e['tokens_per_target_pass']:.2f}" if "tokens_per_target_pass" in e else "-"
        same = f"{e['greedy_equal_to_plain']} ({e['greedy_reference']})" if "greedy_equal_to_plain" in e else "-"
        lines.append(f"| {system} | {acc} | {tpp} | {split_text} | {same} |")
    parted = [s for s, cats in summary.items() if cats["all"].get("greedy_reference") == "llamacpp-generate"
              and (n := cats["all"]["greedy_equal_to_plain"].split("/"))[0] != n[1]]
    if parted:
        lines += ["", f"greedy outputs that part from llamacpp-generate ({', '.join(parted)}): llama.cpp's quantized "
                      "kernels round a pass over several tokens differently from one-token passes, so a greedy run "
                      "that verifies several tokens at once can pick the other of two nearly tied tokens "
                      "(tests/test_llamacpp.py checks on a small model that each parting is such a near tie)"]
    for system in summary:
        runs = [r for r in records or () if r.system == system and r.run.faults]
        if runs:
            lines += ["", (f"**{system}: {sum(len(r.run.faults) for r in runs)} faults absorbed while decoding** (on "
                           f"{len(runs)} prompts, first: {runs[0].run.faults[0]}): the output stays exact, the speed "
                           "does not (a restarted drafter reads its prompt again); a bug to report")]
    for alias, system in best.items():
        lines += ["", f"{alias}: {system} (of the peer's speculative settings that ran, the highest median decoding "
                      f"tokens/s over all prompts: {summary[system]['all']['median_decode_tokens_per_second']:.2f})"]
    return "\n".join(lines)
