"""A head's training corpus at scale: the target's own answers, collected on this machine and kept as token ids.

`verispec collect` writes a folder:

    manifest.json       who answered (the target's name and fingerprint, the tokenizer's digest), the config, the
                        plan's mix (items and prompt tokens by source and category, split), the progress (shards,
                        answer tokens by category and split, tokens per second)
    plan.json           every item to answer, in order: prompt ids, source, category, mode (greedy or sampled at
                        the config's temperature, or text: a passage whose answer is its own next text, kept in the
                        item as "text"), split (train / heldout, by a hash of the prompt), seed
    self_prompts.json   the prompts the target wrote for itself (kept while the plan is being built)
    shard-00000.json    answers to items 0 .. shard_size - 1, then the next shard, ...

Hidden states are not kept (3 x 1536 floats a token for the default target, 9 KB): training recomputes them with
prefill passes over prompt + answer, so a million answer tokens take a few MB. The target answers in a
continuously refilled ragged batch (`verispec.batch.DecodeBatch`: a finished row's place goes to the next item),
`batch` rows per pass. Every file is written whole or not at all (`verispec.atomic`); `--resume` goes on from the
last complete shard of a folder collected from the same target and tokenizer, and the plan is never built twice.
"""

from __future__ import annotations

import errno
import hashlib
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from verispec.atomic import atomic_write_json
from verispec.config import SamplingConfig, SpecConfig
from verispec.console import notice, progress
from verispec.errors import VerispecError
from verispec.head_training.sources import Prompt, normalized, request_text, usable, user_turn_prefix

MANIFEST, PLAN, SELF_PROMPTS = "manifest.json", "plan.json", "self_prompts.json"
FORMAT = "verispec-head-corpus"


@dataclass(frozen=True)
class CollectConfig:
    """Attributes: tokens (the longest answer), batch (rows answered together), shard_size (answers per shard),
    sampled (the fraction of items answered by sampling rather than greedily), temperature (of those), top_p,
    max_prompt (prompt tokens at most: longer prompts are left out), heldout_fraction (items kept out of training,
    for the learning curve), self_prompt_tokens (the longest prompt the target writes), seed."""

    tokens: int = 256
    batch: int = 16
    shard_size: int = 64
    sampled: float = 0.5
    temperature: float = 0.7
    top_p: float = 0.95
    max_prompt: int = 1024
    heldout_fraction: float = 0.05
    self_prompt_tokens: int = 96
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.batch < 1 or self.shard_size < 1 or self.max_prompt < 1:
            raise VerispecError("collect needs tokens, batch, shard_size and max_prompt of at least 1")
        if not 0 <= self.sampled <= 1 or not 0 <= self.heldout_fraction < 1:
            raise VerispecError("collect needs 0 <= sampled <= 1 and 0 <= heldout_fraction < 1")
        if not self.temperature > 0 or not 0 < self.top_p <= 1 or self.self_prompt_tokens < 8:
            raise VerispecError("collect needs temperature > 0, 0 < top_p <= 1 and self_prompt_tokens >= 8")


def identity(decoder) -> dict:
    """Who answers: the target's name, its fingerprint (a probe of its embedding) and its tokenizer's digest."""
    from verispec.models.skip import fingerprint

    tok = decoder.target.tokenizer
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps([vocab, getattr(tok, "chat_template", None)]).encode()).hexdigest()[:16]
    return {"target": decoder.target.name, "target_fingerprint": fingerprint(decoder.runner), "tokenizer": digest}


def foreign(theirs: dict, who: dict) -> str | None:
    """What differs between the identity a corpus records and `who` ("target" or "tokenizer"), or None."""
    for key, what in (("target_fingerprint", "target"), ("tokenizer", "tokenizer")):
        if theirs.get(key) != who[key]:
            return what
    return None


def tally_key(item: dict) -> str:
    """How answers are counted (the manifest's progress, a head's training.json): split, source and category."""
    return f"{item['split']}:{item['source']}:{item['category']}"


def _write_json(path: Path, obj, done: int = 0) -> None:
    """atomic_write_json, with a full disk said in one line (what is written so far stays)."""
    try:
        atomic_write_json(path, obj)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise VerispecError(f"no space left on the device writing {path}: the {done} shard(s) written so far are "
                                "kept; free some space and run again with --resume") from None
        raise


