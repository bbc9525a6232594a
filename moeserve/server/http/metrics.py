"""Prometheus metrics of the HTTP server, named like SGLang's (`moeserve:` where SGLang has `sglang:`).

Latency histograms are observed by the server as outputs stream back (TTFT and inter-token latency only for
requests served with `stream: true`, since a non-streamed request's tokens arrive all at once); counters at
each request's end; load gauges are read from the engine's latest per-DP-group load at scrape time
(GET /metrics, served by info.py).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """One server's metrics in its own registry (so tests can build many apps in one process)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = list(self.labels)
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(f"moeserve:{name}", doc, names, registry=r, buckets=buckets).labels(**self.labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"moeserve:{name}", doc, names, registry=r).labels(**self.labels)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (streamed requests).",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between streamed chunks.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.prompt_tokens = Counter("moeserve:prompt_tokens", "Prompt tokens of finished requests.", names,
                                     registry=r).labels(**self.labels)
        self.generation_tokens = Counter("moeserve:generation_tokens", "Generated tokens of finished requests.",
                                         names, registry=r).labels(**self.labels)
        self.cached_tokens = Counter("moeserve:cached_tokens", "Prompt tokens served from the prefix cache.",
                                     names, registry=r).labels(**self.labels)
        self.request_success = Counter("moeserve:request_success", "Finished requests by finish reason.",
                                       [*names, "finished_reason"], registry=r)
        self.num_running_reqs = gauge("num_running_reqs", "Requests decoding now (all DP groups).")
        self.num_queue_reqs = gauge("num_queue_reqs", "Requests waiting to be scheduled (all DP groups).")
        self.num_used_tokens = gauge("num_used_tokens", "KV cache tokens in use (all DP groups).")
        self.token_usage = gauge("token_usage", "Fraction of the KV cache in use (SGLang's name).")
        self.kv_cache_usage = gauge("kv_cache_usage", "Fraction of the KV cache in use (same as token_usage).")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens.")
        self.eplb_rebalances = Counter("moeserve:eplb_rebalances", "Online EPLB rebalances completed.", names,
                                       registry=r).labels(**self.labels)
        self.eplb_balancedness = gauge("eplb_balancedness", "Mean over MoE layers of mean / max routed tokens per "
                                       "GPU, over the last EPLB window, under the placement in force.")
        self.eplb_stall = histogram("eplb_stall_seconds", "Time a rebalance's execute phase added to a forward "
                                    "pass (one chunk of MoE layers).", _ITL_BUCKETS)
        # PD disaggregation (LoadOut.disagg of each DP group): requests per state, KV transfers so far
        self.pd_requests = Gauge("moeserve:pd_requests", "PD requests per state on this side (all DP groups).",
                                 [*names, "side", "state"], registry=r)
        self.pd_transfers = Counter("moeserve:pd_transfers", "KV transfers completed.", names,
                                    registry=r).labels(**self.labels)
        self.pd_transfer_bytes = Counter("moeserve:pd_transfer_bytes", "KV bytes transferred.", names,
                                         registry=r).labels(**self.labels)
        self.pd_transfer_seconds = Counter(
            "moeserve:pd_transfer_seconds", "Sum of KV transfer latencies (prefill: from decode's destination to the "
            "last write; decode: from the prefill's first write to its report).", names, registry=r).labels(**self.labels)
        self.pd_transfer_write_seconds = Counter(
            "moeserve:pd_transfer_write_seconds", "Sum of the time spent inside KV writes (prefill; writes may "
            "overlap: bytes over this is one write's rate).", names, registry=r).labels(**self.labels)
        self.pd_failures = Counter("moeserve:pd_failures", "PD requests failed or cancelled, by cause "
                                   "(docs/disaggregation.md).", [*names, "side", "cause"], registry=r)
        # speculative decoding (LoadOut.spec of each DP group)
        self.spec_draft_tokens = Counter("moeserve:spec_draft_tokens", "Draft tokens verified.", names,
                                         registry=r).labels(**self.labels)
        self.spec_accepted_tokens = Counter("moeserve:spec_accepted_tokens", "Draft tokens accepted.", names,
                                            registry=r).labels(**self.labels)
        self.spec_verify_steps = Counter("moeserve:spec_verify_steps", "Verify rounds (one per request per "
                                         "verify step).", names, registry=r).labels(**self.labels)
        self.spec_accept_length = gauge("spec_accept_length", "Tokens a verify round emits per request (accepted "
                                        "drafts + 1), over the rounds since the last update.")
        self._spec_seen = (0, 0, 0)
        # hierarchical KV cache: prompt tokens by the tier they were cached on (each response's
        # cached_tokens_details), and each DP group's host tier (LoadOut.hicache)
        self.hicache_hit_tokens = Counter("moeserve:hicache_hit_tokens", "Prompt tokens served from the prefix "
                                          "cache, by tier (device, host).", [*names, "tier"], registry=r)
        self.hicache_bytes = Counter("moeserve:hicache_bytes", "KV bytes the hierarchical cache copied, by "
                                     "direction (to_host, to_device, to_storage, from_storage).",
                                     [*names, "direction"], registry=r)
        self.hicache_load_back_seconds = Counter(
            "moeserve:hicache_load_back_seconds", "Time spent loading host pages back to the device (the requests "
            "whose prefix they were waited for it).", names, registry=r).labels(**self.labels)
        self.hicache_storage_pages_dropped = Counter(
            "moeserve:hicache_storage_pages_dropped", "Pages the storage tier did not write: its writer was too far "
            "behind (a later miss, never a wrong page).", names, registry=r).labels(**self.labels)
        self.hicache_host_tokens = gauge("hicache_host_tokens", "KV tokens held in the host tier (all DP groups).")
        self._hicache_seen: dict[str, float] = {}
        self._pd_seen = (0, 0, 0.0, 0.0)
        self._pd_failures_seen: dict[str, int] = {}
        self._prompt_total = 0
        self._cached_total = 0
        self._eplb_seen = (0, 0)  # (rebalances, stalls) already counted

    # ------------------------------------------------------------------
    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_chunk_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_finish(self, meta: dict, e2e_seconds: float) -> None:
        finish = meta.get("finish_reason") or {}
        reason = finish.get("type", "unknown") if isinstance(finish, dict) else str(finish)
        prompt = int(meta.get("prompt_tokens") or 0)
        cached = int(meta.get("cached_tokens") or 0)
        self.e2e.observe(e2e_seconds)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(int(meta.get("completion_tokens") or 0))
        self.cached_tokens.inc(cached)
        self.request_success.labels(**self.labels, finished_reason=reason).inc()
        for tier, n in (meta.get("cached_tokens_details") or {}).items():
            self.hicache_hit_tokens.labels(**self.labels, tier=tier).inc(n)
        self._prompt_total += prompt
        self._cached_total += cached

    def update_load(self, loads: list[Any]) -> None:
        """Set the gauges from the engine's latest LoadOut of each DP group."""
        used = sum(getattr(x, "kv_used_tokens", 0) for x in loads)
        total = sum(getattr(x, "kv_total_tokens", 0) for x in loads)
        self.num_running_reqs.set(sum(getattr(x, "num_running", 0) for x in loads))
        self.num_queue_reqs.set(sum(getattr(x, "num_waiting", 0) for x in loads))
        self.num_used_tokens.set(used)
        self.token_usage.set(used / total if total else 0.0)
        self.kv_cache_usage.set(used / total if total else 0.0)
        self.cache_hit_rate.set(self._cached_total / self._prompt_total if self._prompt_total else 0.0)
        report = next((x.eplb for x in loads if getattr(x, "eplb", None) is not None), None)
        if report is not None:
            self._update_eplb(report)
        pd = [x.disagg for x in loads if getattr(x, "disagg", None)]
        if pd:
            self._update_pd(pd)
        tiers = [x.hicache for x in loads if getattr(x, "hicache", None)]
        if tiers:
            self._update_hicache(tiers)
        spec = [x.spec for x in loads if getattr(x, "spec", None)]
        if spec:
            self._update_spec(spec)

    def _update_spec(self, groups: list[tuple[int, int, int]]) -> None:
        """From each DP group's cumulative (rounds, drafted, accepted): the counters' growth since the last update
        and the accept length over it."""
        now = tuple(sum(g[i] for g in groups) for i in range(3))
        rounds, drafted, accepted = (max(0, n - o) for n, o in zip(now, self._spec_seen, strict=True))
        self.spec_verify_steps.inc(rounds)
        self.spec_draft_tokens.inc(drafted)
        self.spec_accepted_tokens.inc(accepted)
        if rounds:
            self.spec_accept_length.set((accepted + rounds) / rounds)
        self._spec_seen = now

    def _update_hicache(self, groups: list[dict]) -> None:
        """From each DP group's cumulative host-tier counters: their growth since the last scrape."""
        self.hicache_host_tokens.set(sum(g["host_used_tokens"] for g in groups))
        for name in ("bytes_to_host", "bytes_to_device", "bytes_to_storage", "bytes_from_storage",
                     "load_back_seconds", "storage_pages_dropped"):
            now = sum(g.get(name, 0) for g in groups)
            grown = now - self._hicache_seen.get(name, 0)
            self._hicache_seen[name] = now
            if grown <= 0:
                continue
            if name == "load_back_seconds":
                self.hicache_load_back_seconds.inc(grown)
            elif name == "storage_pages_dropped":
                self.hicache_storage_pages_dropped.inc(grown)
            else:
                self.hicache_bytes.labels(**self.labels, direction=name.removeprefix("bytes_")).inc(grown)

    def _update_pd(self, groups: list[dict]) -> None:
        """From each DP group's cumulative PD counters: the state gauges, and the counters' growth since the last
        scrape."""
        side = groups[0]["mode"]
        for state in groups[0]["states"]:
            self.pd_requests.labels(**self.labels, side=side, state=state).set(
                sum(g["states"][state] for g in groups))
        now = (sum(g["transfers"] for g in groups), sum(g["transfer_bytes"] for g in groups),
               sum(g["transfer_seconds"] for g in groups), sum(g["write_seconds"] for g in groups))
        for counter, new, old in zip((self.pd_transfers, self.pd_transfer_bytes, self.pd_transfer_seconds,
                                      self.pd_transfer_write_seconds), now, self._pd_seen, strict=True):
            if new > old:
                counter.inc(new - old)
        self._pd_seen = now
        for cause in {c for g in groups for c in g["failures"]}:
            new = sum(g["failures"].get(cause, 0) for g in groups)
            if new > self._pd_failures_seen.get(cause, 0):
                self.pd_failures.labels(**self.labels, side=side, cause=cause).inc(
                    new - self._pd_failures_seen.get(cause, 0))
                self._pd_failures_seen[cause] = new

    def _update_eplb(self, report: Any) -> None:
        """From rank 0's cumulative rebalancer report: what happened since the last scrape."""
        rebalances, stalls = self._eplb_seen
        self.eplb_rebalances.inc(max(0, report.rebalances - rebalances))
        new = report.num_stalls - stalls
        for s in report.stalls_s[len(report.stalls_s) - min(new, len(report.stalls_s)):] if new > 0 else []:
            self.eplb_stall.observe(s)
        if report.balancedness is not None:
            self.eplb_balancedness.set(report.balancedness)
        self._eplb_seen = (report.rebalances, report.num_stalls)

    def render(self, loads: list[Any]) -> bytes:
        self.update_load(loads)
        return generate_latest(self.registry)

