"""Prefix reuse across requests (`verispec.core.prefix`): on the native runner a conversation decoded with its earlier
turns' cache reused gives the same bits as without (greedy and seeded sampled, tokens and logprobs), rows that join a
running batch reuse a shared prefix, the store stays within its budget, and it is used only where it is exact; the
server reports it (usage, /metrics)."""

import dataclasses

import httpx
import pytest
import torch

from conftest import tiny_model
from tiny_gguf import T, gguf_from_hf
from verispec.batch import DecodeBatch
from verispec.config import SamplingConfig, SpecConfig
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.engine import SpeculativeEngine
from verispec.models.gguf.model import load_gguf
from verispec.models.gguf.runner import NativeRunner
from verispec.models.runners.hf import ModelRunner
from verispec.core.prefix import PrefixStore

V = 64
SYSTEM = [(7 * i + 3) % V for i in range(30)]  # a long shared beginning


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", vocab=V, seed=0, sharpness=3.0)


@pytest.fixture(scope="module")
def native(model, tmp_path_factory):
    return NativeRunner(load_gguf(gguf_from_hf(model, tmp_path_factory.mktemp("prefix") / "t.gguf", T.Q8_0),
                                  show_progress=False))


def conversation(engine, sampling, spec, seed=None):
    """Three turns, each prompt the last prompt and answer and a new user turn."""
    prompt, turns = SYSTEM + [1, 2, 3], []
    for turn in range(3):
        seq = engine.generate([prompt], sampling, spec, seeds=None if seed is None else seed + turn)[0]
        turns.append(seq)
        prompt = seq.tokens + [5, 6, turn]
    return turns


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.9, top_k=20)],
                         ids=["greedy", "sampled"])
def test_a_conversation_with_reuse_is_the_same_bits_as_without(native, sampling):
    spec = SpecConfig(max_new_tokens=12, num_draft_tokens=3, logprobs=2, stop_at_eos=False)
    cold = conversation(SpeculativeEngine(native, PromptLookupDrafter(), set()), sampling, spec, seed=4)
    engine = SpeculativeEngine(native, PromptLookupDrafter(), set())
    engine.prefixes = PrefixStore(1 << 30)
    warm = conversation(engine, sampling, spec, seed=4)
    assert [s.generated for s in warm] == [s.generated for s in cold]
    assert [[(e.token, e.logprob, e.top) for e in s.logprobs] for s in warm] == \
        [[(e.token, e.logprob, e.top) for e in s.logprobs] for s in cold]
    assert warm[0].stats.cached_tokens == 0
    for before, seq in zip(warm, warm[1:]):  # each turn reuses the last turn's prompt and answer, less its last token
        assert seq.stats.cached_tokens == len(before.tokens) - 1
    stats = engine.prefixes.stats
    assert stats.hits == 2 and stats.tokens_reused == sum(s.stats.cached_tokens for s in warm)
    assert stats.entries == 1  # each turn's entry covers the one before


def test_a_row_joining_a_running_batch_reuses_the_prompt_it_shares(native):
    greedy, spec = SamplingConfig(temperature=0), SpecConfig(max_new_tokens=10, stop_at_eos=False)
    prompts = [SYSTEM + [1, 2], SYSTEM + [9, 9, 9]]
    alone = [SpeculativeEngine(native, None, set()).generate([p], greedy, spec)[0].generated for p in prompts]
    engine = SpeculativeEngine(native, None, set())
    engine.prefixes = PrefixStore(1 << 30)
    batch = DecodeBatch(engine, prefill_chunk=8)
    first = engine.make_sequences([prompts[0]], greedy, spec, None)[0]
    batch.add([first])
    while first.num_generated == 0:
        engine.step(batch)  # the first row reads its prompt in chunks, then keeps it
    second = engine.make_sequences([prompts[1]], greedy, spec, None)[0]
    batch.add([second])
    while batch:
        engine.step(batch)
    assert second.stats.cached_tokens == len(SYSTEM)  # where the two prompts part
    assert [first.generated, second.generated] == alone


def test_the_store_keeps_to_its_budget_least_recently_used_out_first(native):
    greedy, spec = SamplingConfig(temperature=0), SpecConfig(max_new_tokens=4, stop_at_eos=False)
    engine = SpeculativeEngine(native, None, set())
    per_token = native.cache_bytes(1) // native.initial_capacity  # keys and values of one position
    engine.prefixes = PrefixStore(per_token * 80)
    for start in range(4):
        engine.generate([[start] * 20 + SYSTEM], greedy, spec)
    stats = engine.prefixes.stats
    assert stats.held_bytes <= per_token * 80 and stats.evicted >= 2 and stats.entries <= 2
    kept = engine.generate([[3] * 20 + SYSTEM], greedy, spec)[0]  # the newest entry is still there
    assert kept.stats.cached_tokens == 20 + len(SYSTEM) - 1


def test_reuse_is_used_only_where_it_is_exact(model, native):
    greedy, spec = SamplingConfig(temperature=0), SpecConfig(max_new_tokens=4)
    torch_engine = SpeculativeEngine(ModelRunner(model), None, set())  # the torch runner: not the same bits
    torch_engine.prefixes = PrefixStore(1 << 30)
    for _ in range(2):
        seq = torch_engine.generate([SYSTEM], greedy, spec)[0]
    assert seq.stats.cached_tokens == 0 and torch_engine.prefixes.stats.lookups == 0

    class ReadsThePass(PromptLookupDrafter):  # a drafter that needs the prompt's own pass, every position of it
        traits = dataclasses.replace(PromptLookupDrafter.traits, follows_prefixes=False)

    engine = SpeculativeEngine(native, ReadsThePass(), set())
    engine.prefixes = PrefixStore(1 << 30)
    for _ in range(2):
        seq = engine.generate([SYSTEM], greedy, spec)[0]
    assert seq.stats.cached_tokens == 0


