"""Named defaults assembled from package chunks: sha256 checks, corruption recovery, no partial
files, clear errors; and the converted-model cache rebuilding itself when damaged."""

import hashlib
import os

import pytest

from tiny_hf import save_tiny_model_dir
from verispec.errors import VerispecError
from verispec.models import loading, registry
from verispec.models.registry import NamedModel, assemble


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """Three installed 'packages' holding chunks of a file, and a NamedModel for them."""
    site = tmp_path / "site"
    chunks = [os.urandom(1000 + i) for i in range(3)]
    packages = []
    for i, chunk in enumerate(chunks, start=1):
        pkg = site / f"fakechunk_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        packages.append((f"fakechunk-part{i}", "1.0", f"fakechunk_part{i}", f"data/part{i:02d}.bin"))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    model = NamedModel("fake-model", "fake.gguf", tuple(packages), hashlib.sha256(b"".join(chunks)).hexdigest())
    return model, b"".join(chunks), site


def cache_files(tmp_path):
    return sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir())


def test_assembles_verifies_and_reuses(fake_model, tmp_path, monkeypatch):
    model, data, _ = fake_model
    path = assemble(model)
    assert path.read_bytes() == data
    monkeypatch.setattr(registry, "sha256_file", lambda p: pytest.fail("a verified, unchanged file is not hashed again"))
    assert assemble(model) == path


def test_corrupted_cached_file_is_named_and_reassembled(fake_model, tmp_path, capsys):
    model, data, _ = fake_model
    path = assemble(model)
    path.write_bytes(b"x" + data[1:])
    assert assemble(model).read_bytes() == data
    err = capsys.readouterr().err
    assert "corrupted" in err and "fake.gguf" in err


def test_corrupted_package_chunk_is_an_error_and_leaves_no_partial_file(fake_model, tmp_path):
    model, _, site = fake_model
    (site / "fakechunk_part2" / "data" / "part02.bin").write_bytes(b"broken")
    with pytest.raises(VerispecError, match="sha256"):
        assemble(model)
    assert cache_files(tmp_path) == []


def test_missing_package_names_the_fix(fake_model, tmp_path):
    model, _, _ = fake_model
    missing = NamedModel(model.name, model.filename, model.packages + (("nope-part9", "1.0", "nope_part9", "x"),), model.sha256)
    with pytest.raises(VerispecError, match="verispec fetch fake-model"):
        assemble(missing)


def test_unknown_spec_and_plain_directory_are_clear_errors(tmp_path):
    with pytest.raises(VerispecError, match="unknown model spec"):
        loading.resolve("definitely-not-a-model")
    with pytest.raises(VerispecError, match="no config.json"):
        loading.resolve(str(tmp_path))


def test_damaged_converted_copy_is_rebuilt(tmp_path, monkeypatch, capsys):
    """The GGUF conversion itself is exercised by the slow real-model test; here a stand-in
    converter writes a tiny model, whose cached copy is then damaged."""
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    conversions = []

    def fake_convert(source, out):
        conversions.append(source)
        save_tiny_model_dir(out)
        (out / loading._COMPLETE).write_text("{}")

    monkeypatch.setattr(loading, "_convert_gguf", fake_convert)
    first = loading.load_model(str(gguf), backend="torch")
    assert len(conversions) == 1
    loading.load_model(str(gguf), backend="torch")
    assert len(conversions) == 1  # second load reads the cached copy
    weights = next(loading._converted_dir(gguf).glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    again = loading.load_model(str(gguf), backend="torch")
    assert len(conversions) == 2 and "failed to load" in capsys.readouterr().err
    assert type(again.model) is type(first.model)


@pytest.mark.parametrize("stamp", [b"", b'{"size": 3', b"\xff\xfe garbage", b"[1, 2]", b'"verified"', b"null"])
def test_an_unreadable_stamp_means_verify_again_not_a_crash(fake_model, tmp_path, monkeypatch, stamp):
    """A truncated or garbage NAME.verified.json (a kill while an older version wrote it in place) used to
    break every later load with a JSON error; now the file's sha256 is checked again and the stamp rewritten."""
    import json

    model, data, _ = fake_model
    path = assemble(model)
    stamp_file = path.with_suffix(".verified.json")
    stamp_file.write_bytes(stamp)
    hashed = []
    real = registry.sha256_file
    monkeypatch.setattr(registry, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert assemble(model) == path and hashed == [path] and path.read_bytes() == data
    assert json.loads(stamp_file.read_text())["sha256"] == model.sha256
    assert assemble(model) == path and hashed == [path]  # the new stamp holds: not hashed a third time
    assert cache_files(tmp_path) == ["fake.gguf", "fake.verified.json"]


def test_assembly_leaves_another_writers_temporary_file_alone(fake_model, tmp_path):
    """Before: the temporary name was .NAME.PID.partial, the same for two threads of one process."""
    model, data, _ = fake_model
    gguf = tmp_path / "cache" / "gguf"
    gguf.mkdir(parents=True)
    other = gguf / f".fake.gguf.{os.getpid()}.partial"
    other.write_bytes(b"another thread's half-assembled file")
    assert assemble(model).read_bytes() == data
    assert other.read_bytes() == b"another thread's half-assembled file"
