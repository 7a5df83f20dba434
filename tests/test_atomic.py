"""Files that are never half-written (verispec.atomic) and the writers routed through it.

A kill is simulated by raising inside the write (after part of the new content is on disk), by a failing
os.replace or fsync, and once by a real SIGKILL of a writing process. After each, the old file must be
intact and no temporary file left behind. Two writers of one path (threads, processes) must leave one
whole file, never a mix. Offline, seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from verispec import atomic
from verispec.atomic import atomic_dir, atomic_path, atomic_write_bytes, atomic_write_json, atomic_write_text

SRC = str(Path(__file__).resolve().parent.parent / "src")


class Killed(BaseException):
    """A stand-in for a kill: a BaseException, as KeyboardInterrupt and SystemExit are."""


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def half_then_kill(path, data: bytes = b"the first half of a new fi"):
    """What a writer killed mid-write leaves: the start of the new content at `path`, then no more."""
    Path(path).write_bytes(data)
    raise Killed


# ------------------------------------------------------------------ the module itself


def test_writes_replace_the_whole_file_and_leave_no_temporary_file(tmp_path):
    target = tmp_path / "sub" / "f.json"
    atomic_write_bytes(target, b"x" * 10_000)
    atomic_write_text(target, "short")
    assert target.read_text() == "short"
    atomic_write_json(target, {"a": [1, 2]}, indent=1)
    assert json.loads(target.read_text()) == {"a": [1, 2]} and target.read_text().endswith("\n")
    with atomic_path(tmp_path / "arr.npy", keep_suffix=True) as tmp:
        assert tmp.suffix == ".npy" and tmp.parent == tmp_path and str(os.getpid()) in tmp.name
        np.save(tmp, np.arange(5))  # np.save keeps a name that ends in .npy as it is
    assert np.load(tmp_path / "arr.npy").tolist() == [0, 1, 2, 3, 4]
    assert names(tmp_path) == ["arr.npy", "sub"] and names(tmp_path / "sub") == ["f.json"]


def test_a_mode_is_set_exactly_from_the_temporary_file_on_and_the_default_is_unchanged(tmp_path):
    target = tmp_path / "private.bin"
    target.write_bytes(b"old")
    os.chmod(target, 0o644)
    umask = os.umask(0o022)
    try:
        with atomic_path(target, mode=0o600) as tmp:
            assert os.stat(tmp).st_mode & 0o777 == 0o600  # before a byte is written
            tmp.write_bytes(b"new")  # a writer that opens the name keeps its mode
        assert target.read_bytes() == b"new" and os.stat(target).st_mode & 0o777 == 0o600
        os.umask(0)
        atomic_write_bytes(target, b"again", mode=0o600)  # exactly, whatever the umask
        assert os.stat(target).st_mode & 0o777 == 0o600
        atomic_write_bytes(tmp_path / "public.bin", b"x")
        assert os.stat(tmp_path / "public.bin").st_mode & 0o777 == 0o644  # the default, as before
        os.umask(0o022)
        atomic_write_bytes(tmp_path / "public.bin", b"x")
        assert os.stat(tmp_path / "public.bin").st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)
    assert names(tmp_path) == ["private.bin", "public.bin"]


def test_temporary_names_are_unique_per_call_and_carry_the_pid(tmp_path):
    made = {atomic.temp_path(tmp_path / "f.pt") for _ in range(100)}
    assert len(made) == 100
    assert all(p.name.startswith(f".f.pt.{os.getpid()}.") and p.name.endswith(".tmp") for p in made)
    assert not list(tmp_path.glob("*.pt")) and not [p for p in made if p.match("*.pt")]  # a reader's glob skips them


@pytest.mark.parametrize("failure", ["raise inside the write", "os.replace fails", "fsync fails", "KeyboardInterrupt"])
def test_an_interrupted_write_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch, failure):
    target = tmp_path / "state.bin"
    target.write_bytes(b"old complete content")

    def failing(*args, **kwargs):
        raise KeyboardInterrupt if failure == "KeyboardInterrupt" else OSError(28, "No space left on device")

    if failure == "os.replace fails":
        monkeypatch.setattr(atomic.os, "replace", failing)
    elif failure in ("fsync fails", "KeyboardInterrupt"):
        monkeypatch.setattr(atomic.os, "fsync", failing)
    with pytest.raises((Killed, OSError, KeyboardInterrupt)):
        if failure == "raise inside the write":
            with atomic_path(target) as tmp:
                half_then_kill(tmp)
        else:
            atomic_write_bytes(target, b"new content " * 1000)
    assert target.read_bytes() == b"old complete content"
    assert names(tmp_path) == ["state.bin"]


def test_a_sigkilled_writer_leaves_the_old_file_and_the_next_write_sweeps_its_temporary_file(tmp_path):
    target = tmp_path / "table.bin"
    target.write_bytes(b"old")
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {SRC!r})
        from verispec.atomic import atomic_path
        with atomic_path({str(target)!r}) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half of the new")
                f.flush()
                print("writing", flush=True)
                time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    left = [p for p in tmp_path.iterdir() if p != target]
    assert target.read_bytes() == b"old" and len(left) == 1 and f".{child.pid}." in left[0].name
    atomic_write_bytes(target, b"new")  # the dead writer's file is recent: kept (it might be another host's)
    assert left[0].exists()
    old = time.time() - 2 * atomic.STALE_SECONDS
    os.utime(left[0], (old, old))
    atomic_write_bytes(target, b"newer")
    assert names(tmp_path) == ["table.bin"] and target.read_bytes() == b"newer"


def test_two_threads_writing_one_path_never_mix_and_a_reader_sees_only_whole_files(tmp_path):
    target = tmp_path / "shared.bin"
    payloads = [bytes([i]) * (1 << 20) for i in range(4)]  # 1 MiB each, one byte value per writer
    atomic_write_bytes(target, payloads[0])
    errors, seen, done = [], set(), threading.Event()

    def write(i: int) -> None:
        try:
            for _ in range(8):
                atomic_write_bytes(target, payloads[i])
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def read() -> None:
        while not done.is_set():
            data = target.read_bytes()
            seen.add(data[:1])
            if data not in payloads:
                errors.append(AssertionError(f"a mixed or partial file of {len(data)} bytes"))

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    reader.join()
    assert not errors, errors[:3]
    assert target.read_bytes() in payloads and names(tmp_path) == ["shared.bin"]


def test_two_processes_writing_one_path_leave_one_whole_file(tmp_path):
    target = tmp_path / "shared.json"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {SRC!r})
        from verispec.atomic import atomic_write_json
        for i in range(30):
            atomic_write_json({str(target)!r}, {{"writer": sys.argv[1], "i": i, "pad": sys.argv[1] * 200_000}})
    """)
    children = [subprocess.Popen([sys.executable, "-c", script, w]) for w in "ab"]
    assert [c.wait(60) for c in children] == [0, 0]
    data = json.loads(target.read_text())
    assert data["i"] == 29 and data["pad"] == data["writer"] * 200_000
    assert names(tmp_path) == ["shared.json"]


