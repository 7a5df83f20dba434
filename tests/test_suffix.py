"""Suffix decoding (`verispec.drafters.suffix`): what it finds, how it ranks and bounds its drafts, its store of
earlier outputs, and greedy output equal to plain decoding (its sampled exactness runs in the exactness grid)."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time

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
    drafter.start([first])
    first.tokens += [30, 31, 32, 33, 34]  # its output
    first.finish_reason = "length"
    second = seq([7, 30, 31])
    drafter.start([second])  # a new batch: the first request's output joined the store
    draft, = drafter.propose([second], [4])
    assert draft.tokens.tolist() == [32, 33]
    store = OutputStore(SuffixConfig(capacity=10))
    for k in range(6):
        store.add([100 + k] * 3 + [k])
    assert store.tokens <= 10 and store.documents[-1] == [105, 105, 105, 5]
    assert store.index().size == sum(len(d) + 1 for d in store.documents)  # rebuilt from what was kept


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


def finished(drafter: SuffixDrafter, outputs: list[list[int]], scopes: list[str | None] | None = None,
             flush: bool = False) -> None:
    """Run rows through the drafter as a batch does: announced, decoded (their outputs set), then dropped; with
    `flush`, the store's file written before returning (it is written in the background)."""
    rows = [seq([1, 2]) for _ in outputs]
    for row, scope in zip(rows, scopes or [None] * len(rows)):
        row.scope = scope
    drafter.start(rows)
    for row, output in zip(rows, outputs):
        row.tokens += output
    drafter.keep([])
    if flush:
        assert drafter.flush_store(10.0)


def test_a_store_file_keeps_earlier_outputs_across_drafters(tmp_path):
    path = tmp_path / "store.suffix"
    first = SuffixDrafter(SuffixConfig(), path, TOKENIZER, 64)
    assert not path.exists()  # nothing to keep yet
    finished(first, [[9, 4, 5, 6, 7], [3, 8, 8]], flush=True)
    assert path.is_file() and os.stat(path).st_mode & 0o777 == 0o600  # its owner's only
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
    finished(SuffixDrafter(SuffixConfig(), good, TOKENIZER, 64), [[5, 6, 7]], flush=True)
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


# --- scopes, the background writer, the file's mode, write errors ----------------------------------------------
def scoped(tokens: list[int], scope: str | None) -> Sequence:
    row = seq(tokens)
    row.scope = scope
    return row


def drafted(drafter: SuffixDrafter, tokens: list[int], scope: str | None, depth: int = 4) -> list[int]:
    row = scoped(tokens, scope)
    drafter.start([row])
    return drafter.propose([row], [depth])[0].tokens.tolist()


def test_key_scopes_keep_each_tenants_outputs_apart():
    drafter = SuffixDrafter(SuffixConfig(min_match=2, scope="key"))
    finished(drafter, [[40, 41, 42, 43, 44]], scopes=["b"])
    assert drafted(drafter, [7, 40, 41, 42], "a") == []  # another scope's output: nothing drafted from it
    assert drafted(drafter, [7, 40, 41, 42], None) == []  # nor for rows of no scope
    assert drafted(drafter, [7, 40, 41, 42], "b") == [43, 44]  # its own scope's earlier output
    finished(drafter, [[50, 51, 52, 53]], scopes=[None])
    assert drafted(drafter, [50, 51], None) == [52, 53]  # rows of no scope share one store
    assert drafted(drafter, [50, 51], "b") == []
    assert drafter.store.scope_documents("b") == [[40, 41, 42, 43, 44]]
    assert drafter.store.scope_documents(None) == [[50, 51, 52, 53]] and drafter.store.scope_documents("a") == []


def test_the_shared_scope_serves_every_row_as_before():
    drafter = SuffixDrafter(SuffixConfig(min_match=2, scope="shared"))  # (the default, "key", follows Sequence.scope)
    finished(drafter, [[40, 41, 42, 43, 44]], scopes=["b"])
    assert drafted(drafter, [7, 40, 41, 42], "a") == [43, 44]
    assert drafted(drafter, [7, 40, 41, 42], None) == [43, 44]
    assert list(drafter.store.scopes) == [None]  # a row's scope is not read
    with pytest.raises(VerispecError, match="unknown suffix store scope 'tenant'"):
        SuffixConfig(scope="tenant")


