"""Prometheus metrics (lesson L11, §2.6 "Metrics"): what an operator watches on a dashboard.

Gauges are set from the engine after every step; counters grow by what changed since the last
step; the two latency histograms get one observation per token. All of it runs on the engine
thread (prometheus_client's metrics are thread-safe; /metrics reads them from the server's).
Each server has its own registry, so tests can run several in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from l5_eviction import State

PREFIX = "kvcourse"
# Seconds. The tiny model on a CPU makes a token in ~5-50 ms; a real one on a GPU in 10-100 ms.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge(f"{PREFIX}_requests_running", "Requests holding blocks and decoding", registry=r)
        self.waiting = Gauge(f"{PREFIX}_requests_waiting", "Requests queued or preempted, not running", registry=r)
        self.blocks_total = Gauge(f"{PREFIX}_kv_blocks_total", "Blocks in the KV pool", registry=r)
        self.blocks_used = Gauge(f"{PREFIX}_kv_blocks_used", "Blocks held by at least one request", registry=r)
        self.blocks_free = Gauge(f"{PREFIX}_kv_blocks_free", "Blocks no request holds (cached ones included)",
                                 registry=r)
        self.blocks_cached = Gauge(f"{PREFIX}_kv_blocks_cached", "Free blocks that still hold a prefix's K/V",
                                   registry=r)
        self.usage = Gauge(f"{PREFIX}_kv_cache_usage_ratio", "Used blocks / total blocks (0..1)", registry=r)
        self.hit_rate = Gauge(f"{PREFIX}_prefix_cache_hit_rate", "Prompt tokens found cached / prompt tokens "
                              "admitted, since start", registry=r)
        self.prefix_queries = Counter(f"{PREFIX}_prefix_cache_queries_tokens", "Prompt tokens looked up in "
                                      "the prefix cache at admission", registry=r)
        self.prefix_hits = Counter(f"{PREFIX}_prefix_cache_hits_tokens", "Prompt tokens found in the prefix "
                                   "cache (not computed)", registry=r)
        self.preemptions = Counter(f"{PREFIX}_preemptions", "Requests preempted (recompute or swap)", registry=r)
        self.forks = Counter(f"{PREFIX}_forks", "Samples n>1 forked from a prefilled prompt", registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(f"{PREFIX}_requests_finished", "Engine requests finished, by reason",
                                ["reason"], registry=r)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "HTTP requests refused, by reason", ["reason"],
                                registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between two tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self._seen = {"preempted": 0, "queries": 0, "hits": 0}  # engine totals at the last step
        self.last_token_at: dict[int, float] = {}  # request id -> when its latest token went out

    def observe_step(self, engine, new_tokens: dict[int, int], arrived_at: dict[int, float], now: float) -> None:
        """Book one step. new_tokens: request id -> tokens it made this step (only those that made any);
        arrived_at: group (the request id of sample 0) -> when its HTTP request arrived; now: seconds."""
        # BEGIN SOLUTION
        a, s = engine.alloc, engine.scheduler
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting) + len(s.swapped))
        self.blocks_total.set(a.num_blocks)
        self.blocks_used.set(a.num_used)
        self.blocks_free.set(a.num_free)
        self.blocks_cached.set(len(a.cached_free))
        self.usage.set(a.num_used / a.num_blocks)
        c, p = engine.prefix, engine.preemptor.counters
        totals = {"preempted": p.preempted_recompute + p.preempted_swap,
                  "queries": c.prefill_tokens_total, "hits": c.prefix_hit_tokens}
        self.preemptions.inc(totals["preempted"] - self._seen["preempted"])
        self.prefix_queries.inc(totals["queries"] - self._seen["queries"])
        self.prefix_hits.inc(totals["hits"] - self._seen["hits"])
        self._seen = totals
        self.hit_rate.set(c.prefix_hit_tokens / c.prefill_tokens_total if c.prefill_tokens_total else 0.0)
        for rid, n in new_tokens.items():
            req = engine.requests[rid]
            self.generation_tokens.inc(n)
            if rid in self.last_token_at:
                self.itl.observe(now - self.last_token_at[rid])
            else:
                self.ttft.observe(now - arrived_at[req.group])
                if req.sample_index > 0 and engine.sharing:
                    self.forks.inc()  # a fork's first token is its birth
            self.last_token_at[rid] = now
            if req.state is State.FINISHED:
                self.finished.labels(req.finish_reason).inc()
                del self.last_token_at[rid]
        # END SOLUTION

    def request_gone(self, req) -> None:
        """A request that finished without making a token this step (aborted): forget its clock."""
        if req.request_id in self.last_token_at:
            del self.last_token_at[req.request_id]
        self.finished.labels(req.finish_reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