def test_a_folder_is_swapped_in_whole_or_not_at_all(tmp_path):
    out = tmp_path / "head"
    with atomic_dir(out) as folder:
        (folder / "a").write_text("1")
    with pytest.raises(Killed), atomic_dir(out) as folder:  # a second build, killed half-way
        (folder / "a").write_text("2")
        raise Killed
    assert names(out) == ["a"] and (out / "a").read_text() == "1" and names(tmp_path) == ["head"]
    with atomic_dir(out) as folder:  # replaces a non-empty folder
        (folder / "b").write_text("3")
    assert names(out) == ["b"] and names(tmp_path) == ["head"]


def test_folders_built_by_threads_at_once_end_as_one_writers_folder(tmp_path):
    out = tmp_path / "cache"
    errors = []

    def build(i: int) -> None:
        try:
            for _ in range(10):
                with atomic_dir(out) as folder:
                    for name in "xyz":
                        (folder / name).write_text(str(i))
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert names(out) == ["x", "y", "z"] and len({(out / n).read_text() for n in "xyz"}) == 1
    assert names(tmp_path) == ["cache"]


# ------------------------------------------------------------------ the writers routed through it


def test_head_training_keeps_its_answers_and_checkpoint_when_saving_the_head_fails(tmp_path):
    """Before: Partial.finish emptied OUT.partial first, so a failure while saving the head lost the answers
    and the training. Now the head is built aside, and OUT.partial goes only once OUT is in place."""
    from types import SimpleNamespace

    from conftest import tiny_model

    from verispec.head_training.common import Partial
    from verispec.models.heads.medusa import MedusaHeads

    out = tmp_path / "heads"
    answers = [{"ids": torch.arange(5)}, {"ids": torch.arange(3)}]
    heads = MedusaHeads(2, 1, 32, 64)
    optimizer = torch.optim.AdamW(heads.parameters())
    partial = Partial(out, resume=False)
    assert partial.answers(lambda: answers) == answers
    partial.checkpoint(heads, optimizer, 100)
    runner = SimpleNamespace(model=tiny_model())

    def broken_save(folder):
        heads.save(folder)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        partial.finish(broken_save, runner, "tiny", {"steps": 100})
    assert not out.exists() and names(tmp_path) == ["heads.partial"]
    again = Partial(out, resume=True)
    assert [a["ids"].tolist() for a in again.answers(lambda: pytest.fail("collected again"))] == [[0, 1, 2, 3, 4], [0, 1, 2]]
    assert again.checkpoint_to_resume(200)["step"] == 100
    again.finish(heads.save, runner, "tiny", {"steps": 200})
    assert names(tmp_path) == ["heads"]
    assert names(out) == ["config.json", "manifest.json", "medusa_lm_head.safetensors", "training.json"]