def test_capacity_bounds_every_scope_together_oldest_output_first():
    store = OutputStore(SuffixConfig(capacity=20))
    for k in range(40):  # 40 tenants of 5 tokens each
        store.add([100 + k] * 4 + [k], f"tenant-{k}")
        assert store.tokens <= 20
        assert sum(s.tokens for s in store.scopes.values()) == store.tokens
    kept = [document[-1] for document in store.documents]
    assert kept == sorted(kept) and kept[-1] == 39  # the most recent outputs, oldest first
    assert set(store.scopes) == {f"tenant-{k}" for k in kept}  # a scope left without outputs is gone
    assert all(s.index.size == sum(len(d) + 1 for d in s.documents) for s in store.scopes.values())
    store.add(list(range(50)), "big")  # one output over the capacity: its last `capacity` tokens, alone
    assert store.documents == [list(range(30, 50))] and list(store.scopes) == ["big"]


def test_retire_all_adds_every_rows_output_once():
    drafter = SuffixDrafter(SuffixConfig(min_match=2, scope="key"))
    rows = [scoped([1, 2], "a"), scoped([1, 2], "b"), scoped([1, 2], "a")]
    drafter.start(rows)
    for k, row in enumerate(rows):
        row.tokens += [30 + k, 31, 32, 33]
    drafter.retire_all()  # a server discarding its batch without keep
    assert drafter.store.scope_documents("a") == [[30, 31, 32, 33], [32, 31, 32, 33]]
    assert drafter.store.scope_documents("b") == [[31, 31, 32, 33]]
    drafter.propose(rows, [4, 4, 4])  # the rows stay: drafting goes on
    drafter.retire_all()
    drafter.keep([1])
    drafter.start([])  # neither keep nor start adds a retired row again
    assert drafter.store.tokens == 12 and len(drafter.store.documents) == 3


def test_a_store_file_keeps_every_scope_apart_across_drafters(tmp_path):
    path = tmp_path / "store.suffix"
    first = SuffixDrafter(SuffixConfig(min_match=2, scope="key"), path, TOKENIZER, 64)
    finished(first, [[9, 4, 5, 6, 7], [3, 8, 8, 8], [20, 21, 22]], scopes=["key:alice", None, "b"], flush=True)
    second = SuffixDrafter(SuffixConfig(min_match=2, scope="key"), path, TOKENIZER, 64)
    assert second.store.snapshot() == [("key:alice", [9, 4, 5, 6, 7]), (None, [3, 8, 8, 8]), ("b", [20, 21, 22])]
    assert drafted(second, [0, 9, 4, 5], "key:alice") == [6, 7]
    assert drafted(second, [0, 9, 4, 5], "b") == []
    assert drafted(second, [3, 8, 8], None) == [8]
    shared = SuffixDrafter(SuffixConfig(min_match=2, scope="shared"), path, TOKENIZER, 64)  # reads only its own
    assert drafted(shared, [0, 9, 4, 5], "key:alice") == [] and drafted(shared, [3, 8, 8], "x") == [8]
    finished(shared, [[60, 61, 62]], flush=True)  # ... and keeps the others' outputs in their scopes
    third = SuffixDrafter(SuffixConfig(min_match=2, scope="key"), path, TOKENIZER, 64)
    assert third.store.scope_documents("key:alice") == [[9, 4, 5, 6, 7]]
    assert third.store.scope_documents(None) == [[3, 8, 8, 8], [60, 61, 62]]


def test_a_version_1_store_is_read_into_the_shared_scope_and_others_are_refused(tmp_path):
    from safetensors.numpy import save_file

    header = {"format": "verispec-suffix-store", "tokenizer": "tiny", "tokenizer_sha256": "a" * 64}
    tensors = {"tokens": np.array([9, 4, 5, 6, 7], np.int32), "lengths": np.array([5], np.int64)}
    old = tmp_path / "old.suffix"
    save_file(tensors, str(old), metadata={**header, "version": "1"})
    drafter = SuffixDrafter(SuffixConfig(min_match=2, scope="key"), old, TOKENIZER, 64)
    assert drafter.store.snapshot() == [(None, [9, 4, 5, 6, 7])]
    assert drafted(drafter, [0, 9, 4, 5], "a") == [] and drafted(drafter, [0, 9, 4, 5], None) == [6, 7]
    newer = tmp_path / "newer.suffix"
    save_file(tensors, str(newer), metadata={**header, "version": "3"})
    with pytest.raises(VerispecError, match="format version 3, this verispec reads versions 1 and 2"):
        SuffixDrafter(SuffixConfig(), newer, TOKENIZER, 64)
    for names, owners in (("[\"a\"]", [1]), ("not json", [0]), ("[\"a\", \"a\"]", [0]), ("[3]", [0])):
        bad = tmp_path / "bad.suffix"
        save_file({**tensors, "scopes": np.array(owners, np.int64)}, str(bad),
                  metadata={**header, "version": "2", "scopes": names})
        with pytest.raises(VerispecError, match="damaged suffix store \\(its outputs' scopes"):
            SuffixDrafter(SuffixConfig(), bad, TOKENIZER, 64)


