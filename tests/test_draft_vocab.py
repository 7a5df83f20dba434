"""--draft-vocab N: a native draft's LM head cut to its first N token ids. Its logits there are the full head's, bit
for bit, -inf above; speculation with it gives plain decoding's tokens (greedy) and the target's distribution
(chi-square, with a cut that removes target mass from q); other drafts refuse it in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import noisy_copy, tiny_model
from tiny_gguf import T, gguf_from_hf
from verispec.chisquare import chi_square_test
from verispec.config import SamplingConfig, SpecConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.gguf.model import load_gguf
from verispec.models.gguf.runner import NativeRunner
from verispec.models.runners.head_rows import HeadRowsRunner
from verispec.models.runners.hf import ModelRunner


def native(model, path) -> NativeRunner:
    return NativeRunner(load_gguf(gguf_from_hf(model, path, T.Q8_0), show_progress=False))


def test_the_cut_head_keeps_its_rows_bits_and_nothing_above(tmp_path):
    draft = native(tiny_model("llama", vocab=64, seed=2, layers=2), tmp_path / "d.gguf")
    cut = HeadRowsRunner(draft, 32)
    tokens = [[1, 2, 3, 4, 5], [9, 8]]
    full = draft.forward(draft.new_state(2), tokens, [2, 1])  # (2, 2, 64)
    kept = cut.forward(cut.new_state(2), tokens, [2, 1])
    assert torch.equal(kept[..., :32], full[..., :32]) and torch.isneginf(kept[..., 32:]).all()  # no ranking: id order
    assert cut.vocab_size == 64 and HeadRowsRunner(draft, 1000).rows == 64 and HeadRowsRunner(draft, 40).rows == 32


def test_speculation_with_a_cut_draft_head_is_exact(tmp_path):
    target_model = tiny_model("llama", vocab=32, seed=3, sharpness=3.0)
    target = native(target_model, tmp_path / "t.gguf")
    draft = HeadRowsRunner(native(noisy_copy(target_model, 0.8, seed=4), tmp_path / "d.gguf"), 16)
    engine = SpeculativeEngine(target, DraftModelDrafter(draft, 32), set())
    prompts = [[1, 2, 3, 4, 1, 2], [7, 8, 9]]
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=20, stop_at_eos=False)
    greedy = SamplingConfig(temperature=0)
    plain = [s.generated for s in SpeculativeEngine(target, None, set()).generate(prompts, greedy, spec)]
    out = engine.generate(prompts, greedy, spec)
    assert [s.generated for s in out] == plain
    sampling = SamplingConfig(temperature=1.0)
    p = torch.softmax(target.forward(target.new_state(1), [[1, 2, 3]], [1])[0, 0], -1)  # (32,)
    assert p[16:].sum() > 0.2  # the cut leaves a good share of the target's mass outside q
    counts = torch.zeros(32)
    seqs = engine.generate([[1, 2, 3]] * 800, sampling, SpecConfig(num_draft_tokens=2, max_new_tokens=3,
                                                                   stop_at_eos=False), seeds=0)
    for s in seqs:
        counts[s.generated[0]] += 1
    assert sum(s.stats.accepted_tokens for s in seqs) > 100  # drafts below the cut are drafted and accepted
    assert chi_square_test(counts, p).p_value > 1e-3


def test_the_kept_ids_are_a_shipped_ranking_of_this_tokenizer_else_id_order(tmp_path, monkeypatch):
    from safetensors.numpy import save_file

    from tiny_hf import save_tiny_model_dir
    from transformers import AutoTokenizer
    from verispec.models.runners import head_rows
    from verispec.ngram.table import tokenizer_fingerprint

    tokenizer = AutoTokenizer.from_pretrained(save_tiny_model_dir(tmp_path / "m", "llama", seed=0))
    (tmp_path / "assets" / "ranks").mkdir(parents=True)
    save_file({"ids": np.array([5, 3, 99], np.int32)}, str(tmp_path / "assets" / "ranks" / "ranks.safetensors"),
              metadata={"tokenizer_sha256": tokenizer_fingerprint(tokenizer)})
    monkeypatch.setattr(head_rows, "ASSETS", tmp_path / "assets")
    assert head_rows.token_ranks(tokenizer, 8).tolist() == [5, 3, 0, 1, 2, 4, 6, 7]  # 99: outside, dropped
    assert head_rows.token_ranks(None, 4).tolist() == [0, 1, 2, 3]


def test_drafts_that_cannot_cut_their_head_say_so_in_one_line(tmp_path):
    with pytest.raises(VerispecError, match="native runner only"):
        HeadRowsRunner(ModelRunner(tiny_model("llama", vocab=16, seed=1)), 8)
    draft = native(tiny_model("llama", vocab=16, seed=1), tmp_path / "d.gguf")
    with pytest.raises(VerispecError, match="at least 16 token ids"):
        HeadRowsRunner(draft, 0)


def test_the_benchs_draft_model_systems_cut_the_head_as_asked(tmp_path):
    """`verispec bench --draft-vocab N` reaches its systems that draft with the --draft model (it was read and dropped:
    a bench said it measured a cut head and measured the full one); below 16 ids it is refused before loading."""
    from tiny_gguf import native_models

    from verispec.bench.runner import BenchConfig, build_systems

    loaded = native_models(tmp_path)

    def draft_runners(vocab):
        config = BenchConfig(systems=("verispec-draft", "verispec-suffix-draft", "verispec-plain"), distilled=None,
                             draft_vocab=vocab)
        systems = build_systems(config, loaded("target"), loaded("draft"), None, None)
        drafters = [s.decoder.drafter for s in systems if s.name != "verispec-plain"]
        return [getattr(d, "members", [None, d])[1].runner for d in drafters]  # the composite's model: its second

    cut = draft_runners(32)
    assert len(cut) == 2 and all(isinstance(r, HeadRowsRunner) and r.rows == 32 for r in cut)
    assert not any(isinstance(r, HeadRowsRunner) for r in draft_runners(None))
    with pytest.raises(VerispecError, match="draft_vocab"):
        BenchConfig(draft_vocab=8)
