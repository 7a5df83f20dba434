"""Corpus n-grams: counting, backoff and mixing with exact expected probabilities, the .ngram file
round trip and its tokenizer check, `verispec ngram build` errors, greedy equality with plain decoding
(alone and in ragged batches) and seeded chi-square tests of sampled drafts through the engine."""

import json

import numpy as np
import pytest
import torch
from conftest import tiny_model
from drafting import drafts_accepted
from test_exactness import PROMPT, THRESHOLD, V, check_distribution, sample_tokens
from tiny_hf import CHARS, char_tokenizer, save_tiny_model_dir

from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.cli import main
from verispec.config import NGramConfig, TreeConfig
from verispec.drafters.ngram_corpus import CorpusNGramDrafter, NGramModel
from verispec.drafters.registry import parse_draft
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.runners.hf import ModelRunner
from verispec.ngram.build import NGramBuildConfig, NGramCounter, build_table
from verispec.ngram.table import NGramCounts, NGramTable, context_hash, context_hashes

CORPUS_ONLY = NGramConfig(max_n=3, min_n=2, context_weight=0.0, adapted_weight=0.0)


def table_from(docs, vocab_size=16, **build) -> NGramTable:
    config = NGramBuildConfig(**{"max_n": 3, "min_count": 1, **build})
    counter = NGramCounter(config.max_n, vocab_size)
    for doc in docs:
        counter.add(np.asarray(doc, dtype=np.int64))
    return counter.table(config, vocab_size, {"tokenizer_sha256": "none"})


def as_dict(dist):
    ids, probs = dist
    return {t: pytest.approx(p) for t, p in zip(ids, probs)}


def test_window_hashes_equal_the_scalar_hash():
    tokens = np.array([5, 3, 9, 1, 5, 3, 9, 2], dtype=np.int64)
    for length in range(4):
        expected = [context_hash(tuple(tokens[i : i + length].tolist())) for i in range(tokens.size - length + 1)]
        assert [int(h) for h in context_hashes(tokens, length)] == expected


def test_counts_and_pruning():
    table = table_from([[1, 2, 3, 1, 2, 4, 1, 2, 3], [2, 3]])
    assert [t.tolist() for t in table.continuations((1, 2))] == [[3, 4], [2, 1]]
    assert [t.tolist() for t in table.continuations((2,))] == [[3, 4], [3, 1]]  # the second file adds 2 -> 3
    assert [t.tolist() for t in table.continuations(())] == [[2, 1, 3, 4], [4, 3, 3, 1]]
    assert table.continuations((4, 1))[0].size == 1 and table.continuations((9, 9))[0].size == 0
    assert table.continuations((3, 2))[0].size == 0  # n-grams never cross a file boundary
    pruned = table_from([[1, 2, 3, 1, 2, 4, 1, 2, 3]], min_count=2)
    assert pruned.continuations((1, 2))[0].tolist() == [3]  # 1 2 4 was seen once
    top1 = table_from([[1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 4, 1, 2, 4]], top_k=1)
    assert top1.continuations((1, 2))[0].tolist() == [4]  # the most frequent only


def test_backoff_and_mixing_probabilities():
    table = table_from([[1, 2, 3, 1, 2, 4, 1, 2, 3]])
    model = NGramModel(table, CORPUS_ONLY)
    assert as_dict(model.distribution([5, 1, 2])) == {3: 2 / 3, 4: 1 / 3}  # order 3: context (1, 2)
    assert as_dict(model.distribution([7, 2])) == {3: 2 / 3, 4: 1 / 3}  # (7, 2) unseen: back off to (2,)
    assert model.distribution([9]) is None  # nothing down to min_n = 2: no draft
    assert NGramModel(table, NGramConfig(max_n=3, min_n=1)).distribution([9]) is not None  # unigrams
    # Context counts (weight 3) mix with the corpus (weight 1), each normalized first.
    context = NGramCounts(3)
    context.add_stream([1, 2, 5, 1, 2])
    mixed = NGramModel(table, NGramConfig(max_n=3, corpus_weight=1, context_weight=3, adapted_weight=0))
    assert as_dict(mixed.distribution([1, 2], context)) == {5: 3 / 4, 3: 1 / 6, 4: 1 / 12}
    # Only the context has seen (2, 5): the longest order with any source wins.
    assert as_dict(mixed.distribution([2, 5], context)) == {1: 1.0}
    # Counts learned online (weight 3) after (1, 2), as a sampling target distribution.
    adapted = NGramModel(table, NGramConfig(max_n=3, corpus_weight=1, context_weight=0, adapted_weight=3))
    adapted.learn((8, 1, 2), (4, 6), (0.75, 0.25))
    assert as_dict(adapted.distribution([1, 2])) == {3: 1 / 6, 4: 1 / 12 + 9 / 16, 6: 3 / 16}
    assert as_dict(adapted.distribution([9, 2])) == {3: 1 / 6, 4: 1 / 12 + 9 / 16, 6: 3 / 16}  # order 2 learned too