def test_the_store_file_is_its_owners_only_even_where_it_was_not(tmp_path):
    path = tmp_path / "store.suffix"
    finished(SuffixDrafter(SuffixConfig(), path, TOKENIZER, 64), [[5, 6, 7]], flush=True)
    assert os.stat(path).st_mode & 0o777 == 0o600
    os.chmod(path, 0o644)  # as an earlier version wrote it
    old_umask = os.umask(0)  # a permissive umask changes nothing
    try:
        finished(SuffixDrafter(SuffixConfig(), path, TOKENIZER, 64), [[8, 9]], flush=True)
    finally:
        os.umask(old_umask)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["store.suffix"]  # no temporary file left


def recording_saves(monkeypatch, delay: float = 0.0, fail: list | None = None) -> list[str]:
    """OutputStore.save wrapped: each call's thread name recorded (after `delay` seconds), raising ENOSPC while
    `fail` holds True."""
    real, threads = OutputStore.save, []

    def save(self, path, tokenizer):
        threads.append(threading.current_thread().name)
        time.sleep(delay)
        if fail and fail[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, path, tokenizer)

    monkeypatch.setattr(OutputStore, "save", save)
    return threads


def test_the_store_is_written_off_the_decoding_thread_and_coalesced(tmp_path, monkeypatch):
    threads = recording_saves(monkeypatch, delay=0.3)
    path = tmp_path / "store.suffix"
    drafter = SuffixDrafter(SuffixConfig(), path, TOKENIZER, 64)
    finished(drafter, [[10 + k, 1, 2] for k in range(6)])  # six rows retiring together
    assert drafter.flush_store(10.0) and len(threads) == 1  # one write for the six
    assert threads[0].startswith("suffix-store-writer") and threads[0] != threading.current_thread().name
    for k in range(5):  # five batches while a write is in flight, and within the interval after it
        finished(drafter, [[30 + k, 1, 2]])
    assert drafter.flush_store(10.0)
    assert 2 <= len(threads) <= 3  # at most one in flight and one pending, then the flush
    reread = SuffixDrafter(SuffixConfig(), path, TOKENIZER, 64)
    assert reread.store.documents == drafter.store.documents and len(reread.store.documents) == 11
    assert drafter.flush_store(0.0)  # nothing pending: no wait
    assert SuffixDrafter(SuffixConfig()).flush_store(0.0)  # no file: nothing to do


def test_a_full_disk_is_logged_once_and_no_output_is_added_twice(tmp_path, monkeypatch, caplog):
    fail = [True]
    threads = recording_saves(monkeypatch, fail=fail)
    path = tmp_path / "store.suffix"
    drafter = SuffixDrafter(SuffixConfig(min_match=2), path, TOKENIZER, 64)
    outputs = [[40 + k, 41 + k, 42 + k] for k in range(4)]
    with caplog.at_level(logging.WARNING, logger="verispec.suffix"):
        for k, output in enumerate(outputs):  # batches start while the writes keep failing
            row = seq([1, 2])
            drafter.start([row])  # the earlier batch's finished row leaves here, not through keep
            row.tokens += output
            row.finish_reason = "length"
            if k:
                assert not drafter.flush_store(10.0)  # tried, and failed
        drafter.keep([])
        assert not drafter.flush_store(10.0)
    assert drafter.store.documents == outputs  # in memory, each once
    warnings = [r for r in caplog.records if r.name == "verispec.suffix"]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage() and "No space left" in warnings[0].getMessage()
    assert len(threads) >= 4 and not path.exists()
    assert drafted(drafter, [0, 41, 42], None) == [43]  # drafting goes on from memory
    fail[0] = False  # the disk has room again
    assert drafter.flush_store(10.0)
    assert SuffixDrafter(SuffixConfig(), path, TOKENIZER, 64).store.documents == outputs
    assert os.stat(path).st_mode & 0o777 == 0o600
    fail[0] = True
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verispec.suffix"):
        finished(drafter, [[7, 7, 7]])
        assert not drafter.flush_store(10.0)
    assert len([r for r in caplog.records if r.name == "verispec.suffix"]) == 1  # logged again after a success


