"""The GPU measurements: random-weight models of real sizes, a draft that agrees with them by construction, and
verispec against Hugging Face on the same GPU, same pair, same acceptance (the ratio is the engine's).

    python benchmarks/gpu_bench.py --out $OUT/gpu                       # on the GPU machine: 1.5B and 8B
    python benchmarks/gpu_bench.py --sizes 1.5b,8b,14b --out $OUT/gpu   # all three (14B: about 28 GB in bfloat16)
    .venv/bin/python benchmarks/gpu_bench.py --sizes tiny --device cpu --tokens 16 --out /tmp/gpu  # a dry run here

No real weights reach the GPU machine, so the models are built from the shapes of Qwen2.5-1.5B, Llama-3-8B and
Qwen2.5-14B with random weights. The draft is the target's first `--draft-layers` layers with its embedding, final
norm and LM head; the target's later layers have their output projections (attention o_proj, MLP down_proj) scaled
by `--scale`, so they move the hidden state little and the draft agrees with the target often, while the target
still reads every weight (its pass costs what a real model's does). The run measures the acceptance it gets.

For each size: the HBM copy bandwidth (a 1 GiB device-to-device copy), plain decoding on verispec's static-cache
runner (tokens/s and the weight bytes it streams per second, as a share of that bandwidth), pass costs v(k) for
k = 1..16 (a pass over k tokens after a 512-token context, relative to one token), then greedy and temperature-0.7
decoding, batch 1: Hugging Face `generate` (target alone), HF assisted generation (the same draft), verispec
(the same draft, K = --k), and verispec's tokens/s per request at batch 1, 2, 4 and 8 (the server's engine,
continuous batching). Writes gpu_bench.json and plots under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

SHAPES = {  # (hidden, layers, heads, kv heads, intermediate, vocab, architecture)
    "tiny": (64, 4, 4, 2, 128, 512, "qwen2"),
    "1.5b": (1536, 28, 12, 2, 8960, 151936, "qwen2"),
    "8b": (4096, 32, 32, 8, 14336, 128256, "llama"),
    "14b": (5120, 48, 40, 8, 13824, 152064, "qwen2"),
}


def build_pair(size: str, draft_layers: int, scale: float, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random target of this shape and its draft (the first draft_layers layers, sharing its weights' values)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden, layers, heads, kv, inter, vocab, arch = SHAPES[size]
    config = AutoConfig.for_model(arch, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                  num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                                  max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    draft_config = copy.deepcopy(config)
    draft_config.num_hidden_layers = draft_layers
    with torch.device(device):
        draft = AutoModelForCausalLM.from_config(draft_config, dtype=dtype).eval()
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("model.layers.") or int(k.split(".")[2]) < draft_layers})
    for model in (target, draft):
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    return target, draft


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write), best of 5."""
    size = (1 << 30) if device.type == "cuda" else (1 << 26)
    a, b = torch.empty(size, dtype=torch.uint8, device=device), torch.empty(size, dtype=torch.uint8, device=device)
    b.copy_(a)
    best = min(timed(lambda: b.copy_(a), device) for _ in range(5))
    return 2 * size / best / 1e9


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def pass_costs(runner, device, context: int = 512, widths=range(1, 17), repeats: int = 7) -> dict:
    """Seconds of a pass over k tokens after `context` tokens (median of repeats), and v(k) relative to k = 1."""
    costs = {}
    for k in widths:
        times = []
        for _ in range(repeats + 1):
            state = runner.new_state(1)
            runner.forward(state, [[1 + i % 97 for i in range(context)]], [1])
            times.append(timed(lambda: runner.forward(state, [[7 + i for i in range(k)]], [k]), device))
        costs[k] = statistics.median(times[1:])
    return {"seconds": costs, "v": {k: costs[k] / costs[1] for k in costs}}


def hf_run(target, prompt, tokens, sampling, draft=None, seed=0, tokens_out=False) -> dict:
    ids = torch.tensor([prompt], device=target.device)
    kwargs = {"do_sample": False} if sampling.greedy else {"do_sample": True, "temperature": sampling.temperature,
                                                          "top_k": None}
    if draft is not None:
        kwargs["assistant_model"] = draft
    torch.manual_seed(seed)
    out = []
    seconds = timed(lambda: out.append(target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                                       min_new_tokens=tokens, **kwargs)), target.device)
    row = {"seconds": seconds, "tokens": int(out[0].shape[1] - len(prompt))}
    if tokens_out:
        row["ids"] = out[0][0, len(prompt):].tolist()
    return row