def test_a_checkpoint_write_killed_mid_way_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    from verispec.head_training import common
    from verispec.head_training.common import Partial
    from verispec.models.heads.medusa import MedusaHeads

    heads = MedusaHeads(1, 1, 16, 32)
    optimizer = torch.optim.SGD(heads.parameters(), lr=0.1)
    partial = Partial(tmp_path / "out", resume=False)
    partial.answers(lambda: [])
    partial.checkpoint(heads, optimizer, 100)
    monkeypatch.setattr(common.torch, "save", lambda obj, path: half_then_kill(path))
    with pytest.raises(Killed):
        partial.checkpoint(heads, optimizer, 200)
    monkeypatch.undo()
    assert names(tmp_path / "out.partial") == ["answers.pt", "checkpoint.pt"]
    assert Partial(tmp_path / "out", resume=True).checkpoint_to_resume(300)["step"] == 100


def test_an_ngram_table_write_killed_mid_way_keeps_the_old_table(tmp_path, monkeypatch):
    import safetensors.numpy

    from test_ngram import table_from
    from verispec.ngram.table import NGramTable

    path = tmp_path / "t.ngram"
    table_from([[1, 2, 3, 1, 2, 4]]).save(path)
    monkeypatch.setattr(safetensors.numpy, "save_file", lambda tensors, filename, metadata=None: half_then_kill(filename))
    with pytest.raises(Killed):
        table_from([[5, 6, 7]]).save(path)
    monkeypatch.undo()
    assert NGramTable.load(path).continuations((1,))[0].tolist() == [2]
    assert names(tmp_path) == ["t.ngram"]