class Corpus:
    """The folder: opened fresh (it must not hold anything yet) or resumed (it must be this target's)."""

    def __init__(self, folder: Path, who: dict, resume: bool) -> None:
        self.folder, self.who = Path(folder), who
        manifest = self.folder / MANIFEST
        if resume:
            if not manifest.is_file():
                raise VerispecError(f"--resume: {manifest} does not exist (nothing to go on from)")
            try:
                self.manifest = json.loads(manifest.read_text())
            except (OSError, ValueError) as err:
                raise VerispecError(f"--resume: {manifest} cannot be read ({err})") from None
            if self.manifest.get("format") != FORMAT:
                raise VerispecError(f"--resume: {self.folder} is not a corpus that verispec collect wrote")
            theirs = self.manifest.get("identity", {})
            what = foreign(theirs, who)
            if what is not None:
                raise VerispecError(f"--resume: {self.folder} was collected with another {what} "
                                    f"({theirs.get('target', '?')}); its answers cannot be this one's: "
                                    "collect into a new --out")
        else:
            if self.folder.exists() and (not self.folder.is_dir() or any(self.folder.iterdir())):
                raise VerispecError(f"--out {self.folder} exists and is not empty; name a new folder or pass --resume")
            self.folder.mkdir(parents=True, exist_ok=True)
            self.manifest = {"format": FORMAT, "identity": who}
            self.save()

    def save(self, done: int = 0) -> None:
        _write_json(self.folder / MANIFEST, self.manifest, done)

    def read(self, name: str):
        path = self.folder / name
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def shard_path(self, index: int) -> Path:
        return self.folder / f"shard-{index:05d}.json"

    def finished(self) -> set[int]:
        """Indices of the shards complete on disk (a damaged one is collected again)."""
        done = set()
        for i in range(self.shards):
            data = self.read(self.shard_path(i).name)
            if data is not None and len(data.get("answers", [])) == len(self.items(i)):
                done.add(i)
        return done

    @property
    def shards(self) -> int:
        return -(-len(self.plan) // self.shard_size)

    def items(self, shard: int) -> list[dict]:
        return self.plan[shard * self.shard_size : (shard + 1) * self.shard_size]


# --- the plan ------------------------------------------------------------------------------------------

def self_prompts(decoder, count: int, config: CollectConfig, corpus: Corpus, avoid: set[str],
                 show: bool = True) -> list[str]:
    """`count` prompts the target writes itself (sampled from its chat template's user turn), kept in the corpus
    as they come, so that a resumed run goes on where this one stopped."""
    kept: list[str] = list(corpus.read(SELF_PROMPTS) or [])
    if len(kept) >= count:
        return kept[:count]
    prefix, end = user_turn_prefix(decoder.target.tokenizer)
    from verispec.chat import chat_text_ids

    prefix_ids = chat_text_ids(decoder.target.tokenizer, prefix)
    seen = set(avoid) | {normalized(t) for t in kept}
    spec = SpecConfig(max_new_tokens=config.self_prompt_tokens, stop=(end,) if end.strip() else (), stop_at_eos=True)
    sampling = SamplingConfig(temperature=1.0, top_p=config.top_p)
    tries, seed = 0, config.seed * 1_000_003 + 7 + len(kept) * 17
    most = 20 * count + 5 * config.batch  # tries before giving up
    with progress("the target writes prompts of its own", count, show) as advance:
        advance(len(kept))
        while len(kept) < count:
            if tries >= most and not kept:
                raise VerispecError(f"the target wrote no usable prompt in {tries} tries (--self-prompts): its chat "
                                    "template's user turn does not lead it to write requests")
            if tries >= most:
                notice(f"the target wrote {len(kept)} usable prompts in {tries} tries; going on with those")
                break
            group = config.batch
            seqs = decoder.engine.generate([prefix_ids] * group, sampling, spec, seeds=seed + tries)
            tries += group
            for seq in seqs:
                text = decoder.decode(seq.generated)
                text = text[: seq.text_end] if seq.text_end is not None else text
                text = request_text(text.split(end)[0] if end.strip() else text)
                key = normalized(text)
                if usable(text) and key not in seen and len(kept) < count:
                    seen.add(key)
                    kept.append(text)
                    advance()
            _write_json(corpus.folder / SELF_PROMPTS, kept)
    return kept


def build_plan(decoder, prompts: list[Prompt], config: CollectConfig) -> tuple[list[dict], dict]:
    """Every prompt as an item to answer (mode, split and seed drawn from the config's seed); and the mix."""
    rng = random.Random(config.seed)
    items, too_long = [], Counter()
    seen: set[str] = set()
    for prompt in prompts:
        key = normalized(prompt.text)
        if key in seen:
            continue
        seen.add(key)
        ids = decoder.encode(prompt.text, chat=None if prompt.chat else False)  # the template where the target has one
        mode = "sampled" if rng.random() < config.sampled else "greedy"
        if not ids or len(ids) > config.max_prompt:
            too_long[prompt.source] += 1
            continue
        held = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 16**8 < config.heldout_fraction
        item = {"prompt": ids, "source": prompt.source, "category": prompt.category, "mode": mode,
                "split": "heldout" if held else "train", "seed": config.seed * 1_000_003 + len(items)}
        if prompt.continuation is not None:  # a text passage: its answer is its own next text
            item.update(mode="text", text=decoder.encode(prompt.continuation, chat=False)[: config.tokens])
            if not item["text"]:
                continue
        items.append(item)
    if not items:
        raise VerispecError("no prompt is left to answer (each was empty, a duplicate, or longer than --max-prompt "
                            f"{config.max_prompt} tokens)")
    mix = {"items": dict(Counter(f"{i['source']}:{i['category']}" for i in items)),
           "splits": dict(Counter(i["split"] for i in items)),
           "modes": dict(Counter(i["mode"] for i in items)),
           "prompt_tokens": sum(len(i["prompt"]) for i in items),
           "left_out_too_long": dict(too_long)}
    return items, mix


# --- answering ---------------------------------------------------------------------------------------

def collect(decoder, corpus: Corpus, config: CollectConfig, show: bool = True) -> dict:
    """Answer every item of the plan not yet in a shard; returns the progress written to the manifest.

    One ragged batch runs across shard boundaries: the next shard's items join as rows finish, and a shard is
    written as soon as its last answer is in (shards may complete out of order; a resume reads which did). A batch
    drained at every shard's end would run its last rows nearly alone."""
    from verispec.batch import DecodeBatch

    engine = decoder.engine
    done = corpus.finished()
    todo = [i for i in range(corpus.shards) if i not in done]
    total_tokens = dict(corpus.manifest.get("progress", {}).get("answer_tokens", {}))
    answers = {index: [None] * len(corpus.items(index)) for index in todo}
    left = {index: len(answers[index]) for index in todo}  # answers still missing per shard
    remaining = sum(left.values())
    began, new_tokens = time.perf_counter(), 0
    if done:
        notice(f"resuming: {len(done)} of {corpus.shards} shards are complete, {remaining} answers to go")

    def answered(index: int, k: int, answer: list[int]) -> None:
        answers[index][k] = answer
        left[index] -= 1
        advance()
        if left[index]:
            return
        for item, tokens in zip(corpus.items(index), answers[index]):
            key = tally_key(item)
            total_tokens[key] = total_tokens.get(key, 0) + len(tokens)
        _write_json(corpus.shard_path(index), {"shard": index, "answers": answers[index]}, len(done))
        done.add(index)
        seconds = time.perf_counter() - began
        corpus.manifest["progress"] = {
            "shards_done": len(done), "shards": corpus.shards, "answer_tokens": total_tokens,
            "answer_tokens_total": sum(total_tokens.values()),
            "tokens_per_second_this_run": round(new_tokens / max(seconds, 1e-9), 1)}
        corpus.save(len(done))
        notice(f"shard {index + 1}/{corpus.shards}: {sum(len(a) for a in answers.pop(index))} answer tokens; "
               f"{new_tokens / max(seconds, 1e-9):.1f} decoded tokens/s this run")

    with progress("the target answers", remaining, show) as advance:
        queue = []
        for index in todo:
            for k, item in enumerate(corpus.items(index)):
                if item["mode"] == "text":  # nothing to decode: the passage's own text is the answer
                    answered(index, k, list(item["text"]))
                else:
                    queue.append((index, k))
        queue.reverse()  # popped from the end: plan order
        batch = DecodeBatch(engine)
        rows: dict[int, tuple[int, int]] = {}  # id(sequence) -> (shard, item)

        def refill(batch: DecodeBatch) -> bool:
            """Between steps: queued items join while rows are free; False once every item is answered."""
            joining = []
            while queue and len(batch) + len(joining) < config.batch:
                index, k = queue.pop()
                item = corpus.items(index)[k]
                sampling = (SamplingConfig(temperature=config.temperature, top_p=config.top_p)
                            if item["mode"] == "sampled" else SamplingConfig(temperature=0))
                room = min(config.tokens, engine.context_window - len(item["prompt"]) - 1)
                seq, = engine.make_sequences([item["prompt"]], sampling, SpecConfig(max_new_tokens=max(1, room)),
                                             [item["seed"]])
                rows[id(seq)] = (index, k)
                joining.append(seq)
            batch.add(joining)
            return bool(batch)

        for results in engine.run(batch, refill):
            for _, seq in results:
                if seq.finish_reason is None:
                    continue
                index, k = rows.pop(id(seq))
                if seq.error is not None:
                    raise VerispecError(f"the target failed answering item {index * corpus.shard_size + k}:"
                                        f" {type(seq.error).__name__}: {seq.error}") from seq.error
                new_tokens += len(seq.generated)
                answered(index, k, list(seq.generated))
    return corpus.manifest.get("progress", {})


def open_corpus(decoder, folder: Path, config: CollectConfig, prompts: list[Prompt] | None, self_count: int,
                resume: bool, show: bool = True) -> Corpus:
    """Open or resume the corpus and make sure it has its plan (built once, then read back on every resume)."""
    corpus = Corpus(folder, identity(decoder), resume)
    saved = corpus.read(PLAN)
    if saved is not None:
        corpus.plan, corpus.shard_size = saved["items"], int(saved["shard_size"])
        return corpus
    if resume and "config" in corpus.manifest:
        config = CollectConfig(**corpus.manifest["config"])  # the plan is built with the config it started with
    corpus.manifest["config"] = asdict(config)
    corpus.save()
    prompts = list(prompts or [])
    if self_count:
        written = self_prompts(decoder, self_count, config, corpus, {normalized(p.text) for p in prompts}, show)
        prompts += [Prompt(text, True, "self", "self") for text in written]
    if not prompts:
        raise VerispecError("nothing to collect: give --prompts, --self-prompts, --code-contexts, --prose-contexts, "
                            "--code-texts or --prose-texts")
    items, mix = build_plan(decoder, prompts, config)
    corpus.plan, corpus.shard_size = items, config.shard_size
    _write_json(corpus.folder / PLAN, {"shard_size": config.shard_size, "items": items})
    corpus.manifest["mix"] = mix
    corpus.save()
    return corpus


def read_corpus(folder: Path) -> tuple[dict, list[dict]]:
    """(manifest, records) of a collected corpus: one record per answered item, its plan entry plus "answer" and
    where it is kept ("corpus" the folder, "shard", "slot" its place in the shard)."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        plan = json.loads((folder / PLAN).read_text())
    except (OSError, ValueError) as err:
        raise VerispecError(f"{folder} is not a complete corpus (verispec collect): {err}") from None
    size, items = int(plan["shard_size"]), plan["items"]
    records = []
    for index in range(-(-len(items) // size)):
        path = folder / f"shard-{index:05d}.json"
        if not path.is_file():
            continue
        answers = json.loads(path.read_text())["answers"]
        records += [{**item, "answer": answer, "corpus": str(folder), "shard": index, "slot": slot}
                    for slot, (item, answer) in enumerate(zip(items[index * size :], answers))]
    if not records:
        raise VerispecError(f"{folder} holds no answers yet: run verispec collect (with --resume) first")
    return manifest, records
