"""Suffix decoding's text (`SuffixIndex`) and its store of earlier requests' outputs (`OutputStore`), kept apart per
scope (a server's tenant) and in a file written by a background thread (`StoreWriter`), readable by its owner only.
See `verispec.drafters.suffix` for how drafts are made from them.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from verispec.config import SuffixConfig
from verispec.errors import VerispecError

log = logging.getLogger("verispec.suffix")

SEPARATOR = -1  # between documents of one index: never equal to a token, so no match crosses it
# A store file's header. Version 2 names each output's scope; version 1 (written before scopes) is still read,
# every output of it into the shared scope (None): the scope its rows drafted from when it was written.
STORE_FORMAT, STORE_VERSION = "verispec-suffix-store", "2"
READ_VERSIONS = ("1", "2")
STORE_MODE = 0o600  # a store holds requests' outputs: its file (and its temporary file) is its owner's only
WRITE_INTERVAL = 1.0  # seconds at least between the starts of two writes of a store file (more outputs wait, together)
RETRY_INTERVAL = 30.0  # seconds after a failed write before the next try (a flush tries at once)
WRITER_LINGER = 10.0  # seconds an idle writer thread waits for more outputs before it ends (a later one starts anew)
EXIT_FLUSH_SECONDS = 10.0  # at interpreter exit, what is pending gets this long to be written
STORE_INDEX_START = 64  # tokens a scope's index starts with: many scopes of few outputs cost little


class SuffixIndex:
    """Token text (documents one after another) with, for every `key`-token window, the positions that follow it."""

    def __init__(self, key: int, start: int = 1024) -> None:
        self.key = key
        self.buffer = np.empty(max(1, start), dtype=np.int64)  # (capacity,) the text; self.size of it used
        self.size = 0
        self.after: dict[tuple[int, ...], list[int]] = {}  # key window -> positions right after its occurrences

    def append(self, tokens: list[int]) -> None:
        """Add tokens at the end of the last document."""
        if self.size + len(tokens) > self.buffer.size:
            grown = np.empty(max(2 * self.buffer.size, self.size + len(tokens)), dtype=np.int64)
            grown[: self.size] = self.buffer[: self.size]
            self.buffer = grown
        for token in tokens:
            self.buffer[self.size] = token
            self.size += 1
            if self.size >= self.key:
                window = tuple(self.buffer[self.size - self.key : self.size].tolist())
                if SEPARATOR not in window:
                    self.after.setdefault(window, []).append(self.size)

    def add_document(self, tokens: list[int]) -> None:
        """Add a whole document (closed by the separator)."""
        self.append(tokens)
        self.append([SEPARATOR])

    def candidates(self, context: list[int], config: SuffixConfig) -> tuple[np.ndarray, np.ndarray]:
        """(positions, match lengths): where text follows an occurrence of the context's last `key` tokens (the most
        recent `max_candidates`), and how many tokens before each agree with the context's end (<= max_match)."""
        if len(context) < self.key:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        found = self.after.get(tuple(context[-self.key :]))
        if not found:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        positions = np.asarray(found[-config.max_candidates :], dtype=np.int64)  # (P,)
        positions = positions[positions < self.size]  # a continuation must exist
        positions = positions[self.buffer[positions] != SEPARATOR] if positions.size else positions
        if not positions.size:
            return positions, positions
        tail = np.asarray(context[-config.max_match :][::-1], dtype=np.int64)  # (M,) the context's end, last first
        back = positions[:, None] - 1 - np.arange(tail.size)[None, :]  # (P, M) the tokens before each position
        before = np.where(back >= 0, self.buffer[np.clip(back, 0, None)], SEPARATOR - 1)
        agree = before == tail[None, :]  # (P, M)
        lengths = np.where(agree.all(1), tail.size, agree.argmin(1))  # (P,) up to the first disagreement
        return positions, lengths

    def continuation(self, position: int, depth: int) -> list[int]:
        """Up to `depth` tokens from `position`, stopping at the document's end."""
        out = self.buffer[position : min(position + depth, self.size)].tolist()
        return out[: out.index(SEPARATOR)] if SEPARATOR in out else out


