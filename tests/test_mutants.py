"""Every planted bug in `tests/mutants.py` is caught by the tests named for it (each in a scratch
copy of the repository), and the unmutated copy passes the cheap ones: a copy that failed on
its own would make every mutant look caught."""
import pytest

from tests.mutants import KERNEL_DEPTHS, KERNEL_ZERO_MASS, MUTANTS, run_mutant, run_tests, scratch_copy

pytestmark = pytest.mark.slow


def test_the_unmutated_copy_passes(tmp_path):
    root = scratch_copy(tmp_path / "repo")
    outcome = run_tests(root, (KERNEL_DEPTHS, KERNEL_ZERO_MASS))
    assert not outcome.caught and " passed" in outcome.tail, outcome.tail


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_is_caught(mutant, tmp_path):
    outcome = run_mutant(mutant, workdir=tmp_path)
    assert outcome.caught, f"{mutant.name} ({mutant.what}) survived:\n{outcome.tail}"
