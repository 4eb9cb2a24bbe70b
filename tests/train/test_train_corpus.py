import hashlib
import platform
import re
import warnings
from pathlib import Path, PurePosixPath

import pytest

from specjax.train import corpus


@pytest.fixture
def fake_stdlib(tmp_path):
    files = {
        "os.py": "import sys\n",
        "json/__init__.py": "x = 1\n",
        "json/decoder.py": "y = 2\n",
        "pydoc_data/topics.py": "topics = {'a': 'English prose'}\n",
        "test/test_os.py": "assert True\n",
        "unittest/test/test_case.py": "pass\n",
        "lib2to3/tests/data/bom.py": "pass\n",
        "idlelib/idle_test/test_x.py": "pass\n",
        "site-packages/pkg/mod.py": "pass\n",
        "_sysconfigdata__linux_x86_64-linux-gnu.py": "build_time_vars = {}\n",
        "encodings/cp1252.py": '""" Python Character Mapping Codec cp1252 generated """\n',
        "notes.txt": "not python\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_collect_excludes_tests_and_generated_files(fake_stdlib):
    assert corpus.collect_files(fake_stdlib) == ["json/__init__.py", "json/decoder.py", "os.py",
                                                 "pydoc_data/topics.py"]


def test_manifest_is_deterministic_and_split_by_file(fake_stdlib, tmp_path_factory):
    a = corpus.build_manifest(fake_stdlib, val_fraction=0.5)
    b = corpus.build_manifest(fake_stdlib, val_fraction=0.5)
    assert a == b
    path = tmp_path_factory.mktemp("m") / corpus.MANIFEST_NAME
    corpus.write_manifest(a, path)
    assert corpus.load_manifest(path) == a
    for f in corpus.manifest_files(a):
        assert f.split == corpus.split_of(f.path, 0.5)
    assert {f.split for f in corpus.manifest_files(a)} <= {"train", "val"}
    assert corpus.split_of("pydoc_data/topics.py", 1.0) == "train"


def test_verify_reports_differences(fake_stdlib):
    manifest = corpus.build_manifest(fake_stdlib)
    assert corpus.verify_manifest(manifest, fake_stdlib) == []
    (fake_stdlib / "os.py").write_text("import sys  # edited\n")
    (fake_stdlib / "json/decoder.py").unlink()
    (fake_stdlib / "new.py").write_text("z = 3\n")
    problems = corpus.verify_manifest(manifest, fake_stdlib)
    assert sorted(problems) == ["changed: os.py", "extra: new.py", "missing: json/decoder.py"]
    with pytest.warns(UserWarning, match="corpus differs from manifest"):
        corpus.warn_if_mismatched(manifest, fake_stdlib)
    # A missing file is skipped, not fatal: other Python versions must still train.
    assert len(corpus.read_documents(manifest, "train", fake_stdlib)) + len(
        corpus.read_documents(manifest, "val", fake_stdlib)) == 3


def test_real_stdlib_manifest():
    manifest = corpus.build_manifest()
    paths = [f["path"] for f in manifest["files"]]
    assert paths == sorted(paths)
    assert "pydoc_data/topics.py" in paths
    assert not any(p.startswith("test/") or "/test/" in p or "/tests/" in p for p in paths)
    splits = {f["split"] for f in manifest["files"]}
    assert splits == {"train", "val"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        corpus.warn_if_mismatched(manifest)


CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
TARGET_MANIFEST = CHECKPOINTS / "stdlib-llama-7m" / corpus.MANIFEST_NAME
# `train draft` copies its target's manifest (a draft must tokenize and train like its target).
SHIPPED_MANIFESTS = [TARGET_MANIFEST, CHECKPOINTS / "stdlib-draft" / corpus.MANIFEST_NAME]
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@pytest.fixture(scope="module")
def shipped():
    return corpus.load_manifest(TARGET_MANIFEST)


@pytest.mark.parametrize("path", SHIPPED_MANIFESTS, ids=lambda p: p.parent.name)
def test_shipped_manifest_schema_and_split(path, shipped):
    manifest = corpus.load_manifest(path)
    assert manifest == shipped
    assert set(manifest) == {"source", "python_version", "val_fraction", "files"}
    assert manifest["source"] == "python-stdlib"
    assert re.fullmatch(r"3\.\d+\.\d+", manifest["python_version"])
    assert 0 < manifest["val_fraction"] < 0.5
    for entry in manifest["files"]:
        assert set(entry) == {"path", "sha256", "split", "size"}, entry
        assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]), entry
        # Empty files are real (package __init__.py); then the hash must be the empty string's.
        assert isinstance(entry["size"], int) and entry["size"] >= 0, entry
        assert (entry["size"] == 0) == (entry["sha256"] == EMPTY_SHA256), entry
        rel = PurePosixPath(entry["path"])
        assert rel.suffix == ".py" and not rel.is_absolute() and ".." not in rel.parts, entry
        assert not corpus._excluded(rel), entry
    paths = [f.path for f in corpus.manifest_files(manifest)]
    # Sorted and unique: every file sits in exactly one split, so train and val share no file.
    assert paths == sorted(set(paths))
    # The split is a function of the path alone; one decided any other way (by hand, by an
    # older rule) would make a rebuilt manifest on another machine disagree.
    for f in corpus.manifest_files(manifest):
        assert f.split == corpus.split_of(f.path, manifest["val_fraction"]), f.path
    val = corpus.manifest_files(manifest, "val")
    train = corpus.manifest_files(manifest, "train")
    assert val and train and len(val) + len(train) == len(paths)
    assert corpus.ALWAYS_TRAIN <= {f.path for f in train}


@pytest.mark.parametrize("folder", ["stdlib-llama-7m", "stdlib-draft"])
def test_model_card_describes_the_shipped_manifest(folder, shipped):
    card = (CHECKPOINTS / folder / "MODEL_CARD.md").read_text()
    data = re.search(r"- ([\d,]+) `\.py` files of the CPython (\S+) standard library", card)
    held_out = re.search(r"- validation: ([\d,]+) held-out files", card)
    assert data and held_out, "the card's Data section changed shape"
    assert int(data[1].replace(",", "")) == len(shipped["files"])
    assert data[2] == shipped["python_version"]
    assert int(held_out[1].replace(",", "")) == len(corpus.manifest_files(shipped, "val"))


def test_shipped_manifest_matches_this_stdlib(shipped):
    recorded, running = shipped["python_version"], platform.python_version()
    if recorded != running:
        pytest.skip(f"the shipped manifest records the stdlib of Python {recorded}; this is "
                    f"Python {running}, whose stdlib files legitimately differ")
    rebuilt = corpus.build_manifest(val_fraction=shipped["val_fraction"])
    want = {f["path"]: f["sha256"] for f in shipped["files"]}
    got = {f["path"]: f["sha256"] for f in rebuilt["files"]}
    assert sorted(p for p in want.keys() | got.keys() if want.get(p) != got.get(p)) == []
    assert rebuilt == shipped
