"""A short soak of the live server: random streaming, non-streaming, abandoned and malformed
requests from 8 clients for a few seconds; nothing lost, nothing different, no KV block left."""
from __future__ import annotations

import asyncio
import dataclasses
import time

from live_server import API_KEY

from specjax.serve.soak_clients import SoakConfig, run_soak


def test_soak_loses_nothing_and_answers_bad_requests_with_4xx(server):
    start = time.monotonic()
    # The live server caps max_tokens at 100; a small prompt pool makes keys recur, and a
    # high injection rate makes every bad-request kind likely to come up in 8 s.
    config = SoakConfig(url=server.url, api_key=API_KEY, duration=8, clients=8,
                        max_tokens_cap=100, prompts=4, seeds=1, inject_rate=0.15,
                        request_timeout=60, idle_timeout=20)
    # The live server's steps may have been dropped with the last module's compiled programs
    # (tests/conftest.py): a short first run recompiles them, so that the measured run's
    # time goes to requests, and keys recur often enough to be compared.
    warm = asyncio.run(run_soak(dataclasses.replace(config, duration=3, inject_rate=0.0)))
    assert warm.lost == 0 and warm.failed_unexpectedly == 0, "\n".join(warm.problems)
    report = asyncio.run(run_soak(config))
    problems = "\n".join(report.problems)
    assert report.sent > 0 and report.completed > 0, report.figures()
    assert report.lost == 0, problems
    assert report.failed_unexpectedly == 0, problems
    assert report.injected > 0
    assert report.injected_answered_wrong == 0, problems
    assert report.checked > 0 and report.mismatched == 0, problems
    assert report.server_idle and report.leaked == 0, report.figures()
    assert report.engine_errors == 0
    assert time.monotonic() - start < 60
