"""Suffix decoding (`verispec.drafters.suffix`): what it finds, how it ranks and bounds its drafts, its store of
earlier outputs, and greedy output equal to plain decoding (its sampled exactness runs in the exactness grid)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import tiny_model
from tiny_hf import CHARS
from verispec.config import SamplingConfig, SpecConfig, SuffixConfig, TreeConfig
from verispec.core.sequence import Sequence
from verispec.drafters.suffix import OutputStore, SuffixDrafter, SuffixIndex, frequency_tree
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.runners.hf import ModelRunner

GREEDY = SamplingConfig(temperature=0)


def seq(tokens: list[int]) -> Sequence:
    return Sequence(0, list(tokens), len(tokens), GREEDY, torch.Generator(), 64)


def test_candidates_and_their_match_lengths():
    index = SuffixIndex(2)
    index.add_document([5, 1, 2, 3, 9, 8, 1, 2, 4, 7])
    index.append([1, 2, 6])
    positions, lengths = index.candidates([8, 1, 2], SuffixConfig(max_match=8))
    found = dict(zip(positions.tolist(), lengths.tolist()))
    assert found == {3: 2, 8: 3, 13: 2}  # after "1 2": the one preceded by 8 matches 3 tokens
    assert index.continuation(8, 5) == [4, 7]  # a continuation stops at its document's end
    assert index.continuation(13, 5) == [6]
    _, capped = index.candidates([8, 1, 2], SuffixConfig(max_match=2))
    assert capped.max() == 2
    assert index.candidates([3], SuffixConfig())[0].size == 0  # shorter than the key
    positions, _ = index.candidates([2, 6], SuffixConfig())
    assert positions.size == 0  # the text's own end has no continuation


def test_a_chain_follows_the_most_frequent_continuation_while_it_holds_its_share():
    runs = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [5, 6]]
    tokens, parents = frequency_tree(runs, None, 0.1)
    assert tokens == [1, 2, 3] and parents == (-1, 0, 1)
    tokens, _ = frequency_tree(runs, None, 0.7)  # "1" holds 3/4, "2" 3/3, "3" only 2/3 of them
    assert tokens == [1, 2]
    tokens, _ = frequency_tree([[7, 1], [8, 2]], None, 0.1)
    assert tokens == [7, 1]  # a tie goes to the continuation listed first


def test_a_tree_keeps_the_most_frequent_nodes_within_its_shape_or_budget():
    runs = [[1, 2, 3], [1, 2, 4], [1, 5], [6, 7], [1, 2, 3]]
    tokens, parents = frequency_tree(runs, TreeConfig(budget=4), 0.0)
    nodes = {(tokens[i], tokens[parents[i]] if parents[i] >= 0 else None) for i in range(len(tokens))}
    assert nodes == {(1, None), (2, 1), (3, 2), (4, 2)}  # counts 4, 3, 2, then of the ties the first listed
    assert all(parents[i] < i for i in range(len(parents)))  # breadth first
    tokens, parents = frequency_tree(runs, TreeConfig(shape=(1, 1)), 0.0)
    assert tokens == [1, 2] and parents == (-1, 0)
    tokens, _ = frequency_tree(runs, TreeConfig(budget=10), 0.3)  # only nodes through >= 30% of the runs
    assert sorted(tokens) == [1, 2, 3]


def test_drafts_from_the_context_grow_with_the_match():
    drafter = SuffixDrafter(SuffixConfig(min_match=2, spec_factor=1.0))
    row = seq([10, 11, 12, 13, 14, 15, 16, 40, 12, 13])
    drafter.start([row])
    draft, = drafter.propose([row], [8])
    assert draft.tokens.tolist() == [14, 15]  # a match of 2 drafts at most 2
    row = seq([10, 11, 12, 13, 14, 15, 16, 17, 40, 10, 11, 12, 13])
    drafter.start([row])
    draft, = drafter.propose([row], [3])
    assert draft.tokens.tolist() == [14, 15, 16]  # a match of 4, cut to the depth asked
    row.tokens += [14, 15]  # committed tokens are indexed before the next proposal
    draft, = drafter.propose([row], [8])
    assert draft.tokens.tolist() == [16, 17, 40, 10, 11, 12]  # the match is now 6 long
    assert drafter.propose([seq([1, 2, 3])], [4])[0].tokens.numel() == 0  # nothing seen: no draft


def test_earlier_outputs_serve_later_requests_and_the_store_stays_bounded():
    drafter = SuffixDrafter(SuffixConfig(min_match=2, capacity=12))
    first = seq([1, 2])
    first.tokens += [30, 31, 32, 33, 34]  # its output
    drafter.start([first])
    second = seq([7, 30, 31])
    drafter.start([second])  # a new batch: the first request's output joined the store
    draft, = drafter.propose([second], [4])
    assert draft.tokens.tolist() == [32, 33]
    store = OutputStore(SuffixConfig(capacity=10))
    for k in range(6):
        store.add([100 + k] * 3 + [k])
    assert store.tokens <= 10 and store.documents[-1] == [105, 105, 105, 5]
    assert store.index.size == sum(len(d) + 1 for d in store.documents)  # rebuilt from what was kept


def test_settings_out_of_range_are_one_clear_line():
    for bad in (dict(min_match=0), dict(min_match=5, max_match=4), dict(capacity=0), dict(spec_factor=0),
                dict(min_share=1.5), dict(max_candidates=0)):
        with pytest.raises(VerispecError):
            SuffixConfig(**bad)


@pytest.mark.parametrize("tree", [None, TreeConfig(budget=6)])
def test_greedy_suffix_decoding_equals_plain_decoding(tree):
    model = tiny_model("llama", vocab=16, seed=1, layers=2, sharpness=30.0)
    runner = ModelRunner(model)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 8, 9, 7, 8], [3, 3, 3, 3]]
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=24, tree=tree)
    plain = [s.generated for s in SpeculativeEngine(runner, None, set()).generate(prompts, GREEDY,
                                                                                  SpecConfig(max_new_tokens=24))]
    drafter = SuffixDrafter(SuffixConfig(min_match=1))
    engine = SpeculativeEngine(runner, drafter, set())
    for _ in range(2):  # the second time the store holds the first run's outputs
        out = engine.generate(prompts, GREEDY, spec)
        assert [s.generated for s in out] == plain
    assert sum(s.stats.accepted_tokens for s in out) > 0 and drafter.store.tokens > 0


def test_the_draft_flag_builds_it():
    from verispec.drafters.registry import DrafterOptions, build_drafter, parse_draft

    assert parse_draft("suffix").kind == "suffix"
    built = build_drafter("suffix", None, None, DrafterOptions(suffix=SuffixConfig(capacity=99)))
    assert isinstance(built.drafter, SuffixDrafter) and built.drafter.config.capacity == 99


TOKENIZER = {"name": "tiny", "sha256": "a" * 64}


def finished(drafter: SuffixDrafter, outputs: list[list[int]]) -> None:
    """Run rows through the drafter as a batch does: announced, decoded (their outputs set), then dropped."""
    rows = [seq([1, 2]) for _ in outputs]
    drafter.start(rows)
    for row, output in zip(rows, outputs):
        row.tokens += output
    drafter.keep([])


def test_a_store_file_keeps_earlier_outputs_across_drafters(tmp_path):
    path = tmp_path / "store.suffix"
    first = SuffixDrafter(SuffixConfig(), path, TOKENIZER, 64)
    assert not path.exists()  # nothing to keep yet
    finished(first, [[9, 4, 5, 6, 7], [3, 8, 8]])
    assert path.is_file()
    second = SuffixDrafter(SuffixConfig(), path, TOKENIZER, 64)
    assert list(second.store.documents) == [[9, 4, 5, 6, 7], [3, 8, 8]] and second.store.tokens == 8
    row = seq([0, 9, 4, 5])
    second.start([row])
    assert second.propose([row], [4])[0].tokens.tolist() == [6, 7]  # drafted from the first process's output
    small = SuffixDrafter(SuffixConfig(capacity=4), path, TOKENIZER, 64)  # a smaller bound: the oldest dropped
    assert list(small.store.documents) == [[3, 8, 8]]


def test_a_bad_store_file_is_one_clear_line_and_left_as_it_was(tmp_path):
    from safetensors.numpy import save_file

    good = tmp_path / "good.suffix"
    finished(SuffixDrafter(SuffixConfig(), good, TOKENIZER, 64), [[5, 6, 7]])
    garbage = tmp_path / "garbage.suffix"
    garbage.write_bytes(b"\x07not a store at all")
    foreign = tmp_path / "foreign.suffix"
    save_file({"x": np.zeros(2, np.int32)}, str(foreign), metadata={"format": "something-else"})
    damaged = tmp_path / "damaged.suffix"
    save_file({"tokens": np.array([1, 2, 3], np.int32), "lengths": np.array([5], np.int64)}, str(damaged),
              metadata={"format": "verispec-suffix-store", "version": "1", "tokenizer_sha256": "a" * 64})
    cases = {garbage: "not a readable suffix store", foreign: "is not a suffix store",
             damaged: "damaged suffix store", tmp_path: "is a folder", tmp_path / "no" / "such.suffix": "does not exist"}
    for path, message in cases.items():
        before = path.read_bytes() if path.is_file() else None
        with pytest.raises(VerispecError, match=message):
            SuffixDrafter(SuffixConfig(), path, TOKENIZER, 64)
        assert (path.read_bytes() if path.is_file() else None) == before
    with pytest.raises(VerispecError, match="another tokenizer \\('tiny'\\)"):
        SuffixDrafter(SuffixConfig(), good, {"name": "other", "sha256": "b" * 64}, 64)
    with pytest.raises(VerispecError, match="outside the vocabulary of 6"):
        SuffixDrafter(SuffixConfig(), good, TOKENIZER, 6)  # ids 5, 6, 7: not all below 6


def test_the_cli_keeps_a_store_file_and_refuses_a_bad_one(tmp_path, capsys):
    from tiny_hf import save_tiny_model_dir
    from verispec.cli import main

    target = str(save_tiny_model_dir(tmp_path / "target", "llama", seed=0))
    other = str(save_tiny_model_dir(tmp_path / "other", "llama", seed=1, vocab_chars=list(reversed(CHARS))))
    store = tmp_path / "outputs.suffix"
    common = ["generate", "--json", "--prompt", "abcabc", "--temperature", "0", "--max-new-tokens", "12"]
    assert main([*common, "--target", target, "--draft", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    for _ in range(2):  # the second run reads the first one's output from the file
        assert main([*common, "--target", target, "--draft", f"suffix:{store}"]) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == plain
    assert store.is_file()
    kept = store.read_bytes()
    assert main([*common, "--target", other, "--draft", f"suffix:{store}"]) == 2
    err = capsys.readouterr().err
    assert "another tokenizer" in err and len(err.strip().splitlines()) == 1 and store.read_bytes() == kept
    assert main([*common, "--target", target, "--draft", "suffix", "--suffix-capacity", "0"]) == 2
    assert "capacity must be at least 1 token" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_sampled_suffix_decoding_follows_the_targets_distribution(backend, monkeypatch):
    """The exactness grid's chi-square cells for suffix decoding (chain and tree; earlier rows' outputs in the store
    as the batch runs), and a wrong bonus rule that the same cells catch."""
    import exactness_harness as grid
    from verifier_mutants import installed

    def suffix(target, backend):
        return SuffixDrafter(SuffixConfig(min_match=1, spec_factor=2.0, min_share=0.0, capacity=256))

    monkeypatch.setitem(grid.FAMILIES, "suffix", suffix)
    for shape, setting in (("chain", "T0.7-topk4"), ("tree-budget", "T1.2-topp0.7")):
        cell = grid.Cell("suffix", backend, shape, setting)
        outcome = grid.run_cell(cell)
        grid.check(outcome, cell)
        with installed("bonus from p_n"):
            assert grid.run_cell(cell).p_value <= grid.THRESHOLD