def test_context_counts_grow_with_the_stream_and_recount_after_a_cut():
    counts = NGramCounts(3)
    counts.add_stream([1, 2, 3])
    counts.add_stream([1, 2, 3, 1, 2])
    assert counts.continuations((1, 2)) == {3: 1.0} and counts.continuations((2,)) == {3: 1.0}
    assert counts.continuations((3, 1)) == {2: 1.0}
    counts.add_stream([1, 2])  # shorter: the stream was cut, counts start again
    assert counts.continuations((1,)) == {2: 1.0} and counts.continuations((1, 2)) == {}


def test_candidates_rank_the_mixture():
    table = table_from([[1, 2, 3, 1, 2, 4, 1, 2, 3]])
    drafter = CorpusNGramDrafter(table, 16, CORPUS_ONLY)
    assert drafter.candidates([1, 2], 1) == [(3, pytest.approx(2 / 3))]
    assert [t for t, _ in drafter.candidates([1, 2], 5)] == [3, 4]
    assert drafter.candidates([9], 3) == []


def test_spec_names():
    is_corpus_spec = lambda text: parse_draft(text).kind == "ngram-corpus"  # noqa: E731
    assert is_corpus_spec("ngram-corpus") and is_corpus_spec("ngram-corpus:x/y.bin") and is_corpus_spec("t.ngram")
    assert not is_corpus_spec("ngram") and not is_corpus_spec("none") and not is_corpus_spec("model.gguf")


# --- files ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "src").mkdir()
    (root / "src" / "a.py").write_text("def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return a + b + c\n")
    (root / "notes.md").write_text("the cat sat on the mat. the cat sat on the hat.\n")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "skip.txt").write_text("zzzz zzzz zzzz")
    (root / "data.bin").write_bytes(b"\x00\x01")
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["qqq rrr", "qqq rrr"]}) + "\n")
    return root


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ngram_models")
    target = save_tiny_model_dir(root / "target", "llama", seed=0)
    other = save_tiny_model_dir(root / "other", "llama", seed=1, vocab_chars=list(reversed(CHARS)))
    return str(target), str(other)


def test_build_save_load_round_trip(corpus, tmp_path):
    tokenizer = char_tokenizer()
    table, summary = build_table(tokenizer, [corpus / "src", corpus / "notes.md", corpus / "prompts.jsonl"],
                                 NGramBuildConfig(max_n=4, min_count=1), tokenizer_name="chars", show_progress=False)
    assert summary["files"] == 3 and summary["tokens"] > 0 and summary["ngrams"] == table.num_ngrams
    size = table.save(tmp_path / "t.ngram")
    assert size == (tmp_path / "t.ngram").stat().st_size
    loaded = NGramTable.load(tmp_path / "t.ngram", tokenizer)
    assert loaded.max_n == 4 and loaded.vocab_size == len(tokenizer) and loaded.header["tokens"] == summary["tokens"]
    ids = lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    for context in (ids("the"), ids("ca"), ids("q"), ids("")):
        assert [a.tolist() for a in loaded.continuations(context)] == [a.tolist() for a in table.continuations(context)]
    assert loaded.continuations(ids("the"))[0].tolist() == list(ids(" "))
    assert loaded.continuations(ids("qqq"))[0].tolist() == list(ids(" "))  # from the JSONL strings
    # A directory is walked for its suffixes, skipping hidden folders.
    walked, _ = build_table(tokenizer, [corpus], NGramBuildConfig(min_count=1), show_progress=False)
    assert walked.continuations(ids("zzz"))[0].size == 0 and walked.continuations(ids("ca"))[0].size > 0


def test_table_for_another_tokenizer_is_refused(corpus, tmp_path):
    table, _ = build_table(char_tokenizer(), [corpus / "notes.md"], NGramBuildConfig(min_count=1), show_progress=False)
    table.save(tmp_path / "t.ngram")
    other = char_tokenizer(chars=list(reversed(CHARS)))
    with pytest.raises(VerispecError, match="another tokenizer"):
        NGramTable.load(tmp_path / "t.ngram", other)
    (tmp_path / "bad.ngram").write_text("not a table")
    with pytest.raises(VerispecError, match="not a readable n-gram table"):
        NGramTable.load(tmp_path / "bad.ngram")