class ScopeOutputs:
    """One scope's outputs, oldest first, and their index."""

    __slots__ = ("documents", "tokens", "index")

    def __init__(self, key: int) -> None:
        self.documents: deque[list[int]] = deque()
        self.tokens = 0
        self.index = SuffixIndex(key, STORE_INDEX_START)

    def reindex(self) -> None:
        self.index = SuffixIndex(self.index.key, max(STORE_INDEX_START, self.tokens + len(self.documents)))
        for document in self.documents:
            self.index.add_document(document)


class OutputStore:
    """Earlier requests' outputs, one document each, kept apart by scope (a name the caller gives, a server's
    tenant; None: the shared scope), at most `capacity` tokens over all scopes together.

    Capacity: one bound across scopes, the oldest output dropped first whichever scope holds it (down to three
    quarters of the capacity, the scopes that lost outputs re-indexed from the rest, so a rebuild is paid once per
    many outputs), and a scope left without outputs removed. So memory is bounded by `capacity` however many
    tenants there are (a scope costs its outputs and a small index, and exists only while it holds one), the store
    keeps the most recent outputs as one shared store does, and no scope count needs tuning; the price is that a
    busy tenant's outputs push out a quiet one's sooner (speed only: drafts are never wrong, only rarer).

    Threads: the decoding thread adds and reads the indexes; `snapshot` may be called from any thread (the
    background writer) and copies the outputs' list under `lock`, which `add` holds while it changes them (a
    document, once added, is never changed, so the copy shares them)."""

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self.scopes: dict[str | None, ScopeOutputs] = {}
        self.order: deque[str | None] = deque()  # each document's scope, oldest first
        self.tokens = 0
        self.lock = threading.Lock()

    def add(self, output: list[int], scope: str | None = None) -> None:
        output = list(output[-self.config.capacity :])
        if not output:
            return
        with self.lock:
            outputs = self.scopes.get(scope)
            if outputs is None:
                outputs = self.scopes[scope] = ScopeOutputs(self.config.min_match)
            outputs.documents.append(output)
            outputs.tokens += len(output)
            self.order.append(scope)
            self.tokens += len(output)
            if self.tokens <= self.config.capacity:
                outputs.index.add_document(output)
                return
            touched = {scope}
            while self.tokens > 3 * self.config.capacity // 4 and len(self.order) > 1:
                oldest = self.order.popleft()
                dropped = self.scopes[oldest].documents.popleft()
                self.scopes[oldest].tokens -= len(dropped)
                self.tokens -= len(dropped)
                touched.add(oldest)
            for name in touched:
                if self.scopes[name].documents:
                    self.scopes[name].reindex()
                else:
                    del self.scopes[name]

    def index(self, scope: str | None = None) -> SuffixIndex | None:
        """The index of a scope's outputs (None where it holds none)."""
        outputs = self.scopes.get(scope)
        return None if outputs is None else outputs.index

    def snapshot(self) -> list[tuple[str | None, list[int]]]:
        """Every output with its scope, oldest first (a consistent copy, from any thread)."""
        with self.lock:
            each = {name: iter(outputs.documents) for name, outputs in self.scopes.items()}
            return [(name, next(each[name])) for name in self.order]

    @property
    def documents(self) -> list[list[int]]:
        """Every scope's outputs, oldest first."""
        return [document for _, document in self.snapshot()]

    def scope_documents(self, scope: str | None = None) -> list[list[int]]:
        """One scope's outputs, oldest first."""
        with self.lock:
            outputs = self.scopes.get(scope)
            return [] if outputs is None else list(outputs.documents)

    def save(self, path: Path, tokenizer: dict) -> None:
        """Write a snapshot of the outputs atomically (a kill leaves the previous file), readable by the owner only:
        their tokens end to end, their lengths, each one's scope (a number into the header's "scopes", a JSON list
        of the scope names, null for the shared scope), and a header naming the tokenizer (`tokenizer`: its "name"
        and "sha256") they are ids of. Safe to call from another thread than the one adding."""
        from safetensors.numpy import save_file

        from verispec.atomic import atomic_path

        items = self.snapshot()
        names = list(dict.fromkeys(name for name, _ in items))  # in order of first output
        number = {name: i for i, name in enumerate(names)}
        count = sum(len(d) for _, d in items)
        tokens = np.fromiter((t for _, d in items for t in d), dtype=np.int32, count=count)  # (T,)
        lengths = np.array([len(d) for _, d in items], dtype=np.int64)  # (D,)
        scopes = np.array([number[name] for name, _ in items], dtype=np.int64)  # (D,)
        header = {"format": STORE_FORMAT, "version": STORE_VERSION, "tokenizer": tokenizer["name"],
                  "tokenizer_sha256": tokenizer["sha256"], "scopes": json.dumps(names)}
        with atomic_path(path, mode=STORE_MODE) as tmp:
            save_file({"tokens": tokens, "lengths": lengths, "scopes": scopes}, str(tmp), metadata=header)

    @classmethod
    def load(cls, path: Path, config: SuffixConfig, tokenizer: dict, vocab_size: int) -> OutputStore:
        """A store read from `path`, each output into its scope (a version 1 file's into the shared scope), refused
        in one line where the file is not one, is of another version, is damaged or holds ids of another tokenizer;
        outputs past the capacity are dropped oldest first, as they are while decoding."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="numpy") as f:
                header = f.metadata() or {}
                if header.get("format") != STORE_FORMAT:
                    raise VerispecError(f"{path} is not a suffix store (no '{STORE_FORMAT}' header)")
                tokens, lengths = f.get_tensor("tokens"), f.get_tensor("lengths")
                scopes = f.get_tensor("scopes") if "scopes" in f.keys() else None
        except (SafetensorError, OSError, ValueError, KeyError) as err:
            raise VerispecError(f"{path} is not a readable suffix store ({type(err).__name__}: {err})") from None
        version = header.get("version")
        if version not in READ_VERSIONS:
            raise VerispecError(f"{path} is a suffix store of format version {version}, this verispec reads versions "
                                f"{' and '.join(READ_VERSIONS)}: delete it to start a new one")
        if header.get("tokenizer_sha256") != tokenizer["sha256"]:
            raise VerispecError(f"{path} holds token ids of another tokenizer ('{header.get('tokenizer', '?')}') "
                                f"than the target's ('{tokenizer['name']}'): name another file, or delete it")
        if (tokens.ndim != 1 or lengths.ndim != 1 or (lengths < 1).any() or int(lengths.sum()) != tokens.size
                or (tokens.size and not (0 <= int(tokens.min()) and int(tokens.max()) < vocab_size))):
            raise VerispecError(f"{path} is a damaged suffix store (its lengths and tokens disagree, or ids lie "
                                f"outside the vocabulary of {vocab_size}): delete it to start a new one")
        names = _scope_names(header, scopes, lengths.size) if version != "1" else [None]
        if names is None:
            raise VerispecError(f"{path} is a damaged suffix store (its outputs' scopes do not match the scope "
                                f"names in its header): delete it to start a new one")
        owners = scopes.tolist() if version != "1" else [0] * lengths.size
        store = cls(config)
        documents = np.split(tokens, np.cumsum(lengths)[:-1]) if lengths.size else []
        for document, owner in zip(documents, owners):
            store.add(document.tolist(), names[owner])
        return store


def _scope_names(header: dict, scopes: np.ndarray | None, documents: int) -> list[str | None] | None:
    """A version 2 header's scope names, where they and the outputs' scope numbers agree (else None)."""
    try:
        names = json.loads(header.get("scopes", ""))
    except ValueError:
        return None
    if (not isinstance(names, list) or not all(n is None or isinstance(n, str) for n in names)
            or len(set(names)) != len(names) or scopes is None or scopes.ndim != 1 or scopes.dtype.kind not in "iu"
            or scopes.size != documents
            or (scopes.size and not (0 <= int(scopes.min()) and int(scopes.max()) < len(names)))):
        return None
    return names


class StoreWriter:
    """Writes a store's file off the decoding thread.

    `mark()` (cheap: a counter under a lock) says the store changed. A daemon thread, started by the first mark and
    ending after `WRITER_LINGER` idle seconds (a later mark starts another), then calls `write` (which snapshots the
    store and writes it atomically): at once when the last write is `interval` seconds old, else when it is. Marks
    that come meanwhile coalesce: at most one write in flight and one pending, whatever the number of outputs.

    A write that fails (a full disk, a folder gone) is logged once, a warning naming the file and the error; the
    same kind of failure is not logged again until a write succeeds. The store goes on in memory and the write is
    tried again `retry` seconds later (or at the next flush). `flush(timeout)` writes what is pending now and waits
    for it; `close(timeout)` flushes and ends the thread. At interpreter exit every writer is closed
    (`EXIT_FLUSH_SECONDS` in all)."""

    def __init__(self, path: Path, write: Callable[[], None], interval: float | None = None,
                 retry: float | None = None) -> None:
        self.path = Path(path)
        self.write = write
        self.interval = WRITE_INTERVAL if interval is None else interval
        self.retry = RETRY_INTERVAL if retry is None else retry
        self.writes = 0  # successful writes
        self.failures = 0  # failed ones
        self._cond = threading.Condition()
        self._marked = 0  # changes marked so far
        self._saved = 0  # the marks the last successful write covered
        self._requests = 0  # flushes asked
        self._served = 0  # flushes a write attempt has started for (its snapshot was taken after them)
        self._writing = False
        self._next = 0.0  # monotonic time before which no write starts unless a flush asks
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._warned: set[tuple[type, int | None]] = set()  # kinds of failure logged since the last success
        _WRITERS.add(self)

    @property
    def pending(self) -> bool:
        """Whether changes are marked that no successful write holds yet."""
        with self._cond:
            return self._marked > self._saved

    def mark(self) -> None:
        """The store changed: write it soon (never on the calling thread)."""
        with self._cond:
            self._marked += 1
            self._wake()

    def _wake(self) -> None:  # under self._cond
        if self._thread is None and not self._stopping:
            self._thread = threading.Thread(target=self._run, name=f"suffix-store-writer:{self.path.name}", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Write what is pending now (without waiting for the interval) and wait up to `timeout` seconds for it;
        True when the file holds every change marked before the call."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            target = self._marked
            if self._saved >= target:
                return True
            self._requests += 1
            ticket = self._requests
            self._wake()
            while self._saved < target and (self._served < ticket or self._writing):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return self._saved >= target

    def close(self, timeout: float) -> bool:
        """Flush (see `flush`), then end the thread; a later mark starts another. True when all was written."""
        deadline = time.monotonic() + max(0.0, timeout)
        written = self.flush(timeout)
        with self._cond:
            self._stopping = True
            thread, marked = self._thread, self._marked
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._stopping = False
            if self._thread is not None and not self._thread.is_alive():
                self._thread = None
            if self._marked > marked:
                self._wake()  # marked while closing: written by a new thread
        return written

    def _run(self) -> None:
        idle_since: float | None = None
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        self._thread = None
                        self._cond.notify_all()
                        return
                    now = time.monotonic()
                    if self._marked > self._saved:
                        idle_since = None
                        due = now if self._requests > self._served else self._next
                        if now >= due:
                            break
                        self._cond.wait(due - now)
                    else:
                        idle_since = now if idle_since is None else idle_since
                        if now - idle_since >= WRITER_LINGER:
                            self._thread = None
                            return
                        self._cond.wait(WRITER_LINGER - (now - idle_since))
                taken, self._served, self._writing = self._marked, self._requests, True
            written = self._write_once()
            with self._cond:
                self._writing = False
                if written:
                    self._saved = max(self._saved, taken)
                self._next = time.monotonic() + (self.interval if written else self.retry)
                self._cond.notify_all()

    def _write_once(self) -> bool:
        try:
            self.write()
        except Exception as err:  # a full disk, a folder gone, ...: logged once per kind, the store goes on
            self.failures += 1
            kind = (type(err), getattr(err, "errno", None))
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("suffix store %s: could not write it (%s: %s); drafting goes on from memory, and the "
                            "write is tried again later", self.path, type(err).__name__, err)
            return False
        self.writes += 1
        self._warned.clear()
        return True


_WRITERS: weakref.WeakSet[StoreWriter] = weakref.WeakSet()


@atexit.register
def _close_writers() -> None:
    """At interpreter exit, write what every store has pending (daemon threads still run while atexit does)."""
    deadline = time.monotonic() + EXIT_FLUSH_SECONDS
    for writer in list(_WRITERS):
        writer.close(max(0.0, deadline - time.monotonic()))
