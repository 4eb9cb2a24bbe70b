"""Prometheus metrics (text format at GET /metrics), in a registry of the app's own.

Counters are updated as requests finish (a request the engine failed, or that shutdown ended,
counts as outcome "error"); gauges read the snapshot the engine thread publishes after every
iteration, so a scrape never touches the engine.
"""
from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import GaugeMetricFamily

from specjax.engine.request import RequestOutput
from specjax.serve.engine_thread import EngineFailure, EngineThread, Event, Submission

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else float(value)


class ServerMetrics:
    """Every metric of one server; `observe_finished` is the engine thread's finish hook."""

    def __init__(self, engine_thread: EngineThread | None = None):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specjax_requests", "Generation requests finished, by outcome "
                                "(stop, length, cancelled, error)", ["outcome"], registry=r)
        self.rejected = Counter("specjax_requests_rejected", "Requests refused before reaching "
                                "the engine, by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("specjax_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("specjax_generation_tokens", "Tokens generated for "
                                         "finished requests", registry=r)
        self.ttft = Histogram("specjax_time_to_first_token_seconds", "From submission to the "
                              "first generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("specjax_request_latency_seconds", "From submission to the "
                                 "last token", buckets=_LATENCY_BUCKETS, registry=r)
        self._gauges: dict[str, Gauge] = {}
        if engine_thread is not None:
            self.watch(engine_thread)

    def watch(self, engine_thread: EngineThread) -> None:
        """Gauges over the engine thread's published snapshot."""
        snap = lambda: engine_thread.snapshot
        for name, doc, read in [
            ("specjax_requests_running", "Requests holding a batch slot", lambda: snap().running),
            ("specjax_requests_waiting", "Requests queued for a slot (queue depth)",
             lambda: snap().waiting),
            ("specjax_kv_blocks_free", "Free KV-cache blocks", lambda: snap().kv_blocks_free),
            ("specjax_kv_blocks_total", "KV-cache blocks in the pool",
             lambda: snap().kv_blocks_total),
            ("specjax_engine_steps", "Engine iterations so far", lambda: snap().num_steps),
            ("specjax_preemptions", "Requests sent back to the queue to free KV blocks, so "
             "far", lambda: snap().num_preemptions),
            ("specjax_engine_failed_requests", "Requests the engine finished with an error "
             "(their own fault, or the device's), so far", lambda: snap().num_failed_requests),
            ("specjax_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / "
             "prompt tokens looked up, so far (NaN before any lookup, or with the cache off)",
             lambda: _nan_if_none(snap().prefix_cache_hit_rate)),
            ("specjax_prefix_cache_blocks", "KV-cache blocks the prefix cache holds (findable "
             "for reuse; those no request holds also count as free)",
             lambda: snap().prefix_cache_blocks),
            ("specjax_spec_acceptance_length", "(accepted drafts + n) / n over the n "
             "request-steps that verified drafts (NaN before any draft)",
             lambda: _nan_if_none(snap().acceptance_length)),
            ("specjax_spec_acceptance_rate", "Accepted / verified draft tokens (NaN before "
             "any draft)", lambda: _nan_if_none(snap().acceptance_rate)),
            ("specjax_spec_draft_overhead", "Host drafting time / step time (NaN before any "
             "step)", lambda: _nan_if_none(snap().draft_overhead)),
            ("specjax_spec_proposed_tokens", "Drafts rows held when their steps were "
             "dispatched, so far", lambda: snap().proposed_tokens),
            ("specjax_spec_verified_tokens", "Drafts verified, so far",
             lambda: snap().verified_tokens),
            ("specjax_spec_accepted_tokens", "Drafts accepted, so far",
             lambda: snap().accepted_tokens),
        ]:
            gauge = Gauge(name, doc, registry=self.registry)
            gauge.set_function(read)
            self._gauges[name] = gauge
        for family in _labelled_families(snap):
            self.registry.register(family)

    def observe_finished(self, sub: Submission, event: Event | None) -> None:
        if event is None:
            self.requests.labels(outcome="cancelled").inc()
            return
        if isinstance(event, EngineFailure):
            self.requests.labels(outcome="error").inc()
            return
        out: RequestOutput = event
        self.requests.labels(outcome=out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        stats = out.stats
        if stats.first_token_time is not None:
            self.ttft.observe(max(0.0, stats.first_token_time - sub.submit_time))
        if stats.finish_time is not None:
            self.latency.observe(max(0.0, stats.finish_time - sub.submit_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Labelled:
    """One gauge family whose series come from the snapshot: `rows(snapshot)` yields
    (label values, value) pairs, read at every scrape."""

    def __init__(self, snap, name: str, doc: str, labels: list[str], rows):
        self._snap, self.name, self.doc, self.labels, self.rows = snap, name, doc, labels, rows

    def describe(self):
        return [GaugeMetricFamily(self.name, "")]

    def collect(self):
        family = GaugeMetricFamily(self.name, self.doc, labels=self.labels)
        for labels, value in self.rows(self._snap()):
            family.add_metric([str(v) for v in labels], value)
        yield family


def _labelled_families(snap) -> list[_Labelled]:
    return [
        # AR_k: one series per draft position verified so far.
        _Labelled(snap, "specjax_spec_acceptance_per_position", "Share of request-steps with "
                  "drafts that accepted at least `position` of them (AR_k)", ["position"],
                  lambda s: [((k,), rate) for k, rate in
                             enumerate(s.acceptance_per_position, start=1)]),
        # The measured step costs the cost model divides by (`specjax.engine.costs`).
        _Labelled(snap, "specjax_step_cost_seconds", "Measured seconds of the compiled "
                  "generation step for a batch bucket and run width (1 + drafts verified)",
                  ["batch", "width"], lambda s: sorted(s.step_costs)),
        # The cost model's choices.
        _Labelled(snap, "specjax_spec_steps_by_draft_length", "Generation steps run at each "
                  "draft length (0: plain decoding), so far", ["draft_len"],
                  lambda s: [((d,), n) for d, n in enumerate(s.draft_len_histogram) if n]),
    ]
