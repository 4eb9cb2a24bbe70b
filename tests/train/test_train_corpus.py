import warnings

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
