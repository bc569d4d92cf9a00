"""Prometheus metrics of one app: its own registry, event series, and engine gauges read at scrape.

Counters and histograms are updated as requests finish (``stencil.service.generation``) or are
answered (the app's ``after_response`` hook). Engine state — running/waiting requests, KV
blocks, prefix-cache hit rate, grammar compiler counters — is not copied on every step: a
custom collector reads the engine's ``EngineClient.stats()``, ``grammar_stats`` (the compiler's
``CompileStats``) and, on a cluster, ``replica_health()`` when ``GET /metrics`` is scraped
(prometheus-client "custom collectors").

Each app gets its own ``CollectorRegistry`` (no global default registry), so several apps in
one process (tests) never clash.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from stencil.schemas.common import Usage

#: Latency buckets (seconds): a CPU decode step is ~10-300 ms, a queued TTFT can reach seconds.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_GRAMMAR_BUCKETS = (0.0005, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector:
    """Reads engine and grammar-compiler state at scrape time."""

    def __init__(self, source: Callable[[], object | None]):
        self._source = source  # returns the EngineClient, or None before it is ready

    def describe(self):
        return []  # unknown until scrape; keeps registration free of a first collect()

    def collect(self):
        aeng = self._source()
        alive = GaugeMetricFamily("stencil_engine_alive", "1 while the engine loop runs")
        alive.add_metric([], 1.0 if aeng is not None and aeng.is_alive else 0.0)
        yield alive
        if aeng is None:
            return
        s = aeng.stats()
        gauges = {
            "stencil_requests_running": ("requests in the running batch", s["running"]),
            "stencil_requests_waiting": ("requests waiting to be scheduled", s["waiting"]),
            "stencil_kv_blocks_total": ("KV-cache blocks in the pool", s["kv_blocks_total"]),
            "stencil_kv_blocks_used": ("KV-cache blocks held by requests",
                                       s["kv_blocks_total"] - s["kv_blocks_free"]),
            "stencil_kv_cache_usage_ratio": ("fraction of KV blocks in use", s["kv_usage"]),
            "stencil_prefix_cache_hit_rate": ("prompt tokens served from the prefix cache / looked up",
                                              s["prefix_cache_hit_rate"]),
        }
        if "kv_sliding_blocks_total" in s:  # a hybrid KV cache's sliding-window group (Gemma 3)
            gauges["stencil_kv_sliding_blocks_total"] = ("KV-cache blocks of the sliding-window layers",
                                                         s["kv_sliding_blocks_total"])
            gauges["stencil_kv_sliding_blocks_used"] = ("sliding-window KV-cache blocks held by requests",
                                                        s["kv_sliding_blocks_total"] - s["kv_sliding_blocks_free"])
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        counters = {
            "stencil_prefix_cache_queries": ("prompt tokens looked up in the prefix cache",
                                             s["prefix_cache_queries"]),
            "stencil_prefix_cache_hits": ("prompt tokens found in the prefix cache", s["prefix_cache_hits"]),
            "stencil_preemptions": ("requests preempted for lack of KV blocks", s["num_preemptions"]),
            "stencil_engine_steps": ("engine steps run", s["num_steps"]),
        }
        gstats = aeng.grammar_stats
        if gstats is not None:
            counters.update({
                "stencil_grammar_compiles": ("grammars compiled", gstats.compiles),
                "stencil_grammar_cache_hits": ("grammar requests served from the in-memory cache",
                                               gstats.cache_hits),
                "stencil_grammar_disk_hits": ("grammar requests served from the disk cache", gstats.disk_hits),
                "stencil_grammar_errors": ("grammar compiles that failed", gstats.errors),
                "stencil_grammar_timeouts": ("grammar compiles that timed out", gstats.timeouts),
                "stencil_grammar_eager_failures": ("eager index builds that failed or timed out (the "
                                                   "grammar stays on the lazy backend)", gstats.eager_failures),
            })
            summ = SummaryMetricFamily("stencil_grammar_compile_seconds", "time to compile one grammar",
                                       count_value=gstats.compile_ms_count,
                                       sum_value=gstats.compile_ms_sum / 1e3)
            counters_summary = summ
        else:
            counters_summary = None
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c
        if counters_summary is not None:
            yield counters_summary
        replicas = aeng.replica_health()
        if replicas is not None:  # a cluster ingress (its stats carry its retries and replays)
            yield from _replica_families(replicas, gauges, counters)
            for name, doc, value in (("stencil_cluster_retries", "requests re-sent after a replica failed",
                                      s.get("retries", 0)),
                                     ("stencil_cluster_replays", "re-sent requests that had delivered tokens",
                                      s.get("replays", 0))):
                c = CounterMetricFamily(name, doc)
                c.add_metric([], float(value))
                yield c


def _replica_families(replicas: list[dict], gauges: dict, counters: dict):
    """Per-replica series of a cluster ingress: ``stencil_replica_up{replica}`` and every engine
    gauge and counter above as ``stencil_replica_<name>{replica}`` (the unlabelled ones sum
    the replicas). Counters restart with their replica, which Prometheus's ``rate`` handles."""
    up = GaugeMetricFamily("stencil_replica_up", "1 while the engine replica reports ok", labels=["replica"])
    for r in replicas:
        if "replica" in r:
            up.add_metric([r["replica"]], 1.0 if r.get("status") == "ok" else 0.0)
    yield up
    live = [r for r in replicas if "replica" in r and r.get("engine")]
    engine_gauges = {
        "stencil_requests_running": "running", "stencil_requests_waiting": "waiting",
        "stencil_kv_blocks_total": "kv_blocks_total", "stencil_kv_cache_usage_ratio": "kv_usage",
        "stencil_prefix_cache_hit_rate": "prefix_cache_hit_rate",
    }
    for name, key in engine_gauges.items():
        g = GaugeMetricFamily(name.replace("stencil_", "stencil_replica_", 1), gauges[name][0], labels=["replica"])
        for r in live:
            g.add_metric([r["replica"]], float(r["engine"].get(key, 0.0)))
        yield g
    engine_counters = {"stencil_prefix_cache_queries": "prefix_cache_queries",
                       "stencil_prefix_cache_hits": "prefix_cache_hits",
                       "stencil_preemptions": "num_preemptions", "stencil_engine_steps": "num_steps"}
    for name, key in engine_counters.items():
        c = CounterMetricFamily(name.replace("stencil_", "stencil_replica_", 1), counters[name][0],
                                labels=["replica"])
        for r in live:
            c.add_metric([r["replica"]], float(r["engine"].get(key, 0)))
        yield c


