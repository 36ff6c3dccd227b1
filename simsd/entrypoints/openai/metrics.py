"""Prometheus metrics of the server (``GET /metrics``, text format, prometheus-client).

Read from the :class:`~simsd.entrypoints.api.LLM` at scrape time:

* ``simsd_requests_running`` / ``simsd_requests_waiting`` (gauges), ``simsd_batch_rows``;
* ``simsd_requests_total{finish_reason=stop|length|cancelled|error}``,
  ``simsd_prompt_tokens_total``, ``simsd_generation_tokens_total``;
* ``simsd_target_forwards_total`` / ``simsd_draft_forwards_total`` (forwards each request's
  row took part in), ``simsd_target_forwards_per_token`` (their ratio to the generated tokens;
  device independent, docs/design.md §7), ``simsd_batched_forwards_total{model}`` (forwards run);
* ``simsd_draft_tokens_proposed_total`` / ``simsd_draft_tokens_accepted_total`` and
  ``simsd_acceptance_rate`` (accepted / proposed; paper/exact);
* ``simsd_round_seconds`` (summary: count and sum of the scheduler's rounds, one batched
  forward with the work of its rows each).

Observed by the server per request: ``simsd_time_to_first_token_seconds``,
``simsd_time_per_output_token_seconds`` and ``simsd_request_latency_seconds`` (histograms);
``simsd_requests_rejected_total{reason=queue_full|shutting_down}`` (HTTP requests answered 503).
Each :class:`Metrics` has its own registry (several servers may share a process).
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily


class _LLMCollector:
    def __init__(self, llm):
        self.llm = llm

    def collect(self):
        m = self.llm.metrics()
        yield GaugeMetricFamily("simsd_requests_running", "Requests holding an engine row.", value=m["running"])
        yield GaugeMetricFamily("simsd_requests_waiting", "Requests waiting for a row.", value=m["waiting"])
        yield GaugeMetricFamily("simsd_batch_rows", "Engine rows (the most requests decoded together).",
                                value=m["rows"])
        req = CounterMetricFamily("simsd_requests", "Finished requests by outcome.", labels=["finish_reason"])
        for reason, n in sorted(m["requests"].items()):
            req.add_metric([reason], n)
        yield req
        for key, help_ in (("prompt_tokens", "Prompt tokens of finished requests."),
                           ("generation_tokens", "Generated tokens of finished requests (stop token included)."),
                           ("target_forwards", "Target forwards the finished requests' rows took part in."),
                           ("draft_forwards", "Draft forwards the finished requests' rows took part in.")):
            yield CounterMetricFamily(f"simsd_{key}", help_, value=m[key])
        yield CounterMetricFamily("simsd_draft_tokens_proposed", "Draft tokens proposed for verification.",
                                  value=m["proposed"])
        yield CounterMetricFamily("simsd_draft_tokens_accepted", "Draft tokens accepted by the target.",
                                  value=m["accepted"])
        nan = float("nan")
        yield GaugeMetricFamily("simsd_acceptance_rate", "Accepted / proposed draft tokens (finished requests).",
                                value=m["accepted"] / m["proposed"] if m["proposed"] else nan)
        yield GaugeMetricFamily("simsd_target_forwards_per_token",
                                "Target forwards per generated token (finished requests).",
                                value=m["target_forwards"] / m["generation_tokens"] if m["generation_tokens"] else nan)
        fw = CounterMetricFamily("simsd_batched_forwards", "Batched forwards run per model.", labels=["model"])
        for name, n in sorted(m["batched_forwards"].items()):
            fw.add_metric([name], n)
        yield fw
        yield SummaryMetricFamily("simsd_round_seconds", "Wall time of the scheduler's rounds (one batched "
                                  "forward and its rows' work).", count_value=m["rounds"], sum_value=m["round_seconds"])
        yield CounterMetricFamily("simsd_preemptions", "Requests stopped for want of KV pages and started over.",
                                  value=m["preemptions"])
        pages = m["kv_pages"]
        if pages is not None:
            models = sorted(k for k, v in pages.items() if isinstance(v, dict))
            for key, help_ in (("pages_total", "KV cache pages of the pool."),
                               ("pages_used", "KV cache pages held by running requests."),
                               ("pages_free", "KV cache pages free (cached pages no request holds included)."),
                               ("pages_cached", "KV cache pages in the prefix cache.")):
                g = GaugeMetricFamily(f"simsd_kv_{key}", help_, labels=["model"])
                for name in models:
                    g.add_metric([name], pages[name][key])
                yield g
            ev = CounterMetricFamily("simsd_kv_page_evictions", "Cached KV pages taken back for growth.",
                                     labels=["model"])
            for name in models:
                ev.add_metric([name], pages[name]["evictions"])
            yield ev
            yield CounterMetricFamily("simsd_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(whole pages).", value=pages["prefix_queried_tokens"])
            yield CounterMetricFamily("simsd_prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                      "prefilled).", value=pages["prefix_hit_tokens"])


class Metrics:
    """The server's registry: the LLM's live state and the per-request latency histograms."""

    def __init__(self, llm):
        self.registry = CollectorRegistry()
        self.registry.register(_LLMCollector(llm))
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("simsd_time_to_first_token_seconds", "Submission to the first finished block.",
                              buckets=buckets, registry=self.registry)
        self.tpot = Histogram("simsd_time_per_output_token_seconds",
                              "(latency - time to first token) / (tokens - 1), per request.",
                              buckets=buckets, registry=self.registry)
        self.latency = Histogram("simsd_request_latency_seconds", "Submission to the last token.",
                                 buckets=buckets, registry=self.registry)
        self.rejected = Counter("simsd_requests_rejected", "HTTP requests refused with 503, by reason.",
                                labelnames=["reason"], registry=self.registry)

    def observe(self, output, seconds: float) -> None:
        """Record a finished request (``seconds``: its end-to-end latency)."""
        self.latency.observe(seconds)
        ttft = output.stats.get("time_to_first_token")
        if ttft is not None:
            self.ttft.observe(ttft)
            n = len(output.token_ids)
            if n > 1:  # vLLM's definition: (latency - time to first token) / (tokens - 1)
                self.tpot.observe((seconds - ttft) / (n - 1))

    def render(self) -> tuple:
        """``(body bytes, content type)`` of the text exposition format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
