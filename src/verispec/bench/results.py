"""A bench's results on disk: bench.json (written after every prompt, so a run cut short keeps its
measurements), bench.md and the plots, and the same report rebuilt from a bench.json later
(`verispec bench --report PATH`)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from verispec.atomic import atomic_write_json, atomic_write_text
from verispec.bench.plots import plot_acceptance_by_position, plot_speedup
from verispec.bench.report import Record, best_speculative, markdown, summarize
from verispec.bench.systems import Run
from verispec.errors import VerispecError
from verispec.stats import GenerationStats

STATS_FIELDS = tuple(f.name for f in fields(GenerationStats))  # what a run's stats are rebuilt from


def runs_json(records: list[Record]) -> list[dict]:
    return [{"system": r.system, "question_id": r.question_id, "category": r.category,
             "new_tokens": len(r.run.token_ids), "token_ids": list(r.run.token_ids), "seconds": r.run.seconds,
             "first_output_seconds": r.run.first_seconds, "first_output_tokens": r.run.first_tokens,
             "decode_tokens_per_second": r.run.decode_tokens_per_second,
             "stats": _stats_json(r.run.stats), "faults": list(r.run.faults)} for r in records]


def _stats_json(stats: GenerationStats | None) -> dict | None:
    """The stats as `to_dict` shows them, with times unrounded so a report rebuilt from the file is the same."""
    if stats is None:
        return None
    return {**stats.to_dict(), **{k: getattr(stats, k) for k in ("wall_seconds", "draft_seconds", "target_seconds")}}


def _gguf_limit(head: dict, summary: dict) -> tuple[float | None, dict[str, float]]:
    """The bandwidth limit of the systems that read the GGUF's quantized weights (llama.cpp's, and verispec's
    on the native runner) and each one's median decoding rate as a fraction of it."""
    bandwidth, gguf_bytes = head.get("memory_bandwidth_gbs"), head.get("gguf_bytes_per_token")
    if not bandwidth or not gguf_bytes:
        return None, {}
    limit = bandwidth * 1e9 / gguf_bytes
    native = head.get("target_backend") == "native"  # then verispec's systems read the same quantized weights
    rates = {name: cats.get("all", {}).get("median_decode_tokens_per_second") for name, cats in summary.items()
             if "llamacpp" in name or (native and name.startswith("verispec-"))}
    return limit, {name: rate / limit for name, rate in rates.items() if rate}


def write_json(path: Path, report: dict) -> None:
    """Write through a temporary file of its own (`verispec.atomic`), so a reader (or a killed bench) never
    sees half a JSON file."""
    atomic_write_json(path, report, indent=2)


def write_report(out: Path, head: dict, records: list[Record], failures: list[dict], greedy: bool) -> dict:
    """Summarize `records`, write bench.json (complete, unless head says partial), bench.md and the plots.

    head: the config and the measured context (models, memory bandwidth, weight bytes per token).
    """
    categories = list(dict.fromkeys(r.category for r in records))
    summary = summarize(records, greedy=greedy)
    best = best_speculative(records)
    bandwidth, bytes_per_token = head.get("memory_bandwidth_gbs"), head.get("weight_bytes_per_token")
    limit = bandwidth * 1e9 / bytes_per_token if bandwidth and bytes_per_token else None
    # the limit bounds decoding: prompt processing (compute-bound, not a weight read per token) is left out
    plain = summary.get("verispec-plain", {}).get("all", {}).get("median_decode_tokens_per_second")
    gguf_limit, gguf_fractions = _gguf_limit(head, summary)
    report = {**head, "bandwidth_limit_tokens_per_second": limit,
              "plain_fraction_of_bandwidth_limit": plain / limit if plain and limit else None,
              "gguf_bandwidth_limit_tokens_per_second": gguf_limit, "fraction_of_gguf_bandwidth_limit": gguf_fractions,
              "best_speculative": best, "summary": summary, "runs": runs_json(records), "failures": failures}
    write_json(out / "bench.json", report)
    table = markdown(summary, categories, best, records)
    if head.get("partial"):
        table = (f"partial results: the bench ended before every prompt ran "
                 f"({len({r.question_id for r in records})} prompts)\n\n") + table
    if limit:
        table += (f"\n\nmemory bandwidth {bandwidth:.1f} GB/s, {bytes_per_token / 1e9:.2f} GB of weights per token: "
                  f"bandwidth limit {limit:.2f} tokens/s" + (f"; verispec-plain decodes at {plain:.2f} tokens/s after "
                                                            f"the first output, {plain / limit:.0%} of it" if plain else ""))
    if gguf_limit:
        table += (f"\n\nllama.cpp's kernels and the native runner read {head['gguf_bytes_per_token'] / 1e9:.2f} GB of quantized weights per token "
                  f"(the GGUF): bandwidth limit {gguf_limit:.2f} tokens/s; decoding after the first output reaches "
                  + ", ".join(f"{fraction:.0%} ({name})" for name, fraction in gguf_fractions.items()))
    if failures:
        table += "\n\nfailed runs (left out of the figures above):\n" + "\n".join(
            f"- {f['system']} on q{f['question_id']} ({f['category']}, {f['prompt_tokens']} prompt tokens): {f['error']}"
            for f in failures)
    atomic_write_text(out / "bench.md", table + "\n")
    report["markdown"] = table
    report["plots"] = [str(plot_speedup(summary, categories, out / "speedup_by_category.png")),
                       str(plot_acceptance_by_position(summary, out / "acceptance_by_position.png"))]
    if "llamacpp-best-speculative" in best:  # the bar: llama.cpp's best speculative setting
        report["plots"].append(str(plot_speedup(summary, categories, out / "speedup_vs_llamacpp_best.png",
                                                baseline="llamacpp-best-speculative", rate="decode_speedup")))
    return report


def report_from_json(path: str | Path, out_dir: str | Path | None = None) -> dict:
    """Rebuild tables and plots from a bench.json: a finished bench, or one cut short (partial).

    Greedy equality is checked only where the file holds token ids (benches since they were recorded).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        runs = data["runs"]
        greedy = float(data["config"]["temperature"]) == 0.0
    except FileNotFoundError:
        raise VerispecError(f"bench results not found: {path}") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise VerispecError(f"{path} is not a `verispec bench` bench.json ({type(err).__name__}: {err})") from None
    if not runs:
        raise VerispecError(f"{path} holds no runs yet: nothing to report")
    records = []
    for r in runs:
        stats = None
        if r.get("stats"):
            stats = GenerationStats(**{k: r["stats"][k] for k in STATS_FIELDS if k in r["stats"]})
        tokens = r.get("token_ids")
        greedy = greedy and tokens is not None
        run = Run(list(tokens) if tokens is not None else [0] * r["new_tokens"], r["seconds"], stats,
                  r.get("first_output_seconds", 0.0), r.get("first_output_tokens", 0), tuple(r.get("faults", ())))
        records.append(Record(r["system"], r["question_id"], r["category"], run))
    head = {k: v for k, v in data.items() if k not in ("summary", "runs", "failures", "markdown", "plots", "best_speculative")}
    out = Path(out_dir) if out_dir is not None else path.parent
    out.mkdir(parents=True, exist_ok=True)
    return write_report(out, head, records, data.get("failures", []), greedy)