def test_a_distilled_draft_export_killed_mid_way_keeps_the_old_draft(tmp_path, monkeypatch):
    import safetensors.torch

    from test_distill import mapped_draft
    from verispec.models.distilled import load_distilled, save_distilled

    shape, model, vocab = mapped_draft([0, 1, 2, 3], 8)
    out = save_distilled(tmp_path / "draft", shape, model, vocab, {"target": "x"})
    real, calls = safetensors.torch.save_file, []

    def second_file_killed(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:  # the weights are written, the vocabulary is not
            half_then_kill(filename)
        real(tensors, filename, metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", second_file_killed)
    _, other, _ = mapped_draft([0, 2, 4, 6], 8, seed=1)
    with pytest.raises(Killed):
        save_distilled(out, shape, other, vocab, {"target": "y"})
    monkeypatch.undo()
    loaded, loaded_vocab, manifest = load_distilled(out)  # every sha256 still matches: the old draft, whole
    assert manifest["target"] == "x" and loaded_vocab.to_target.tolist() == [0, 1, 2, 3]
    assert names(tmp_path) == ["draft"]


def test_the_distill_vocabulary_is_written_atomically_and_a_damaged_one_is_chosen_again(tmp_path, monkeypatch):
    from verispec.cli import distill as cli

    vocab_file = tmp_path / "vocab.pt"
    chosen = torch.tensor([0, 3, 5])
    assert cli.draft_vocabulary(vocab_file, True, lambda: chosen).tolist() == [0, 3, 5]
    assert cli.draft_vocabulary(vocab_file, True, lambda: pytest.fail("chosen again")).tolist() == [0, 3, 5]
    monkeypatch.setattr(cli.torch, "save", lambda obj, path: half_then_kill(path))
    with pytest.raises(Killed):
        cli.draft_vocabulary(vocab_file, False, lambda: torch.tensor([1, 2]))
    monkeypatch.undo()
    assert torch.load(vocab_file, weights_only=True).tolist() == [0, 3, 5] and names(tmp_path) == ["vocab.pt"]
    vocab_file.write_bytes(vocab_file.read_bytes()[:40])  # truncated by an older, in-place writer
    assert cli.draft_vocabulary(vocab_file, True, lambda: chosen).tolist() == [0, 3, 5]
    assert torch.load(vocab_file, weights_only=True).tolist() == [0, 3, 5]


def _skip_file(path):
    from verispec.models.skip import SkipFile, SkipSet

    SkipFile(SkipSet(4, frozenset({1})), "tiny", {"layers": 4}).save(path)


def _bench_json(path):
    from verispec.bench.results import write_json

    write_json(path, {"runs": [1, 2, 3]})


def _distill_json(path):
    from verispec.distill.data import write_json

    write_json(path, {"done": [1, 2]})


def _shard(path):
    from verispec.distill.data import Record, save_shard

    save_shard(path, [Record.unlabelled([1, 2, 3])])


def _trace(path):
    from verispec.trace import save_trace

    save_trace(path, {"format": "verispec-trace", "steps": []})


def _manifest(path):
    from types import SimpleNamespace

    from verispec.models.heads import shipped as heads

    gguf = SimpleNamespace(config=SimpleNamespace(layers=1, hidden=8, vocab=8),
                           embed=SimpleNamespace(take_rows=lambda ids: np.zeros((len(ids), 8), np.float32)))
    heads.write_manifest(path.parent, SimpleNamespace(gguf=gguf))


def _checkpoint(path):  # path: OUT.partial/checkpoint.pt
    from verispec.head_training.common import Partial
    from verispec.models.heads.medusa import MedusaHeads

    heads = MedusaHeads(1, 1, 8, 16)
    out = path.parent.with_name(path.parent.name.removesuffix(".partial"))
    Partial(out, resume=False).checkpoint(heads, torch.optim.SGD(heads.parameters(), lr=0.1), 1)


WRITERS = {  # writer(path): the file it writes (relative to a fresh folder), and the fixed temporary name it used
    "skip file": (_skip_file, "skip.json", "skip.json.tmp"),
    "bench.json": (_bench_json, "bench.json", "bench.json.tmp"),
    "distill json": (_distill_json, "meta.json", None),
    "distill shard": (_shard, "shard_00000.safetensors", "shard_00000.partial"),
    "trace": (_trace, "trace.json", None),
    "head manifest": (_manifest, "head/manifest.json", None),
    "heads checkpoint": (_checkpoint, "out.partial/checkpoint.pt", "out.partial/checkpoint.pt.tmp"),
}


@pytest.mark.parametrize("name", list(WRITERS))
def test_each_writer_keeps_the_old_file_when_its_rename_fails(tmp_path, monkeypatch, name):
    write, relative, _ = WRITERS[name]
    target = tmp_path / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"old")

    def failing(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", failing)
    monkeypatch.setattr(Path, "replace", failing)
    with pytest.raises(Exception):  # noqa: B017 - an OSError, or one VerispecError line naming the file
        write(target)
    assert target.read_bytes() == b"old" and names(target.parent) == [target.name]


@pytest.mark.parametrize("name", [n for n, (_, _, fixed) in WRITERS.items() if fixed])
def test_no_writer_uses_a_fixed_temporary_name_another_writer_could_hold(tmp_path, name):
    """Before: 'X.tmp' / 'X.partial': a second writer truncated the first one's file, or renamed it away."""
    write, relative, fixed = WRITERS[name]
    other = tmp_path / fixed
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_bytes(b"another writer's file, half written")
    write(tmp_path / relative)
    assert other.read_bytes() == b"another writer's file, half written"
    assert (tmp_path / relative).stat().st_size > 0


def test_every_torch_load_in_the_package_is_weights_only():
    """torch.load without weights_only=True unpickles arbitrary code (and torch < 2.6 could be tricked even
    with it: pyproject requires torch >= 2.6)."""
    import ast

    root = Path(SRC) / "verispec"
    offenders = []
    for file in root.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    offenders.append(f"{file.relative_to(root)}:{node.lineno}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                offenders += [f"{file.relative_to(root)}:{node.lineno} imports {m}" for m in modules
                              if m.split(".")[0] in ("pickle", "dill", "cloudpickle")]
    assert not offenders, offenders
    text = (Path(SRC).parent / "pyproject.toml").read_text()
    assert '"torch>=2.6"' in text
    pin = (Path(SRC).parent / "scripts" / "setup.sh").read_text()
    major, minor = (int(x) for x in pin.split('"torch==')[1].split(".")[:2])
    assert (major, minor) >= (2, 6)