def test_a_pending_write_waits_out_the_interval_and_close_ends_the_thread(tmp_path, monkeypatch):
    import verispec.drafters.suffix_store as suffix_store

    monkeypatch.setattr(suffix_store, "WRITE_INTERVAL", 1.0)
    threads = recording_saves(monkeypatch)
    path = tmp_path / "store.suffix"
    drafter = SuffixDrafter(SuffixConfig(), path, TOKENIZER, 64)
    finished(drafter, [[1, 2, 3]])
    deadline = time.monotonic() + 10
    while len(threads) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    finished(drafter, [[4, 5, 6]])  # within the interval: written once it has passed, without a flush
    time.sleep(0.1)
    assert len(threads) == 1 and drafter.writer.pending
    while drafter.writer.pending and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(threads) == 2 and not drafter.writer.pending
    assert drafter.writer.close(10.0) and drafter.writer._thread is None
    finished(drafter, [[7, 8, 9]])  # a later output starts a new thread
    assert drafter.flush_store(10.0) and len(threads) == 3
    assert [d[0] for d in SuffixDrafter(SuffixConfig(), path, TOKENIZER, 64).store.documents] == [1, 4, 7]


def test_the_suffix_scope_reaches_the_drafter_from_options():
    import argparse

    from verispec.cli.options import decoder_kwargs, suffix_config
    from verispec.drafters.registry import DrafterOptions, build_drafter, with_suffix_scope

    args = argparse.Namespace(suffix_capacity=None, suffix_scope="key")
    assert suffix_config(args).scope == "key" and suffix_config(args, "shared").scope == "shared"
    assert suffix_config(argparse.Namespace()).scope == "key"  # commands without --suffix-scope: Sequence.scope rules
    options = with_suffix_scope(DrafterOptions(suffix=SuffixConfig(capacity=99)), "shared")
    built = build_drafter("suffix", None, None, options)
    assert built.drafter.config.scope == "shared" and built.drafter.config.capacity == 99
    assert with_suffix_scope(options, None) is options
    model_args = argparse.Namespace(target="t", draft="suffix", dtype=None, draft_dtype=None, ngram_max=None,
                                    ngram_min=None, suffix_capacity=None, suffix_scope="key", target_weights=None,
                                    draft_weights=None, backend=None, cross_scheme=None, device="cpu", compile=False)
    assert decoder_kwargs(model_args)["suffix"].scope == "key"
    assert decoder_kwargs(model_args, suffix_scope="shared")["suffix"].scope == "shared"


def test_a_composite_forwards_retire_all_and_flush_store(tmp_path):
    from verispec.drafters.composite import CompositeDrafter
    from verispec.drafters.prompt_lookup import PromptLookupDrafter

    path = tmp_path / "store.suffix"
    suffix = SuffixDrafter(SuffixConfig(), path, TOKENIZER, 64)
    drafter = CompositeDrafter([suffix, PromptLookupDrafter()], learn_costs=False)
    row = seq([1, 2])
    drafter.start([row])
    row.tokens += [5, 6, 7]
    drafter.retire_all()
    assert drafter.flush_store(10.0) and suffix.store.documents == [[5, 6, 7]]
    assert SuffixDrafter(SuffixConfig(), path, TOKENIZER, 64).store.documents == [[5, 6, 7]]
    assert PromptLookupDrafter().flush_store(0.0)  # every drafter has both; no-ops without a store
    PromptLookupDrafter().retire_all()


def test_a_restart_of_running_rows_adds_nothing_and_each_output_joins_once():
    drafter = SuffixDrafter(SuffixConfig(min_match=2))
    rows = [seq([1, 2]) for _ in range(3)]
    drafter.start(rows)
    for k, row in enumerate(rows):
        row.tokens += [30 + k, 31, 32]
    for row in rows:  # a fault's restart: each row alone, then the others together (`verispec.faults`)
        drafter.start([row])
    drafter.start([rows[0], rows[2]])
    assert drafter.store.tokens == 0  # no output so far joined
    rows[1].finish_reason = "stop"  # kept out of the drafter while running (a fault's suspect): it never joins
    drafter.start([rows[0], rows[2]])
    assert drafter.store.tokens == 0
    rows[0].finish_reason = "eos"  # a row the drafter held finished: the next start takes its output
    drafter.start([rows[2]])
    assert drafter.store.documents == [[30, 31, 32]]
    drafter.retire_all()
    drafter.start([rows[2]])  # a retired row started again keeps its mark
    drafter.keep([])
    assert drafter.store.documents == [[30, 31, 32], [32, 31, 32]]
    fresh = seq([1, 2])
    drafter.start([fresh])
    fresh.tokens += [40, 41]
    drafter.keep([])  # keep drops a row as finished, whatever its finish_reason
    assert drafter.store.documents[-1] == [40, 41] and len(drafter.store.documents) == 3
