"""Drafts with another tokenizer than the target's (`verispec.drafters.cross_tokenizer`, `token_text`).

Tokens as bytes for byte-level, SentencePiece (byte fallback) and plain tokenizers; the draft's cache held at the
committed text through accepted, cut and recovered drafts (its logits equal a fresh read of the same ids); greedy output
equal to plain decoding with drafts accepted, for both schemes; chi-square cells through the engine on torch and the
native runner for both schemes, each with a wrong residual caught; bad pairs as one clear line, or a notice and plain
decoding."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import noisy_copy, tiny_model
from drafting import drafts_accepted
from verispec.config import CrossTokenizerConfig, SamplingConfig, SpecConfig
from verispec.core.sequence import Sequence
from verispec.drafters.cross_tokenizer import CrossTokenizerDrafter
from verispec.drafters.token_text import TokenText, VocabBridge
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.runners.hf import ModelRunner
from verispec.tuning import KTuner, CostProfile

GREEDY = SamplingConfig(temperature=0)
SCHEMES = ["string", "intersection"]
TARGET_CHARS = list("abcdefgh")  # the exactness grid's 8 target ids, as characters
# the draft: the same characters in another order, and merges the target does not have (tokens straddle its tokens)
DRAFT_TOKENS = list("hgfedcba") + ["ab", "cd", "ef", "gh", "fc", "bfc"]
DRAFT_MERGES = [("a", "b"), ("c", "d"), ("e", "f"), ("g", "h"), ("f", "c"), ("b", "fc")]


def char_tokenizer(chars: list[str]) -> PreTrainedTokenizerFast:
    """One id per character, in this order, nothing added."""
    tok = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def bpe_tokenizer(tokens: list[str], merges: list[tuple[str, str]]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def translated_draft(target: torch.nn.Module, target_tokens: list[str], draft_tokens: list[str], noise: float,
                     seed: int = 4) -> torch.nn.Module:
    """A draft of the target's shape over another vocabulary: a draft token that is a target token gets that token's
    embedding and head rows (so the draft knows the target), the others random ones; then noise on every weight."""
    config = type(target.config)(**{**target.config.to_dict(), "vocab_size": len(draft_tokens)})
    torch.manual_seed(seed)
    draft = type(target)(config)
    weights = {k: v for k, v in target.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    draft.load_state_dict(weights, strict=False)
    with torch.no_grad():
        draft.lm_head.weight.mul_(target.lm_head.weight.std() / draft.lm_head.weight.std())
        for j, token in enumerate(draft_tokens):
            if token in target_tokens:
                i = target_tokens.index(token)
                draft.model.embed_tokens.weight[j] = target.model.embed_tokens.weight[i]
                draft.lm_head.weight[j] = target.lm_head.weight[i]
    return noisy_copy(draft, noise, seed=seed)


def bridge() -> VocabBridge:
    return VocabBridge(TokenText(char_tokenizer(TARGET_CHARS), 8, "target"),
                       TokenText(bpe_tokenizer(DRAFT_TOKENS, DRAFT_MERGES), len(DRAFT_TOKENS), "draft"))


# --- tokens as bytes ----------------------------------------------------------------------------------------------
def test_tokens_are_read_as_bytes_for_each_kind_of_tokenizer():
    text = "Héllo wörld\n\tdef f(x):  return 数学 🙂".encode()
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    from tokenizers.trainers import BpeTrainer

    byte_level.train_from_iterator([text.decode()] * 4, BpeTrainer(vocab_size=300, show_progress=False,
                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = TokenText(PreTrainedTokenizerFast(tokenizer_object=byte_level), name="byte-level")
    assert tok.kind == "byte-level"
    tok.check_round_trip(text)
    assert tok.bytes_of(tok.encode("数".encode())[:1]) in (b"\xe6", b"\xe6\x95", "数".encode())  # half a character
    # SentencePiece with byte fallback: '▁' is a space, '<0xC3>' one byte
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"▁": 256, "a": 257, "b": 258, "▁a": 259, "ab": 260}
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("a", "b")], byte_fallback=True))
    sp.normalizer = normalizers.Replace(" ", "▁")
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = TokenText(PreTrainedTokenizerFast(tokenizer_object=sp), name="sentencepiece")
    assert tok.kind == "sentencepiece"
    ids = tok.encode("ab a é".encode())
    assert tok.pieces[ids[-1]] == b"\xa9" and tok.bytes_of(ids) == "ab a é".encode()
    tok.check_round_trip("ab a é".encode())
    # added tokens stand for their content; a tokenizer that changes text fails its round trip in one line
    lower = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate("abc")}, unk_token="a"))
    lower.normalizer = normalizers.Lowercase()
    lower.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    with pytest.raises(VerispecError, match="cannot round-trip text") as err:
        TokenText(PreTrainedTokenizerFast(tokenizer_object=lower), name="lowercasing").check_round_trip(b"abC")
    assert "\n" not in str(err.value)


def test_the_bridge_maps_shared_strings_and_says_how_much_is_shared():
    b = bridge()
    assert b.draft_to_target.tolist() == [7, 6, 5, 4, 3, 2, 1, 0, -1, -1, -1, -1, -1, -1]
    assert b.shares() == (8, 8 / 14, 1.0)
    assert b.text_share(b"abcabc") == 1.0


# --- the draft's cache follows the committed text -----------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_drafts_cache_holds_the_committed_text_through_cut_drafts_and_recovered_tokens(scheme):
    """Steps driven by hand: a random prefix of each draft accepted, then a random token; after each commit the ids
    the draft's cache holds spell the text before `covered`, and its logits equal a fresh read of those ids."""
    target = tiny_model("qwen2", vocab=8, seed=3, layers=2, sharpness=4.0)
    draft_runner = ModelRunner(translated_draft(target, TARGET_CHARS, DRAFT_TOKENS, 0.3))
    drafter = CrossTokenizerDrafter(draft_runner, bridge(), 8, CrossTokenizerConfig(scheme=scheme))
    rng = torch.Generator().manual_seed(0)
    sampling = SamplingConfig(temperature=1.0)
    seqs = [Sequence(b, list(p), len(p), sampling, torch.Generator().manual_seed(b), 64)
            for b, p in enumerate(([1, 5, 2, 6, 1, 5], [0, 1, 2, 3], [7]))]
    drafter.start(seqs)
    kept = []  # draft nodes kept at each commit
    commit = draft_runner.commit
    draft_runner.commit = lambda state, paths: (kept.append(sum(map(len, paths))), commit(state, paths))[1]
    for _ in range(12):
        drafts = drafter.propose(seqs, [4, 3, 4])
        for seq, draft in zip(seqs, drafts):
            n = int(torch.randint(0, len(draft) + 1, (1,), generator=rng))
            seq.tokens += draft.tokens[:n].tolist() + [int(torch.randint(0, 8, (1,), generator=rng))]
        drafter.commit(seqs, drafts, [tuple(range(len(d)))[:1] for d in drafts])
        for row, seq, n in zip(drafter.rows, seqs, drafter.cached):
            assert row.covered < len(row.text) and bridge().draft.bytes_of(row.ids) == bytes(row.text[:row.covered])
            # the target tokens the cache holds whole (what the composite does not charge as catch-up)
            held = bridge().target.bytes_of(seq.tokens[:n])
            assert n < len(seq.tokens) and row.covered >= len(held)
            assert row.covered < len(held + bridge().target.bytes_of(seq.tokens[n:n + 1]))
    state = drafter.state
    nxt = [[0]] * len(seqs)
    cached = draft_runner.forward(state, nxt, [1] * len(seqs))[:, 0]
    for b, row in enumerate(drafter.rows):
        fresh = draft_runner.forward(draft_runner.new_state(1), [row.ids + [0]], [1])[0, 0]
        torch.testing.assert_close(cached[b], fresh, atol=1e-4, rtol=1e-4)
    assert sum(kept) > 0  # drafted tokens were kept in the cache at some commits (and the rest dropped)


# --- greedy equality ---------------------------------------------------------------------------------------------
def sharp_pair(scheme: str) -> tuple[ModelRunner, CrossTokenizerDrafter]:
    """A peaked target and a draft of it in another vocabulary (the greedy tests' pair)."""
    target = tiny_model("qwen2", vocab=8, seed=3, layers=2, sharpness=30.0)
    drafter = CrossTokenizerDrafter(ModelRunner(translated_draft(target, TARGET_CHARS, DRAFT_TOKENS, 0.2)), bridge(),
                                    8, CrossTokenizerConfig(scheme=scheme))
    return ModelRunner(target), drafter


def assert_greedy_equals_plain(runner, drafter, prompts, spec, tuner=None) -> None:
    plain = [s.generated for s in SpeculativeEngine(runner, None, set()).generate(prompts, GREEDY, spec)]
    out = SpeculativeEngine(runner, drafter, set()).generate(prompts, GREEDY, spec, tuner=tuner)
    assert [s.generated for s in out] == plain
    drafts_accepted(out)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_output_equals_plain_decoding(scheme):
    runner, drafter = sharp_pair(scheme)
    assert_greedy_equals_plain(runner, drafter, [[1, 5, 2, 6, 1, 5, 2, 6], [0, 1, 2, 3, 4], [7, 7, 1], [3]],
                               SpecConfig(num_draft_tokens=4, max_new_tokens=30, stop_at_eos=False))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_tuner_charges_the_string_drafts_held_back_token_and_decodes_exactly(scheme):
    """`--auto-k` (the default): the string scheme's steps cost K + 1 draft positions, the intersection's K."""
    from types import SimpleNamespace

    from verispec.api import SpeculativeDecoder

    runner, drafter = sharp_pair(scheme)
    tuner = SpeculativeDecoder.auto_tuner(SimpleNamespace(runner=runner, drafter=drafter), k_max=4)
    assert tuner.profile.draft_extra == (1.0 if scheme == "string" else 0.0) == drafter.traits.held_back
    tuner = KTuner(CostProfile({w: 1.0 for w in range(1, 6)}, 0.01, tuner.profile.draft_extra),
                      learn_costs=False)  # drafting pays
    timed = []
    tuner.observe_draft = lambda positions, seconds: timed.append(positions)
    assert_greedy_equals_plain(runner, drafter, [[1, 5, 2, 6, 1, 5, 2, 6], [0, 1, 2, 3, 4]],
                               SpecConfig(max_new_tokens=30, stop_at_eos=False), tuner)
    assert timed and all(timed)  # steady steps were timed


# --- chi-square through the engine --------------------------------------------------------------------------------
def cross_family(scheme):
    def family(target, backend):
        import exactness_harness as grid

        draft = translated_draft(grid.target_model(), TARGET_CHARS, DRAFT_TOKENS, 0.5)
        return CrossTokenizerDrafter(grid.BACKENDS[backend](draft), bridge(), grid.V, CrossTokenizerConfig(scheme=scheme))
    return family


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_sampled_cross_tokenizer_decoding_follows_the_targets_distribution(scheme, backend, monkeypatch):
    """Chi-square cells (T = 1 and top-k / temperature 0.7) for each scheme, and the target's p instead of the residual
    after a rejection, which the same cells catch."""
    import exactness_harness as grid
    from verifier_mutants import installed

    family = f"cross-{scheme}"
    monkeypatch.setitem(grid.FAMILIES, family, cross_family(scheme))
    for setting in ("T1", "T0.7-topk4"):
        grid._engines.pop((family, backend), None)
        cell = grid.Cell(family, backend, "chain", setting)
        outcome = grid.run_cell(cell)
        grid.check(outcome, cell)
    with installed("residual p"):  # twice the sequences: a draft this close to the target is rarely rejected
        assert grid.run_cell(grid.Cell(family, backend, "chain", "T1"), n=2 * grid.N).p_value <= grid.THRESHOLD
    grid._engines.pop((family, backend), None)


# --- bad pairs --------------------------------------------------------------------------------------------------
def test_bad_pairs_are_one_clear_line_or_a_notice_and_plain_decoding(tmp_path, capsys):
    from tiny_hf import CHARS, save_tiny_model_dir
    from verispec.cli import main

    target = str(save_tiny_model_dir(tmp_path / "target", "llama", seed=0))
    other = str(save_tiny_model_dir(tmp_path / "other", "llama", seed=1, vocab_chars=list(reversed(CHARS))))
    letters = str(save_tiny_model_dir(tmp_path / "letters", "llama", seed=1, vocab_chars=list("abcdefghijklm ")))
    common = ["generate", "--json", "--prompt", "abcabcabc", "--temperature", "0", "--max-new-tokens", "12",
              "--target", target]
    assert main([*common, "--draft", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    for scheme in SCHEMES:  # the same characters in another order: a draft with another tokenizer, exact
        assert main([*common, "--draft", other, "--cross-scheme", scheme]) == 0
        out = capsys.readouterr()
        assert json.loads(out.out)["token_ids"] == plain and "another tokenizer" in out.err
    # a draft that cannot write what the target writes (no digits or punctuation): one line, exit 2
    assert main([*common, "--draft", letters]) == 2
    err = capsys.readouterr().err
    assert "cannot round-trip text" in err and len(err.strip().splitlines()) == 1, err
    # a draft whose tokens are mostly not the target's: a notice, and the target decodes alone
    wide = str(save_tiny_model_dir(tmp_path / "wide", "llama", seed=1,
                                   vocab_chars=CHARS + [f"<w{i}>" for i in range(600)]))
    assert main([*common, "--draft", wide]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["token_ids"] == plain and "decoding without a draft" in out.err
    with pytest.raises(VerispecError, match="unknown cross-tokenizer scheme"):
        CrossTokenizerConfig(scheme="words")


# --- prefix reuse -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_cross_tokenizer_drafts_cache_follows_the_reused_prefixes(scheme):
    """On the native runner the draft keeps its finished rows' caches by its own ids: a conversation's later turns
    start the draft from the turn before's (up to where the whole text's tokenization parts from the pieces it read),
    with the same drafts and the same bits as without."""
    import exactness_harness as grid
    from verispec.core.prefix import PrefixStore

    target = tiny_model("qwen2", vocab=8, seed=3, layers=2, sharpness=30.0)
    native = grid.BACKENDS["native"](target)
    draft = grid.BACKENDS["native"](translated_draft(target, TARGET_CHARS, DRAFT_TOKENS, 0.2))
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=16, stop_at_eos=False)
    system = [(3 * i + 1) % 8 for i in range(40)]

    def conversation(engine):
        prompt, turns = system + [1, 2], []
        for turn in range(3):
            turns.append(engine.generate([prompt], GREEDY, spec)[0])
            prompt = turns[-1].tokens + [5, turn]
        return turns

    cold = conversation(SpeculativeEngine(native, CrossTokenizerDrafter(draft, bridge(), 8,
                                                                        CrossTokenizerConfig(scheme=scheme)), set()))
    drafter = CrossTokenizerDrafter(draft, bridge(), 8, CrossTokenizerConfig(scheme=scheme))
    engine = SpeculativeEngine(native, drafter, set())
    engine.prefixes = PrefixStore(1 << 30)
    drafter.reuse_prefixes(1 << 30)
    warm = conversation(engine)
    assert [s.generated for s in warm] == [s.generated for s in cold]
    assert [s.stats.accepted_tokens for s in warm] == [s.stats.accepted_tokens for s in cold] and \
        sum(s.stats.accepted_tokens for s in warm) > 0
    stats = drafter.prefixes.stats
    assert stats.hits == 2 and stats.tokens_reused >= 30  # most of each earlier turn, in the draft's ids
