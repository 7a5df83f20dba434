"""A lean GGUF reader: the metadata's scalars and strings, the tensor table, and one tensor's bytes at a time.

Why not gguf's `GGUFReader`: it builds numpy views for every element of every array field, and the Qwen
target's vocabulary and merges are 151,936 + 151,387 strings: 7.1 s and +500 MB per parse, measured here,
for values the runner never reads (transformers reads the tokenizer itself). Arrays are skipped here
(their length only is kept), and each tensor is read into a buffer of its own, so the file is never
mapped as a whole: a repacked tensor's source pages do not stay in the resident set.

Format (GGUF v2/v3): magic, version, tensor count, key/value count; key/value pairs; tensor infos
(name, dims, type, offset); data aligned to `general.alignment` (default 32).

Every way a file can be damaged is one VerispecError line naming the file and what is wrong, never another
exception: truncation at any offset, counts and lengths larger than the file could hold, an alignment that
is not a power of two, arrays nested deeper than `MAX_NESTING`, unknown value or tensor types, keys and
strings that are not UTF-8, duplicate keys or tensors, tensors of more than 4 dimensions, past the file's
end or off the alignment. (Strings inside arrays, e.g. a vocabulary, are skipped without being decoded.)
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verispec.errors import VerispecError

# value type -> struct format (None: string, array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays of ... (llama.cpp accepts none; gguf-py writes them)
SMALL_ARRAY = 4096  # an array of numbers up to this long is read as its values (a flag per layer), a longer one (a
# vocabulary's scores) as its length
_MIN_FIELD_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8  # name length, dimension count, type, offset
_MIN_ITEM_BYTES = {_STRING: 8, _ARRAY: 4 + 8}  # an array's item: its smallest encoding
INTEGER_KINDS = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
FLOAT_KINDS = frozenset({6, 12})


def shown(value, limit: int = 60) -> str:
    """A name or value from the file, fit for a one-line message: control characters escaped, cut to `limit`."""
    text = value if isinstance(value, str) else repr(value)
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    qtype: int
    offset: int  # from the file's start
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class GGUFFile:
    """fields: key -> scalar or str (an array of up to SMALL_ARRAY numbers: a tuple of them; other arrays: their
    length); kinds: key -> its GGUF value type (4: uint32, 8: string,
    9: array, ...). tensors: name -> TensorInfo."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                self._buf = f.read(min(size, 1 << 20))
                self._file, self._pos, self._size = f, 0, size
                infos, start = self._parse_header()
        except VerispecError:
            raise
        except OSError as err:
            raise VerispecError(f"{self.path}: cannot be read ({err.strerror or err})") from None
        except (struct.error, ValueError, OverflowError, MemoryError, RecursionError) as err:
            raise self._damaged(f"{type(err).__name__}: {err}") from None
        finally:
            self.__dict__.pop("_buf", None)
            self.__dict__.pop("_file", None)
        self.tensors = self._tensor_table(infos, start, size)
        self.asked: set[str] = set()  # the tensors a loader looked for (`model._refuse_unread`)

    def _damaged(self, what: str) -> VerispecError:
        """One line: the file, what is wrong with it."""
        what = " ".join(str(what).split())[:200]
        return VerispecError(f"{self.path}: not a readable GGUF file ({what}); the file is damaged or truncated")

    def _parse_header(self) -> tuple[list, int]:
        if self._take(4) != b"GGUF":
            raise VerispecError(f"{self.path}: not a GGUF file (no GGUF magic)")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise VerispecError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_fields = self._scalar("<Q"), self._scalar("<Q")
        if n_fields * _MIN_FIELD_BYTES > self._left() or n_tensors * _MIN_TENSOR_BYTES > self._left():
            raise self._damaged(f"header counts {n_fields} metadata keys and {n_tensors} tensors, more than "
                                f"its {self._size} bytes can hold")
        self.fields: dict[str, object] = {}
        self.kinds: dict[str, int] = {}
        for _ in range(n_fields):
            key = self._string("a metadata key")
            if key in self.fields:
                raise self._damaged(f"metadata key '{shown(key)}' appears twice")
            self.kinds[key] = self._scalar("<I")
            self.fields[key] = self._value(self.kinds[key], key, 0)
        infos = []
        for _ in range(n_tensors):
            name = self._string("a tensor name")
            n_dims = self._scalar("<I")
            if n_dims > MAX_DIMS:
                raise self._damaged(f"tensor '{shown(name)}' has {n_dims} dimensions (at most {MAX_DIMS})")
            dims = tuple(self._scalar("<Q") for _ in range(n_dims))
            infos.append((name, dims, self._scalar("<I"), self._scalar("<Q")))
        alignment = self.fields.get("general.alignment", 32)
        if self.kinds.get("general.alignment", 4) not in INTEGER_KINDS or alignment <= 0 or alignment & (alignment - 1):
            raise self._damaged(f"metadata 'general.alignment' is {shown(alignment)}, not a power of two")
        return infos, (self._pos + alignment - 1) // alignment * alignment

    def _tensor_table(self, infos: list, start: int, size: int) -> dict[str, TensorInfo]:
        from gguf import GGML_QUANT_SIZES

        alignment = int(self.fields.get("general.alignment", 32))
        tensors: dict[str, TensorInfo] = {}
        for name, dims, qtype, offset in infos:
            if name in tensors:
                raise self._damaged(f"tensor '{shown(name)}' appears twice")
            if qtype not in GGML_QUANT_SIZES:
                raise VerispecError(f"{self.path}: tensor '{shown(name)}' has an unknown type id {qtype}")
            per_block, block_bytes = GGML_QUANT_SIZES[qtype]
            elements = math.prod(dims)
            if dims and dims[0] % per_block:
                raise self._damaged(f"tensor '{shown(name)}' has rows of {dims[0]} values, not a multiple of its "
                                    f"type's block of {per_block}")
            nbytes = elements // per_block * block_bytes
            if offset % alignment:
                raise self._damaged(f"tensor '{shown(name)}' starts at offset {offset}, off the alignment of {alignment}")
            if start + offset + nbytes > size:
                raise VerispecError(f"{self.path}: tensor '{shown(name)}' ends past the end of the file: "
                                    "the file is damaged or truncated")
            tensors[name] = TensorInfo(name, dims, qtype, start + offset, nbytes)
        return tensors

    def read(self, name: str, start: int = 0, end: int | None = None) -> np.ndarray:
        """Bytes start..end of the tensor (default: all), (n,) uint8, read into a buffer of its own."""
        info = self.tensors[name]
        end = info.nbytes if end is None else end
        out = np.empty(end - start, np.uint8)
        try:
            with open(self.path, "rb") as f:
                f.seek(info.offset + start)
                whole = f.readinto(memoryview(out)) == out.size
        except OSError as err:
            raise VerispecError(f"{self.path}: tensor '{shown(name)}' cannot be read ({err.strerror or err})") from None
        if not whole:
            raise VerispecError(f"{self.path}: tensor '{shown(name)}' could not be read whole: the file is damaged or truncated")
        return out

    # ------------------------------------------------------------------ parsing the header

    def _left(self) -> int:
        return self._size - self._pos

    def _take(self, n: int) -> bytes:
        if n > self._left():
            raise VerispecError(f"{self.path}: the header ends past the end of the file: damaged or truncated")
        while self._pos + n > len(self._buf):  # the header outgrew what was read: read more
            more = self._file.read(max(n, len(self._buf)))
            if not more:
                raise VerispecError(f"{self.path}: the header ends past the end of the file: damaged or truncated")
            self._buf += more
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def _skip(self, n: int) -> None:
        """Step over n bytes of the header (an array's values) without keeping them."""
        if n > self._left():
            raise VerispecError(f"{self.path}: the header ends past the end of the file: damaged or truncated")
        if self._pos + n <= len(self._buf):
            self._pos += n
        else:
            self._take(n)

    def _scalar(self, fmt: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self, what: str, decode: bool = True) -> str | None:
        n = self._scalar("<Q")
        if n > self._left():
            raise self._damaged(f"{what} of {n} bytes, past the end of the file")
        raw = self._take(n) if decode else self._skip(n)
        if not decode:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self._damaged(f"{what} is not UTF-8: {shown(raw)}") from None

    def _value(self, kind: int, key: str, depth: int):
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string(f"metadata '{shown(key)}'")
        if kind != _ARRAY:
            raise VerispecError(f"{self.path}: unknown metadata value type {kind} (metadata '{shown(key)}'): the file is damaged")
        if depth >= MAX_NESTING:
            raise self._damaged(f"metadata '{shown(key)}' holds arrays nested more than {MAX_NESTING} deep")
        item, count = self._scalar("<I"), self._scalar("<Q")
        if item not in _SCALARS and item not in (_STRING, _ARRAY):
            raise VerispecError(f"{self.path}: unknown metadata value type {item} in the array '{shown(key)}': the file is damaged")
        least = struct.calcsize(_SCALARS[item]) if item in _SCALARS else _MIN_ITEM_BYTES[item]
        if count * least > self._left():
            raise self._damaged(f"metadata '{shown(key)}' is an array of {count} items, more than the file holds")
        if item in _SCALARS and count <= SMALL_ARRAY:
            fmt = _SCALARS[item]
            return struct.unpack(f"<{count}{fmt[1:]}", self._take(count * least))  # a tuple of the values
        if item in _SCALARS:
            self._skip(count * least)
        elif item == _STRING:
            label = f"an item of the array '{shown(key)}'"  # once: a vocabulary is 151,936 strings
            for _ in range(count):
                self._string(label, decode=False)
        else:
            for _ in range(count):
                self._value(_ARRAY, key, depth + 1)
        return count