def test_ngram_build_cli_and_its_errors(model_dirs, corpus, tmp_path, capsys):
    target, other = model_dirs
    out = tmp_path / "chars.ngram"
    assert main(["ngram", "build", "--tokenizer", target, "--corpus", str(corpus), "--out", str(out),
                 "--min-count", "1", "--max-n", "3"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {out}: 2 files")  # a.py, notes.md (not .bin, .jsonl or hidden)
    assert "n-grams kept (n = 1..3" in line and "MB" in line
    assert NGramTable.load(out).max_n == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "blank.txt").write_text("   \n")
    cases = [(["--corpus", str(tmp_path / "missing")], "corpus path not found"),
             (["--corpus", str(empty)], "no corpus files"),
             (["--corpus", str(tmp_path / "blank.txt")], "no text to count"),
             (["--corpus", str(corpus), "--max-n", "1"], "max_n must be an integer in 2..8"),
             (["--corpus", str(corpus), "--max-n", "9"], "max_n must be an integer in 2..8"),
             (["--corpus", str(corpus), "--min-count", "0"], "min_count must be"),
             (["--tokenizer", str(tmp_path / "nope"), "--corpus", str(corpus)], "unknown model spec")]
    for extra, message in cases:
        args = ["ngram", "build", "--tokenizer", target, "--out", str(tmp_path / "x.ngram"), *extra]
        assert main(args) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, (extra, err)
    # Drafting with a missing table or one built for another tokenizer: one line, exit 2.
    for draft, message in [(f"ngram-corpus:{tmp_path / 'missing.ngram'}", "n-gram table not found"),
                           (str(out), "another tokenizer")]:
        target_spec = other if draft == str(out) else target
        code = main(["generate", "--target", target_spec, "--draft", draft, "--prompt", "hi", "--max-new-tokens", "2"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.count("\n") == 0 and message in err, err


# --- through the engine --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def table_file(model_dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("table") / "chars.ngram"
    text = tmp_path_factory.mktemp("text") / "corpus.txt"
    text.write_text("hello there, hello world. the cat sat on the mat, the cat sat on the hat.\n" * 3)
    assert main(["ngram", "build", "--tokenizer", model_dirs[0], "--corpus", str(text), "--out", str(path)]) == 0
    return str(path)


def test_greedy_equals_plain_decoding_alone_and_in_ragged_batches(model_dirs, table_file):
    target = model_dirs[0]
    greedy = SamplingConfig(temperature=0)
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=40)
    prompts = ["the cat sat", "hello there, hello", "a", "on the mat, the cat sat on the"]
    plain = SpeculativeDecoder.load(target, "none").generate_batch(prompts, greedy, spec, chat=False)
    corpus = SpeculativeDecoder.load(target, f"ngram-corpus:{table_file}")
    assert corpus.draft_name == f"ngram-corpus:{table_file}" and corpus.drafter.name == "ngram-corpus"
    batch = corpus.generate_batch(prompts, greedy, spec, chat=False)
    alone = [corpus.generate(p, greedy, spec, chat=False) for p in prompts]
    for p, b, a in zip(plain, batch, alone):
        assert b.token_ids == p.token_ids == a.token_ids
    for runs in (batch, alone):
        drafts_accepted(runs)
    # A .ngram path is a drafter spec too.
    by_path = SpeculativeDecoder.load(target, table_file).generate(prompts[0], greedy, spec, chat=False)
    assert by_path.token_ids == plain[0].token_ids
    drafts_accepted([by_path])


def random_table(seed=0, vocab=V, length=400) -> NGramTable:
    """A table over the chi-square vocabulary: n-grams of a random stream biased towards PROMPT's pattern."""
    g = torch.Generator().manual_seed(seed)
    stream = (PROMPT * 40)[:length]
    noise = torch.randint(0, vocab, (length,), generator=g).tolist()
    mixed = [n if torch.rand(1, generator=g).item() < 0.4 else s for s, n in zip(stream, noise)]
    return table_from([mixed], vocab_size=vocab)


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", vocab=V, seed=3, sharpness=4.0)


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4)],
                         ids=["T1", "T0.7-k4"])