class Metrics:
    """The series of one app.

    Attributes:
        registry: this app's ``CollectorRegistry``.
        requests: ``stencil_http_requests_total{endpoint, status}``.
        ttft / itl: time to first token / inter-token latency histograms (seconds).
        grammar_wait: time a request waited for its grammar (seconds; near 0 on a cache hit).
        timeouts: requests aborted at their deadline.
        queue_timeouts / queue_wait: requests that waited past their deadline for a running slot
            (answered 429), and how long requests wait for one (seconds).
    """

    def __init__(self, engine_source: Callable[[], object | None]):
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("stencil_http_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("stencil_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("stencil_completion_tokens", "output tokens of finished requests",
                                         registry=r)
        self.cached_tokens = Counter("stencil_cached_prompt_tokens", "prompt tokens served from the prefix cache",
                                     registry=r)
        self.draft_tokens = Counter("stencil_spec_draft_tokens", "speculative tokens proposed", registry=r)
        self.accepted_tokens = Counter("stencil_spec_accepted_tokens", "speculative tokens accepted", registry=r)
        self.forced_tokens = Counter("stencil_forced_tokens", "tokens forced by the grammar", registry=r)
        self.finished = Counter("stencil_requests_finished", "generation requests finished",
                                ["finish_reason"], registry=r)
        self.outputs = Counter("stencil_constrained_outputs", "constrained outputs by validity",
                               ["valid"], registry=r)
        self.timeouts = Counter("stencil_request_timeouts", "requests aborted at their deadline", registry=r)
        self.queue_timeouts = Counter("stencil_queue_timeouts", "requests answered 429 after waiting past their "
                                      "deadline for a running slot", registry=r)
        self.queue_wait = Histogram("stencil_queue_wait_seconds", "arrival to first scheduled (or given up)",
                                    buckets=_TTFT_BUCKETS + (120.0, 300.0), registry=r)
        self.ttft = Histogram("stencil_time_to_first_token_seconds", "arrival to first output token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("stencil_inter_token_latency_seconds", "time between output tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.grammar_wait = Histogram("stencil_grammar_wait_seconds", "time a request waited for its grammar",
                                      buckets=_GRAMMAR_BUCKETS, registry=r)
        r.register(_EngineCollector(engine_source))

    def record_finished(self, usage: Usage, finish_reason: str, valid: bool | None) -> None:
        """Count a finished request's tokens; ``valid`` is None for unconstrained requests."""
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.draft_tokens.inc(usage.draft_tokens)
        self.accepted_tokens.inc(usage.accepted_tokens)
        self.forced_tokens.inc(usage.forced_tokens)
        self.finished.labels(finish_reason).inc()
        if valid is not None:
            self.outputs.labels("true" if valid else "false").inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
