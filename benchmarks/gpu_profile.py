"""Where a GPU decode step's time and host syncs go: the layers of one plain-decoding token timed apart, host syncs
counted by the line of verispec that caused them, and torch's profiler over a few tokens.

    python benchmarks/gpu_profile.py --size 8b --out $OUT           # on the GPU machine
    .venv/bin/python benchmarks/gpu_profile.py --size tiny --device cpu --no-compile --out /tmp/prof  # dry run

Layers, each in ms per token (median of --tokens): the compiled step alone on device tensors made once (the floor
the runner can reach), `StaticRunner.forward` (adds the inputs built on the host and copied, the mask, the gather and
the LM head), and the engine's plain decoding (adds sampling, the host's decision and bookkeeping). The weights'
bytes over each time give the share of the copy bandwidth. Writes profile.json and profile_table.txt under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from collections import Counter
from pathlib import Path

import torch

from gpu_bench import build_pair, copy_bandwidth, timed, weight_bytes


def per_token(fn, device, tokens: int) -> float:
    return statistics.median(timed(fn, device) for _ in range(tokens)) * 1e3


def sync_sites(engine, prompt, sampling, spec) -> Counter:
    """Host syncs of one generate call, by the file and line that caused each."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.generate([prompt], sampling, spec)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="cudagraphs")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--no-compile", action="store_true", help="the runner's passes eagerly (a dry run here)")
    ap.add_argument("--out", default="artifacts/gpu_profile")
    args = ap.parse_args()
    from verispec.config import SamplingConfig, SpecConfig
    from verispec.drafters.draft_model import DraftModelDrafter
    from verispec.engine import SpeculativeEngine
    from verispec.models.runners.static import StaticRunner

    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, draft = build_pair(args.size, 2, 0.05, device, dtype)
    runner = StaticRunner(target, capacity=2048, compile=not args.no_compile, backend=args.backend)
    report = {"args": vars(args), "weight_bytes": weight_bytes(target), "copy_gb_per_second": copy_bandwidth(device)}
    greedy = SamplingConfig(temperature=0)
    spec = SpecConfig(num_draft_tokens=1, max_new_tokens=args.tokens, stop_at_eos=False)
    prompt = list(range(1, 65))
    plain = SpeculativeEngine(runner, None, set())
    plain.generate([prompt], greedy, spec)  # capture the one-token pass
    report["engine_plain_ms"] = timed(lambda: plain.generate([prompt], greedy, spec), device) * 1e3 / args.tokens
    state = runner.new_state(1)
    runner.forward(state, [prompt], [1])
    report["runner_forward_ms"] = per_token(lambda: runner.forward(state, [[5]], [1]), device, args.tokens)
    ids = torch.tensor([[5]], device=device)
    length = state.valid.shape[1]
    pos = torch.tensor([[length]], device=device)
    mask = runner._fit(torch.ones(1, 1, 1, length + 1, dtype=torch.bool)).to(device)
    kw = dict(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=state.cache, use_cache=True)
    with torch.inference_mode():
        runner._step(**kw)
        report["compiled_step_ms"] = per_token(lambda: runner._step(**kw), device, args.tokens)
        report["eager_step_ms"] = per_token(lambda: runner._base(**kw), device, 8)
    for key in ("compiled_step_ms", "runner_forward_ms", "engine_plain_ms"):
        gbs = report["weight_bytes"] / (report[key] / 1e3) / 1e9
        report[key.replace("_ms", "_bandwidth_share")] = gbs / report["copy_gb_per_second"]
    if device.type == "cuda":
        engine = SpeculativeEngine(runner, DraftModelDrafter(StaticRunner(draft, 2048, compile=not args.no_compile,
                                                                          backend=args.backend),
                                                             target.config.vocab_size), set())
        spec4 = SpecConfig(num_draft_tokens=4, max_new_tokens=args.tokens, stop_at_eos=False)
        engine.generate([prompt], greedy, spec4)
        passes = Counter()
        forward = StaticRunner._run

        def counting(self, *a, **k):
            passes[self is runner] += 1
            return forward(self, *a, **k)

        StaticRunner._run = counting
        try:
            report["sync_sites_speculative"] = sync_sites(engine, prompt, greedy, spec4).most_common(15)
        finally:
            StaticRunner._run = forward
        report["passes_target_draft"] = [passes[True], passes[False]]
        report["sync_sites_plain"] = sync_sites(plain, prompt, greedy, spec).most_common(15)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        plain.generate([prompt], greedy, SpecConfig(num_draft_tokens=1, max_new_tokens=8, stop_at_eos=False))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    (out / "profile_table.txt").write_text(table)
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(table)


if __name__ == "__main__":
    main()