def test_sampled_ngram_drafts_stay_exact(target, K, sampling):
    drafter = CorpusNGramDrafter(random_table(), V, NGramConfig(max_n=3))
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    samples, seqs = sample_tokens(engine, sampling, K)
    drafted = sum(s.stats.draft_tokens for s in seqs)
    accepted = sum(s.stats.accepted_tokens for s in seqs)
    assert 0 < accepted < drafted  # both the accept and the recover paths ran
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


def test_sampled_q_rows_are_the_distributions_drawn_from(target):
    """Each q row is a distribution over the target vocabulary, with mass on its draft token."""
    drafter = CorpusNGramDrafter(random_table(), V, NGramConfig(max_n=3))
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    seqs = engine.make_sequences([PROMPT] * 50, SamplingConfig(temperature=0.8), SpecConfig(num_draft_tokens=3), 0)
    drafter.start(seqs)
    drafts = drafter.propose(seqs, [3] * 50)
    assert any(len(d) for d in drafts)
    for d in drafts:
        if len(d):
            assert d.q.shape == (len(d), V) and torch.allclose(d.q.sum(-1), torch.ones(len(d)))
            assert bool((d.q[torch.arange(len(d)), d.tokens] > 0).all())


def test_the_shipped_table_is_checked(model_dirs, tmp_path, monkeypatch):
    from verispec.drafters import ngram_corpus

    assert ngram_corpus.table_path("ngram-corpus") == ngram_corpus.DEFAULT_TABLE
    shipped = NGramTable.load(ngram_corpus.DEFAULT_TABLE)
    assert shipped.header["tokenizer"] == "qwen2.5-coder-1.5b-instruct" and shipped.max_n == 4
    with pytest.raises(VerispecError, match="another tokenizer"):  # built for Qwen, not the character tokenizer
        SpeculativeDecoder.load(model_dirs[0], "ngram-corpus")
    damaged = tmp_path / "default.ngram"
    data = bytearray(ngram_corpus.DEFAULT_TABLE.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    monkeypatch.setattr(ngram_corpus, "DEFAULT_TABLE", damaged)
    with pytest.raises(VerispecError, match="damaged"):
        ngram_corpus.table_path("ngram-corpus")


@pytest.mark.parametrize("tree", [TreeConfig(shape=(3, 2, 1)), TreeConfig(budget=10, top_k=3)], ids=["static", "dynamic"])
def test_corpus_ngram_trees_greedy_equal_plain(model_dirs, table_file, tree):
    target = model_dirs[0]
    greedy = SamplingConfig(temperature=0)
    prompts = ["the cat sat", "hello there, hello", "on the mat, the cat sat on the"]
    plain = SpeculativeDecoder.load(target, "none").generate_batch(prompts, greedy, SpecConfig(max_new_tokens=30), chat=False)
    corpus = SpeculativeDecoder.load(target, f"ngram-corpus:{table_file}")
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=30, tree=tree)
    batch = corpus.generate_batch(prompts, greedy, spec, chat=False)
    assert [r.token_ids for r in batch] == [r.token_ids for r in plain]
    drafts_accepted(batch)


def test_corpus_ngram_tree_shape_and_order(target):
    """A static shape bounds each depth's children; siblings come most likely first; a trie has no repeats."""
    drafter = CorpusNGramDrafter(random_table(), V, NGramConfig(max_n=3))
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    seqs = engine.make_sequences([PROMPT], SamplingConfig(temperature=0), SpecConfig(), 0)
    drafter.start(seqs)
    draft = drafter.propose(seqs, [2], [TreeConfig(shape=(3, 2))])[0]
    tree = draft.tree
    assert 0 < tree.size <= 3 + 3 * 2 and draft.q is None and draft.siblings == "deterministic"
    for children in tree.children:
        toks = [int(draft.tokens[c]) for c in children]
        assert len(toks) == len(set(toks))
    root = [int(draft.tokens[c]) for c in tree.children[0]]
    expected = [t for t, _ in drafter.candidates(PROMPT, 3, row=0)]
    assert root == expected


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)],
                         ids=["T1", "T0.7-p0.9"])
def test_sampled_corpus_ngram_trees_stay_exact(target, sampling):
    drafter = CorpusNGramDrafter(random_table(), V, NGramConfig(max_n=3))
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=3, stop_at_eos=False, tree=TreeConfig(shape=(3, 2, 1)))
    seqs = engine.generate([PROMPT] * 3000, sampling, spec, seeds=0)
    samples = [tuple(s.generated[:3]) for s in seqs]
    assert 0 < sum(s.stats.accepted_tokens for s in seqs) < sum(s.stats.draft_tokens for s in seqs)
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit
