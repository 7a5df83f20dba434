"""`verispec collect`: the target's answers kept as token ids, in shards a killed run resumes from, for the target
and tokenizer that wrote them only; its prompt sources; and its bad input as one line."""

import errno
import json

import pytest
import torch

from tiny_hf import save_tiny_model_dir
from verispec.api import SpeculativeDecoder
from verispec.cli import main
from verispec.errors import VerispecError
from verispec.head_training import corpus as corpus_module
from verispec.head_training.corpus import CollectConfig, collect, open_corpus, read_corpus
from verispec.head_training.sources import (Prompt, code_contexts, file_prompts, normalized, prose_contexts, python_files,
                                    request_text, text_passages, usable, user_turn_prefix)

PROMPTS = ["what is two plus two?", "name a colour.", "write a short poem about rain.", "say hello.",
           "count to five.", "what is a cat?", "spell dog."]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("collect")
    return save_tiny_model_dir(root / "a", "qwen2", seed=0, sharpness=3.0), save_tiny_model_dir(root / "b", "qwen2", seed=4)


@pytest.fixture(scope="module")
def decoder(targets):
    return SpeculativeDecoder.load(str(targets[0]), "none", backend="torch")


def prompts():
    return [Prompt(text, True, "file", "text") for text in PROMPTS]


CONFIG = CollectConfig(tokens=12, batch=3, shard_size=2, sampled=0.5, heldout_fraction=0.4)  # 2 of the 7 held out


def test_a_corpus_holds_every_answer_as_token_ids_with_its_plan_and_mix(decoder, tmp_path):
    corpus = open_corpus(decoder, tmp_path / "c", CONFIG, prompts(), 0, resume=False, show=False)
    progress = collect(decoder, corpus, CONFIG, show=False)
    manifest, records = read_corpus(tmp_path / "c")
    assert len(records) == len(PROMPTS) and progress["shards_done"] == 4 == progress["shards"]
    assert all(r["answer"] and len(r["answer"]) <= CONFIG.tokens for r in records)
    assert {r["mode"] for r in records} == {"greedy", "sampled"} and {r["split"] for r in records} == {"train", "heldout"}
    assert manifest["mix"]["items"] == {"file:text": len(PROMPTS)}
    assert sum(manifest["progress"]["answer_tokens"].values()) == sum(len(r["answer"]) for r in records)
    # each answer is what the target gives that prompt alone, with the item's seed (batching changes nothing)
    for r in records[:3]:
        spec = corpus_module.SpecConfig(max_new_tokens=CONFIG.tokens)
        sampling = (corpus_module.SamplingConfig(temperature=CONFIG.temperature, top_p=CONFIG.top_p)
                    if r["mode"] == "sampled" else corpus_module.SamplingConfig(temperature=0))
        alone, = decoder.engine.generate([r["prompt"]], sampling, spec, seeds=[r["seed"]])
        assert alone.generated == r["answer"]


def test_a_killed_run_resumes_from_its_last_complete_shard_and_gives_the_same_corpus(decoder, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    collect(decoder, open_corpus(decoder, whole, CONFIG, prompts(), 0, False, False), CONFIG, show=False)
    write = corpus_module._write_json

    def killed(path, obj, done=0):
        if path.name == "shard-00002.json":
            raise KeyboardInterrupt
        write(path, obj, done)

    monkeypatch.setattr(corpus_module, "_write_json", killed)
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        collect(decoder, open_corpus(decoder, cut, CONFIG, prompts(), 0, False, False), CONFIG, show=False)
    assert sorted(p.name for p in cut.glob("shard-*")) == ["shard-00000.json", "shard-00001.json"]
    assert not [p for p in cut.iterdir() if ".tmp" in p.name]  # nothing half-written
    monkeypatch.setattr(corpus_module, "_write_json", write)
    resumed = open_corpus(decoder, cut, CONFIG, None, 0, resume=True, show=False)  # the plan is read back
    assert resumed.finished() == {0, 1}
    collect(decoder, resumed, CONFIG, show=False)
    assert [{**r, "corpus": None} for r in read_corpus(cut)[1]] == [{**r, "corpus": None} for r in read_corpus(whole)[1]]


def test_resuming_with_another_target_or_into_a_used_folder_is_one_line(decoder, targets, tmp_path):
    folder = tmp_path / "c"
    collect(decoder, open_corpus(decoder, folder, CONFIG, prompts()[:2], 0, False, False), CONFIG, show=False)
    other = SpeculativeDecoder.load(str(targets[1]), "none", backend="torch")
    with pytest.raises(VerispecError, match="collected with another target"):
        open_corpus(other, folder, CONFIG, None, 0, resume=True, show=False)
    with pytest.raises(VerispecError, match="exists and is not empty"):
        open_corpus(decoder, folder, CONFIG, prompts(), 0, resume=False, show=False)
    with pytest.raises(VerispecError, match="does not exist"):
        open_corpus(decoder, tmp_path / "none", CONFIG, None, 0, resume=True, show=False)
    with pytest.raises(VerispecError, match="nothing to collect"):
        open_corpus(decoder, tmp_path / "empty", CONFIG, [], 0, resume=False, show=False)


def test_a_full_disk_is_one_line_and_keeps_the_shards_written(decoder, tmp_path, monkeypatch):
    write = corpus_module.atomic_write_json

    def full(path, obj, **kwargs):
        if path.name == "shard-00001.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, obj, **kwargs)

    monkeypatch.setattr(corpus_module, "atomic_write_json", full)
    folder = tmp_path / "c"
    with pytest.raises(VerispecError, match=r"no space left .* the 1 shard\(s\) written so far are kept"):
        collect(decoder, open_corpus(decoder, folder, CONFIG, prompts(), 0, False, False), CONFIG, show=False)
    assert (folder / "shard-00000.json").is_file() and not (folder / "shard-00001.json").exists()


def test_the_target_writes_prompts_of_its_own_and_they_are_kept_for_a_resume(decoder, tmp_path):
    prefix, end = user_turn_prefix(decoder.target.tokenizer)
    assert prefix == "<s>user: " and end == "\n" or end.strip()
    folder = tmp_path / "c"
    config = CollectConfig(tokens=6, batch=4, shard_size=4, self_prompt_tokens=40)
    try:
        corpus = open_corpus(decoder, folder, config, prompts()[:1], 3, resume=False, show=False)
    except VerispecError as err:  # a random tiny model may write nothing usable: then that is what it says
        assert "wrote no usable prompt" in str(err)
        return
    written = json.loads((folder / "self_prompts.json").read_text())
    assert 1 <= len(written) <= 3 and len({normalized(t) for t in written}) == len(written)
    assert all(usable(t) for t in written)
    assert corpus.manifest["mix"]["items"].get("self:self", 0) + 1 == len(corpus.plan)


def test_prompt_sources(tmp_path):
    spec = tmp_path / "q.jsonl"
    spec.write_text("\n".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"question {i}?"]})
                              for i in range(200, 206)))
    assert [p.text for p in file_prompts(spec)] == ["question 200?", "question 202?", "question 204?"]  # TRAIN only
    text = tmp_path / "p.txt"
    text.write_text("one\n\n two \n")
    assert [p.text for p in file_prompts(text)] == ["one", "two"]
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(VerispecError, match="no prompts in"):
        file_prompts(tmp_path / "blank.txt")
    with pytest.raises(VerispecError, match="not found"):
        file_prompts(tmp_path / "missing.txt")
    files = python_files()
    assert files
    code, prose = code_contexts(files, 5, 0), prose_contexts(files, 5, 0)
    assert len(code) == 5 and len(prose) == 5
    assert all(not p.chat and p.source == "code" and "def " in p.text or "class " in p.text for p in code)
    assert code == code_contexts(files, 5, 0)  # seeded
    assert not usable("aaaa aaaa aaaa aaaa aaaa aaaa aaaa aaaa aaaa aaaa aaaa aaaa aaaa aaaa aaaa aaaa aaaa aaaa aaaa")
    assert not usable("12345 67890 !!! ???") and not usable("hi") and usable("Write a function that sorts a list.")


def test_a_written_request_loses_its_speaker_and_the_answer_the_target_went_on_to_write():
    assert request_text("Q: Why do dogs bark?\n\nA: Dogs bark because") == "Why do dogs bark?"
    assert request_text("**Question:** Sort a list.\n**Answer:** use sorted") == "Sort a list."
    assert request_text("Qwen: fix my boat") == "fix my boat"
    assert request_text("Which is true?\nA. Yes\nB. No") == "Which is true?\nA. Yes\nB. No"  # choices stay
    assert request_text("Solve: 2 + 2") == "Solve: 2 + 2" and request_text("Queue: a list") == "Queue: a list"


def test_the_command_line(targets, tmp_path, capsys):
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("\n".join(PROMPTS[:3]))
    out = tmp_path / "c"
    args = ["collect", "--target", str(targets[0]), "--backend", "torch", "--out", str(out), "--prompts",
            str(prompt_file), "--tokens", "8", "--shard-size", "2", "--batch", "2"]
    assert main(args) == 0
    assert "answer tokens in 2 of 2 shards" in capsys.readouterr().err
    assert main(args) == 2 and "exists and is not empty" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0  # nothing left to do
    assert main(["collect", "--target", str(targets[0]), "--out", str(tmp_path / "d")]) == 2
    assert "nothing to collect" in capsys.readouterr().err
    assert main(["collect", "--out", str(tmp_path / "e"), "--prompts", str(prompt_file), "--batch", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
    for flag in ("--self-prompts", "--code-contexts", "--prose-contexts", "--code-texts", "--prose-texts"):
        assert main(["collect", "--out", str(tmp_path / "f"), flag, "-1"]) == 2
        assert f"{flag} must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "f").exists()


def test_prefill_recomputes_what_collecting_while_decoding_keeps(decoder):
    """A corpus keeps token ids only: one prefill pass over prompt and answer gives the head's features and the
    target's top-k labels that `collect` keeps while it decodes."""
    from verispec.head_training.eagle3_train import EagleTrainConfig
    from verispec.head_training.eagle3_train import collect as collect_while_decoding
    from verispec.head_training.eagle3_train import prefill_samples

    runner = decoder.runner
    config = EagleTrainConfig(tokens=6, top_k=4, window=8)
    prompts = [decoder.encode(text) for text in PROMPTS[:3]]
    aux = (0, 1, 1)
    decoded = collect_while_decoding(runner, prompts, config, aux, show=False, batch_size=1)
    records = [{"prompt": p, "answer": s.tokens[len(p[-config.window:]):].tolist()} for p, s in zip(prompts, decoded)]
    prefilled = prefill_samples(runner, records, config, aux, show=False)
    for a, b in zip(decoded, prefilled):
        assert a.start == b.start and torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.aux.float(), b.aux.float(), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(a.probs, b.probs, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.ids[a.probs > 1e-3], b.ids[a.probs > 1e-3])


def test_train_heads_on_a_corpus(targets, tmp_path, capsys):
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("\n".join(f"tell me about number {i}" for i in range(10)))
    corpus = tmp_path / "corpus"
    assert main(["collect", "--target", str(targets[0]), "--backend", "torch", "--out", str(corpus), "--prompts",
                 str(prompt_file), "--tokens", "10", "--heldout-fraction", "0.3"]) == 0
    head = tmp_path / "head"
    common = ["--tokens", "10", "--draft-vocab", "64", "--intermediate", "32", "--heads", "4", "--kv-heads", "2",
              "--batch-size", "2", "--steps", "20"]
    assert main(["train-heads", "--kind", "eagle3", "--target", str(targets[0]), "--corpus", str(corpus),
                 "--out", str(head), *common]) == 0
    log = json.loads((head / "training.json").read_text())
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert log["val_answers"] == manifest["mix"]["splits"]["heldout"]
    assert log["train_answers"] == manifest["mix"]["splits"]["train"] and log["validation"]
    assert sum(v["answers"] for k, v in log["data"]["mix"].items() if k.startswith("train:")) == log["train_answers"]
    twice = tmp_path / "twice"  # two corpora read as one, an answer both hold counted once
    assert main(["train-heads", "--kind", "eagle3", "--target", str(targets[0]), "--corpus", str(corpus), str(corpus),
                 "--out", str(twice), *common[:-2], "--steps", "1"]) == 0
    assert json.loads((twice / "training.json").read_text())["train_answers"] == log["train_answers"]
    capsys.readouterr()
    for args, fragment in ((["--kind", "eagle3", "--target", str(targets[1]), *common], "holds the answers of"),
                           (["--kind", "medusa", "--target", str(targets[0])], "--corpus trains --kind eagle3"),
                           (["--kind", "eagle3", "--target", str(targets[0]), "--corpus-tokens", "0", *common], ">= 1")):
        assert main(["train-heads", *args, "--corpus", str(corpus), "--out", str(tmp_path / "new")]) == 2
        assert fragment in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_text_passages_are_answered_by_their_own_text_without_decoding(decoder, tmp_path, monkeypatch):
    """A passage's answer is its file's next text (cut to the config's tokens), mixed in with decoded items; a
    folder without usable files gives no passages."""
    code = tmp_path / "src" / "mod.py"
    code.parent.mkdir()
    rng = __import__("random").Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 9))) for _ in range(400)]
    code.write_text("".join(f"def {words[i]}_{i}(value):\n    return value * {i} + len('{' '.join(words[9 * i:9 * i + 9])}')\n\n"
                            for i in range(40)))
    passages = text_passages([code], 3, 0, "code")
    assert len(passages) == 1 and passages[0].category == "code" and passages[0].source == "text"
    assert code.read_text().find(passages[0].text + passages[0].continuation) >= 0  # the file's own text, in order
    assert text_passages([code], 3, 0, "code") == passages  # seeded
    engine_generate = decoder.engine.make_sequences
    asked = []
    monkeypatch.setattr(decoder.engine, "make_sequences", lambda prompts, *a, **k: asked.extend(prompts) or
                        engine_generate(prompts, *a, **k))
    corpus = open_corpus(decoder, tmp_path / "c", CONFIG, prompts()[:2] + passages, 0, resume=False, show=False)
    collect(decoder, corpus, CONFIG, show=False)
    manifest, records = read_corpus(tmp_path / "c")
    text, = [r for r in records if r["mode"] == "text"]
    assert text["answer"] == decoder.encode(passages[0].continuation, chat=False)[: CONFIG.tokens]
    assert text["prompt"] not in asked and len(asked) == 2  # never decoded; the two prompts were
    assert manifest["mix"]["modes"]["text"] == 1 and manifest["mix"]["items"]["text:code"] == 1
    empty = tmp_path / "empty.md"
    empty.write_text("short\n" * 5)
    assert text_passages([empty], 3, 0, "prose") == []


def test_the_feature_store_computes_each_answer_once(decoder, tmp_path, monkeypatch):
    """Features and labels written beside a corpus read back equal, later runs compute only what is missing, a
    damaged file is computed again, and a full disk leaves training going without the store."""
    from verispec.head_training import features
    from verispec.head_training.eagle3_train import EagleTrainConfig, prefill_samples

    runner, config, aux = decoder.runner, EagleTrainConfig(tokens=6, top_k=4, window=8), (0, 1, 1)
    records = [{"prompt": decoder.encode(t), "answer": [5, 6, 7, 8], "corpus": str(tmp_path), "shard": i // 2,
                "slot": i % 2} for i, t in enumerate(PROMPTS[:3])]
    records.append({**records[0], "answer": [], "slot": 1, "shard": 1})  # an empty answer gives no sample
    records[2]["slot"] = 0
    first = features.corpus_samples(runner, records[:2], config, aux, show=False)
    folder = features.store_folder(tmp_path, runner, config, aux)
    assert sorted(p.name for p in folder.iterdir()) == ["shard-00000.pt"]
    computed = []
    real = features.prefill_sample
    monkeypatch.setattr(features, "prefill_sample", lambda r, rec, c: computed.append(rec["slot"]) or real(r, rec, c))
    both = features.corpus_samples(runner, [records[1], records[2], records[0]], config, aux, show=False)
    assert computed == [0]  # only the answer of shard 1 was missing
    direct = prefill_samples(runner, [records[1], records[2], records[0]], config, aux, show=False)
    for a, b in zip(both, direct):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.aux, b.aux) and torch.equal(a.probs, b.probs)
    assert torch.equal(both[2].aux, first[0].aux)
    assert len(features.corpus_samples(runner, records, config, aux, show=False)) == 3
    computed.clear()
    changed = [{**records[1], "answer": [9, 9, 9]}]  # the same slot now holds another answer: computed again
    again = features.corpus_samples(runner, changed, config, aux, show=False)
    assert computed == [1] and again[0].tokens[-3:].tolist() == [9, 9, 9]
    (folder / "shard-00000.pt").write_bytes(b"not a tensor file")
    computed.clear()
    assert len(features.corpus_samples(runner, records[:2], config, aux, show=False)) == 2 and computed == [0, 1]

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(features, "atomic_path", full)
    (folder / "shard-00000.pt").unlink()
    assert len(features.corpus_samples(runner, records[:2], config, aux, show=False)) == 2
    assert not (folder / "shard-00000.pt").exists()
