"""Planted bugs in the acceptance code that the statistical tests must catch.

Each mutant is one textual change to one source file. It is applied to a scratch copy of the
repository (specjax/, pallas_kernels/, tests/, pyproject.toml; checkpoints/ linked), and the
mutant's tests run there in a child pytest with the copy first on the import path; the mutant
is caught when they fail. The tests are the distribution tests, never a kernel-vs-reference
equality check (which would catch a reference-only change trivially): what is shown is that
the statistics themselves see the bug. `tests/test_mutants.py` (slow, CI's second job) runs
every mutant with `-x`;

    python tests/mutants.py [--report] [NAME ...]

prints which tests catch each one (`--report`: every test runs, no `-x`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "pallas_kernels/rejection_sampling/reference.py"
KERNEL_DEPTHS = ("tests/pallas_kernels/test_rejection_sampling.py::"
                 "test_each_depth_and_the_bonus_follow_their_own_p[reference-300000]")
KERNEL_ZERO_MASS = ("tests/pallas_kernels/test_rejection_sampling.py::"
                    "test_zero_mass_residual_falls_back_to_p")
E2E = "tests/speculative/test_rejection_sampling_e2e.py"
# The draft-model drafter's groups (its sampling run is shared by them; one drafter keeps a
# mutant's run to a couple of minutes).
E2E_DEPTHS = tuple(f"{E2E}::test_tokens_decided_at_each_depth_follow_the_target"
                   f"[draft_target_one_model-{group}]"
                   for group in ("depth 1", "depth 2", "depth 3", "bonus (full chain)"))
E2E_GREEDY = E2E + "::test_greedy_rows_stay_exact_beside_sampled_ones"
SPEC = "tests/speculative/test_spec_engine.py"
GREEDY_DRAFT_TARGET = (SPEC + "::test_greedy_equals_plain_greedy_across_batches_and_arrivals"
                       "[draft_target]")
STOPS = tuple(f"{SPEC}::test_stop_and_eos_inside_an_accepted_run[{setup}]"
              for setup in ("draft_target_overlap", "host_oracle"))
HYBRID = "tests/engine/test_hybrid.py"
HYBRID_GREEDY = tuple(f"{HYBRID}::test_greedy_spec_equals_plain_greedy[{setup}]"
                      for setup in ("user_states", "draft_target_replay_no_overlap"))
# DSpark's q is conditioned on the drafted prefix: its statistical test under confidence
# scheduling (a Markov term strong enough for the statistic to see a q without it).
E2E_DSPARK = ("tests/speculative/test_dspark.py::"
              "test_sampled_tokens_follow_the_target_under_confidence_scheduling",)
TREE_UNIT = tuple("tests/core/test_tree.py::test_sampled_tree_tokens_follow_the_target_at_every_"
                  f"depth_and_sibling[{case}]" for case in ("1.0-0", "0.7-3"))
TREE_E2E = (f"{E2E}::test_tree_tokens_follow_the_target_at_every_depth_and_sibling",)
LEDGER = tuple(f"tests/engine/test_kv_ledger.py::test_randomized_kv_ledger_with_overlap[{setup}]"
               for setup in ("draft_target", "mtp"))


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # cheapest first: with -x the first failure ends the run


MUTANTS = [
    Mutant("depth_uses_first_q", "every draft judged against the first draft's q",
           REFERENCE,
           "q_at = jnp.take_along_axis(draft_probs, ids[..., None], axis=-1)[..., 0]",
           "q_at = jnp.take_along_axis(jnp.broadcast_to(draft_probs[:, :1], draft_probs.shape),"
           " ids[..., None], axis=-1)[..., 0]",
           (KERNEL_DEPTHS, *E2E_DEPTHS)),
    Mutant("correct_from_p", "the correction resampled from p instead of the residual",
           REFERENCE,
           "residual = jnp.where(has_mass, residual, p_row.astype(jnp.float32))",
           "residual = p_row.astype(jnp.float32)",
           (KERNEL_DEPTHS, *E2E_DEPTHS)),
    Mutant("one_uniform_per_chain", "one acceptance uniform shared by every depth",
           REFERENCE,
           "positions = offsets[:, None] + jnp.arange(D)",
           "positions = offsets[:, None] + 0 * jnp.arange(D)",
           (KERNEL_DEPTHS, *E2E_DEPTHS)),
    Mutant("accept_q_over_p", "accept with probability min(1, q/p)",
           REFERENCE,
           "accept = (u * q_at < p_at)",
           "accept = (u * p_at < q_at)",
           (KERNEL_DEPTHS, *E2E_DEPTHS)),
    Mutant("zero_mass_to_id_0", "a residual without mass draws id 0 instead of falling back to p",
           REFERENCE,
           "residual = jnp.where(has_mass, residual, p_row.astype(jnp.float32))",
           "residual = jnp.where(has_mass, residual, 0.0)",
           (KERNEL_ZERO_MASS,)),
    Mutant("target_ignores_temperature", "target probabilities not filtered by the temperature",
           "specjax/core/accept.py",
           "filtered = filter_logits(logits.reshape(B * W, V), rep(batch.temperature),",
           "filtered = filter_logits(logits.reshape(B * W, V), rep(jnp.ones_like("
           "batch.temperature)),",
           E2E_DEPTHS),
    Mutant("q_unfiltered", "draft q reported without the filtering its drafts were drawn with",
           "specjax/core/sampling.py",
           "                jax.nn.softmax(filtered, axis=-1))",
           "                jax.nn.softmax(logits.astype(jnp.float32), axis=-1))",
           E2E_DEPTHS),
    Mutant("dspark_q_without_markov",
           "DSpark hands rejection sampling each draft's distribution without the Markov term "
           "it was drawn with (a DFlash reading of a DSpark block)",
           "specjax/speculative/workers/dspark.py",
           "        return (draft, before.at[:, k].set(draft)), (probs, c)",
           "        return (draft, before.at[:, k].set(draft)), (draft_tokens_and_probs("
           "base[:, k], batch, first + k, with_probs, penalties, before, num_before=k)[1], c)",
           E2E_DSPARK),
    # Sampled trees: siblings drawn without replacement, recursive rejection sampling.
    Mutant("tree_q_keeps_rejected",
           "siblings drawn without replacement but judged as with (q keeps a rejected sibling)",
           "specjax/core/tree.py",
           "            q_cur = jnp.where(reject, q_left / jnp.maximum(left, 1e-30), q_cur)",
           "            q_cur = q_cur",
           TREE_UNIT + TREE_E2E),
    Mutant("tree_residual_not_renormalised", "the residual after a rejected sibling not renormalised",
           "specjax/core/tree.py",
           "residual / jnp.maximum(mass, 1e-30), p_cur)",
           "residual, p_cur)",
           TREE_UNIT + TREE_E2E),
    Mutant("tree_siblings_with_replacement",
           "siblings drawn with replacement (independently) but judged as without",
           "specjax/speculative/workers/tree.py",
           "        _, ids = jax.lax.top_k(perturbed, top_k)",
           "        ids = jnp.argmax(jnp.where(rows[..., None], logq[..., None, :] + entry_noise("
           "keys[..., None] ^ jnp.arange(1, top_k + 1, dtype=jnp.uint32), V), "
           "logp[..., None, :]), axis=-1)",
           TREE_UNIT + TREE_E2E),
    Mutant("tree_keeps_siblings_by_their_own_draw",
           "a sampled tree keeps the children whose own draws are likely (log q(x) scores)",
           "specjax/speculative/workers/tree.py",
           "inc = jnp.where(q_ids > 0, sibling_values(top_k), -jnp.inf)",
           "inc = jnp.log(jnp.maximum(q_ids, 1e-30))",
           TREE_UNIT + TREE_E2E),
    # Bugs the greedy tests only see with drafts both accepted and rejected, stops inside an
    # accepted run, and steps in flight.
    Mutant("strict_accept_counts_matches", "a draft matching after a mismatch counted accepted",
           "specjax/core/accept.py",
           "accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)",
           "accepted = jnp.sum(match.astype(jnp.int32), axis=1)",
           (GREEDY_DRAFT_TARGET,)),
    Mutant("stop_only_at_run_end", "stop tokens and EOS looked for only at a run's last token",
           "specjax/engine/output.py",
           "if token in stops:",
           "if token in stops and i == len(tokens) - 1:",
           STOPS),
    Mutant("stop_only_at_run_end_token_by_token",
           "the same, on the token-by-token path (grammar, logprobs, stop strings)",
           "specjax/engine/output.py",
           "if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:",
           "if ((not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids)"
           " and token == tokens[-1]:",
           ("tests/engine/test_output.py::"
            "test_a_run_appended_at_once_ends_where_token_by_token_would",)),
    Mutant("give_back_in_flight_reservation",
           "settling a step gives back the positions a newer step in flight reserved",
           "specjax/engine/bookkeeper.py",
           "- request.num_computed - request.latest_reserve)",
           "- request.num_computed)",
           LEDGER),
    Mutant("greedy_rows_rejection_sampled", "greedy rows go through rejection sampling too",
           "specjax/core/accept.py",
           "sampled = batch.temperature > 0",
           "sampled = batch.temperature >= 0",
           (E2E_GREEDY,)),
    Mutant("recurrent_state_at_last_position",
           "a hybrid's recurrent state committed after every verified draft, accepted or not",
           "specjax/core/steps.py",
           "jnp.where(batch.query_lens > 0, lens, 0), verify=D > 0)",
           "batch.query_lens, verify=D > 0)",
           HYBRID_GREEDY),
    Mutant("recurrent_state_one_too_deep", "the kept state is the one after the bonus position",
           "specjax/core/recurrent.py",
           "jnp.maximum(n - 1, 0)[:, None, None, None, None]",
           "jnp.minimum(n, tape.x.shape[1] - 1)[:, None, None, None, None]",
           HYBRID_GREEDY[:1]),
    Mutant("recurrent_replay_one_too_deep", "the replay re-scans one position past the accepted",
           "specjax/core/recurrent.py",
           "jnp.arange(T)[None, :, None] < n[:, None, None]",
           "jnp.arange(T)[None, :, None] <= n[:, None, None]",
           HYBRID_GREEDY[1:]),
    Mutant("recurrent_state_not_reset", "a new request's mixers start from its slot's old state",
           "specjax/core/recurrent.py",
           "fresh = ((batch.start_pos == 0) & (batch.query_lens > 0))",
           "fresh = ((batch.start_pos < 0) & (batch.query_lens > 0))",
           (f"{HYBRID}::test_preemption_recomputes_the_state_exactly",)),
]


def scratch_copy(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in ("specjax", "pallas_kernels", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    (dest / "checkpoints").symlink_to(ROOT / "checkpoints")
    return dest


def apply(mutant: Mutant, root: Path) -> None:
    path = root / mutant.path
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise RuntimeError(f"{mutant.name}: the text to mutate occurs {text.count(mutant.old)} "
                           f"times in {mutant.path}; update the mutant")
    path.write_text(text.replace(mutant.old, mutant.new))


def _env(root: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}


def check_imports_from(root: Path) -> None:
    """The child must import the copy, not the installed checkout."""
    out = subprocess.run([sys.executable, "-c", "import specjax, pallas_kernels; "
                          "print(specjax.__file__); print(pallas_kernels.__file__)"],
                         cwd=root, env=_env(root), capture_output=True, text=True, check=True)
    for line in out.stdout.split():
        if not Path(line).resolve().is_relative_to(root.resolve()):
            raise RuntimeError(f"the scratch copy imports {line}, not its own code")


@dataclasses.dataclass
class Outcome:
    caught: bool
    failed: list[str]
    seconds: float
    tail: str


def run_tests(root: Path, tests: tuple[str, ...], stop_at_first: bool = True) -> Outcome:
    start = time.perf_counter()
    # One process: the parent run already has a worker per core (pyproject's `-n auto`); the
    # tests named run whether or not they are marked slow.
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "-n", "0",
           "-m", "slow or not slow",
           *(["-x"] if stop_at_first else []), *tests]
    out = subprocess.run(cmd, cwd=root, env=_env(root), capture_output=True, text=True)
    text = out.stdout + out.stderr
    failed = re.findall(r"^FAILED ([^\s\[]+(?:\[[^\]]*\])?)", text, flags=re.M)
    # Exit code 1 with test failures is a catch; collection errors or crashes (2, 3, 4) are not.
    return Outcome(out.returncode == 1 and bool(failed), failed, time.perf_counter() - start,
                   text[-3000:])


def run_mutant(mutant: Mutant, stop_at_first: bool = True, workdir: Path | None = None
               ) -> Outcome:
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root = scratch_copy(Path(tmp) / "repo")
        apply(mutant, root)
        check_imports_from(root)
        return run_tests(root, mutant.tests, stop_at_first)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--report", action="store_true",
                        help="run every test of each mutant (no -x) and list the failures")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    survivors = 0
    for m in chosen:
        outcome = run_mutant(m, stop_at_first=not args.report)
        survivors += not outcome.caught
        status = "caught" if outcome.caught else "SURVIVED"
        print(f"{m.name:<32} {status:<9} {outcome.seconds:6.0f} s  {m.what}")
        for test in outcome.failed:
            print(f"{'':<34}failed: {test}")
        if not outcome.caught:
            print(outcome.tail)
    print(f"{len(chosen) - survivors}/{len(chosen)} mutants caught")
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