def verispec_run(engine, prompts, tokens, sampling, k, seed=0, tokens_out=False) -> dict:
    from verispec.config import SpecConfig
    from verispec.stats import GenerationStats

    spec = SpecConfig(num_draft_tokens=k, max_new_tokens=tokens, stop_at_eos=False)
    seqs = []
    seconds = timed(lambda: seqs.extend(engine.generate(prompts, sampling, spec, seeds=seed)), engine.target.device
                    if hasattr(engine.target, "device") else torch.device("cpu"))
    merged = GenerationStats.merge([s.stats for s in seqs])
    row = {"seconds": seconds, "tokens": sum(len(s.generated) for s in seqs), "requests": len(prompts),
           "acceptance_rate": merged.acceptance_rate, "tokens_per_target_pass": merged.tokens_per_target_pass}
    if tokens_out:
        row["ids"] = list(seqs[0].generated)
    return row


def equal_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two outputs share from their start."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(size: str, args, device: torch.device, result: dict, save) -> dict:
    """Fill `result` phase by phase, calling save() after each (a run cut short keeps what it measured)."""
    from verispec.config import SamplingConfig
    from verispec.drafters.draft_model import DraftModelDrafter
    from verispec.engine import SpeculativeEngine
    from verispec.models.runners.static import StaticRunner

    clock = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        result.setdefault("phase_seconds", {})[name] = round(now - clock, 2)
        clock = now
        save()
        print(f"  {size} {name}: {result['phase_seconds'][name]:.1f} s", flush=True)

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, draft = build_pair(size, args.draft_layers, args.scale, device, dtype)
    compile_ = not args.no_compile
    runner = StaticRunner(target, capacity=2048, compile=compile_, backend=args.backend)
    draft_runner = StaticRunner(draft, capacity=2048, compile=compile_, backend=args.backend)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(8)]
    result.update({"size": size, "weight_bytes": weight_bytes(target), "draft_weight_bytes": weight_bytes(draft)})
    phase("build")
    plain = SpeculativeEngine(runner, None, set())
    verispec_run(plain, prompts[:1], 16, SamplingConfig(temperature=0), 1)  # compile the one-token pass first
    phase("plain warm-up (compile)")
    run = verispec_run(plain, prompts[:1], args.tokens, SamplingConfig(temperature=0), 1, tokens_out=True)
    plain_ids = run.pop("ids")
    result["plain_tokens_per_second"] = run["tokens"] / run["seconds"]
    result["plain_streamed_gb_per_second"] = result["weight_bytes"] * result["plain_tokens_per_second"] / 1e9
    phase("plain")
    result["pass_costs"] = pass_costs(runner, device, widths=range(1, args.max_width + 1))
    phase("pass costs")
    engine = SpeculativeEngine(runner, DraftModelDrafter(draft_runner, vocab), set())
    modes = {"greedy": SamplingConfig(temperature=0), "t0.7": SamplingConfig(temperature=0.7)}
    for name in args.modes.split(","):
        sampling = modes[name]
        # warm-up as long as the measured run, so every width it reaches is compiled before the clock starts
        verispec_run(engine, prompts[:1], args.tokens, sampling, args.k)
        hf_run(target, prompts[0], 8, sampling)
        hf_run(target, prompts[0], 8, sampling, draft)
        phase(f"{name} warm-up")
        rows = result[name] = {}
        rows["verispec"] = verispec_run(engine, prompts[:1], args.tokens, sampling, args.k, tokens_out=True)
        rows["hf-generate"] = hf_run(target, prompts[0], args.tokens, sampling, tokens_out=True)
        rows["hf-assisted"] = hf_run(target, prompts[0], args.tokens, sampling, draft)
        for row in rows.values():
            row["tokens_per_second"] = row["tokens"] / row["seconds"]
        if sampling.greedy:  # bfloat16 on other kernels may break a near-tie: reported, not asserted
            a, b = rows["verispec"].pop("ids"), rows["hf-generate"].pop("ids")
            rows["greedy_equal_prefix"] = equal_prefix(a, b)  # with HF generate (another cache, other kernels)
            rows["greedy_equal_prefix_vs_plain"] = equal_prefix(a, plain_ids)  # with this runner's plain decoding
        for row in rows.values():
            if isinstance(row, dict):
                row.pop("ids", None)
        phase(name)
        rows["batches"] = {}
        for batch in (int(b) for b in args.batches.split(",") if b):
            verispec_run(engine, prompts[:batch], args.tokens, sampling, args.k)  # compile this batch's widths
            b = verispec_run(engine, prompts[:batch], args.tokens, sampling, args.k)
            rows["batches"][batch] = {**b, "tokens_per_second_per_request": b["tokens"] / b["seconds"] / batch}
            phase(f"{name} batch {batch}")
    del target, draft, runner, draft_runner, engine, plain
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def plot(report: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in report["results"]:
        v = r["pass_costs"]["v"]
        ax.plot([int(k) for k in v], list(v.values()), "o-", label=r["size"])
    ax.set_xlabel("tokens in the pass (k)")
    ax.set_ylabel("v(k): pass cost / one-token pass")
    ax.set_title(f"pass costs on {report['device_name']}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "pass_costs.png", dpi=120)
    paths.append(str(out / "pass_costs.png"))
    modes = [m for m in ("greedy", "t0.7") if all(m in r for r in report["results"])]
    fig, axes = plt.subplots(1, max(1, len(modes)), figsize=(5 * max(1, len(modes)), 4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, mode in zip(axes, modes):
        names = ["hf-generate", "hf-assisted", "verispec"]
        for i, r in enumerate(report["results"]):
            ax.bar([j + 0.25 * i for j in range(3)], [r[mode][n]["tokens_per_second"] for n in names], 0.25,
                   label=r["size"])
        ax.set_xticks([j + 0.25 for j in range(3)], names)
        ax.set_title(mode)
    axes[0].set_ylabel("tokens/s, batch 1")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "speed.png", dpi=120)
    paths.append(str(out / "speed.png"))
    plt.close("all")
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1.5b,8b", help=f"comma-separated, of {', '.join(SHAPES)} (default: %(default)s)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request (default: %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=4, help="draft tokens per step (default: %(default)s)")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.05, help="the target's later layers' output projections, scaled")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend: inductor or cudagraphs")
    ap.add_argument("--modes", default="greedy,t0.7", help="sampling modes (default: %(default)s)")
    ap.add_argument("--batches", default="1,2,4,8", help="batch sizes of the batch sweep, '' for none")
    ap.add_argument("--max-width", type=int, default=16, help="v(k) for k = 1 .. this (default: %(default)s)")
    ap.add_argument("--out", default="artifacts/gpu_bench")
    args = ap.parse_args()
    from verispec.models.device import resolve_device

    device = resolve_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
              "torch": torch.__version__, "copy_bandwidth_gb_per_second": copy_bandwidth(device), "results": []}
    print(f"{report['device_name']}: copy bandwidth {report['copy_bandwidth_gb_per_second']:.0f} GB/s", flush=True)

    def save() -> None:
        (out / "gpu_bench.json").write_text(json.dumps(report, indent=1))

    for size in args.sizes.split(","):
        result: dict = {}
        report["results"].append(result)
        measure(size.strip(), args, device, result, save)
        share = result["plain_streamed_gb_per_second"] / report["copy_bandwidth_gb_per_second"]
        print(f"{size}: plain {result['plain_tokens_per_second']:.1f} tok/s ({share:.0%} of copy bandwidth); "
              f"v(k) {[round(v, 2) for v in result['pass_costs']['v'].values()]}", flush=True)
        for mode in args.modes.split(","):
            g = result[mode]
            print(f"  {mode}: verispec {g['verispec']['tokens_per_second']:.1f} tok/s (acceptance "
                  f"{g['verispec']['acceptance_rate']:.2f}, {g['verispec']['tokens_per_target_pass']:.2f} tokens/pass), "
                  f"HF assisted {g['hf-assisted']['tokens_per_second']:.1f}, HF generate "
                  f"{g['hf-generate']['tokens_per_second']:.1f}; batches "
                  f"{ {b: round(r['tokens_per_second_per_request'], 1) for b, r in g['batches'].items()} }", flush=True)
        save()
    report["plots"] = plot(report, out)
    (out / "gpu_bench.json").write_text(json.dumps(report, indent=1))
    print(f"written: {out / 'gpu_bench.json'}, " + ", ".join(Path(p).name for p in report["plots"]))


if __name__ == "__main__":
    main()