def test_the_server_reports_cached_tokens_and_its_store(model, native, tmp_path):
    from tiny_hf import save_tiny_model_dir
    from verispec import SpeculativeDecoder
    from verispec.serve.config import ServeConfig
    from verispec.serve.server import BackgroundServer

    folder = save_tiny_model_dir(tmp_path / "target", "qwen2", seed=0)
    decoder = SpeculativeDecoder.load(str(folder), "ngram")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder))
    decoder.runner = decoder.engine.target = NativeRunner(load_gguf(gguf_from_hf(hf, tmp_path / "t.gguf", T.Q8_0),
                                                                    show_progress=False))
    text = "abc " * 20
    with BackgroundServer(decoder, ServeConfig(port=0, served_model_name="tiny")) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"prompt": text, "max_tokens": 8, "temperature": 0}
        first = http.post("/v1/completions", json=body).json()
        again = http.post("/v1/completions", json={**body, "prompt": text + first["choices"][0]["text"] + "d"}).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
        metrics = http.get("/metrics").text
        assert "verispec_prefix_hits 1.0" in metrics and "verispec_prefix_held_bytes" in metrics


def test_a_requests_n_choices_read_their_prompt_once(model, native, tmp_path):
    """n choices share one prompt: the first reads it, the others join once it is kept and start from its cache (each
    reads only its last token); every choice is still the request with seed + i alone."""
    from tiny_hf import save_tiny_model_dir
    from verispec import SpeculativeDecoder
    from verispec.serve.config import ServeConfig
    from verispec.serve.server import BackgroundServer

    folder = save_tiny_model_dir(tmp_path / "target", "qwen2", seed=0)
    decoder = SpeculativeDecoder.load(str(folder), "ngram")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder))
    decoder.runner = decoder.engine.target = NativeRunner(load_gguf(gguf_from_hf(hf, tmp_path / "t.gguf", T.Q8_0),
                                                                    show_progress=False))
    body = {"prompt": "the n choices of one prompt " * 3, "max_tokens": 8, "temperature": 1.0, "seed": 7,
            "speculative": {"K": 3}}
    with BackgroundServer(decoder, ServeConfig(port=0, served_model_name="tiny")) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        together = http.post("/v1/completions", json={**body, "n": 3}).json()
        prompt = together["usage"]["prompt_tokens"]
        assert together["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * (prompt - 1)
        alone = [http.post("/v1/completions", json={**body, "seed": 7 + i}).json()["choices"][0]["text"]
                 for i in range(3)]
    assert [c["text"] for c in together["choices"]] == alone


def test_a_draft_models_cache_follows_the_reused_prefixes(model, native, tmp_path):
    """A draft model on the native runner keeps its finished rows' cache in a store of its own: each later turn's draft
    row starts from the last turn's (it reads only what is new), and the answers are the same bits as without."""
    from conftest import noisy_copy
    from verispec.drafters.draft_model import DraftModelDrafter

    draft_runner = NativeRunner(load_gguf(gguf_from_hf(noisy_copy(model, 0.5, seed=2), tmp_path / "d.gguf", T.Q8_0),
                                          show_progress=False))
    spec = SpecConfig(max_new_tokens=12, num_draft_tokens=3, stop_at_eos=False)
    sampling = SamplingConfig(temperature=0.9, top_k=20)
    cold = conversation(SpeculativeEngine(native, DraftModelDrafter(draft_runner, V), set()), sampling, spec, seed=4)
    drafter = DraftModelDrafter(draft_runner, V)
    engine = SpeculativeEngine(native, drafter, set())
    engine.prefixes = PrefixStore(1 << 30)
    drafter.reuse_prefixes(1 << 30)
    warm = conversation(engine, sampling, spec, seed=4)
    assert [s.generated for s in warm] == [s.generated for s in cold]
    stats = drafter.prefixes.stats
    # the draft's cache ends at most K tokens short of its row's (drafts it never fed, the last token)
    assert stats.hits == 2 and sum(len(s.tokens) - 1 - spec.num_draft_tokens for s in warm[:2]) <= \
        stats.tokens_reused <= sum(len(s.tokens) - 1 for s in warm[:2])
    assert sum(s.stats.draft_tokens for s in warm) > 0


def test_a_drafters_optional_take_or_keep_that_fails_logs_one_line_and_takes_nothing(native, caplog):
    """`try_take` / `try_keep` (a drafter's own store, where reuse is optional): a state that cannot copy rows costs the
    reuse only, with a warning naming the drafter."""
    store, state = PrefixStore(1 << 30), native.new_state(1)
    native.forward(state, [SYSTEM], [1])
    store.keep(state, 0, SYSTEM)

    class Broken:
        def write_prefix(self, row, prefix):
            raise RuntimeError("no room")

        def read_prefix(self, row, n):
            raise RuntimeError("no room")

    with caplog.at_level("WARNING", logger="verispec.prefix"):
        assert store.try_take(Broken(), 0, SYSTEM + [1], "the test draft") == 0
        store.try_keep(Broken(), 0, SYSTEM + [1, 2], "the test draft")
    assert [r.getMessage() for r in caplog.records] == ["the test draft reused no prefix (RuntimeError: no room)",
                                                        "the test draft kept no prefix (RuntimeError: no room)"]
    assert store.try_take(native.new_state(1), 0, SYSTEM + [1], "the test draft") == len(SYSTEM)
