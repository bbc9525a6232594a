"""/metrics from the online rebalancer's cumulative report on rank 0's load: a counter of rebalances, the
balancedness gauge, and every execute stall once in the histogram, however the scrapes fall."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from moeserve.eplb.rebalancer import RebalanceReport
from moeserve.rank.io_struct import LoadOut
from moeserve.server.http.metrics import Metrics


def _samples(text: bytes) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples
            if s.name.startswith("moeserve:eplb")}


def _load(report: RebalanceReport | None, dp_rank: int = 0) -> LoadOut:
    return LoadOut(dp_rank, 0, 0, 0, 0, 100, 0, eplb=report)


def test_rebalancer_report_becomes_metrics():
    m = Metrics("m")
    s = _samples(m.render([_load(RebalanceReport(0, 0.42, 0, [])), _load(None, 1)]))
    assert s["moeserve:eplb_rebalances_total"] == 0 and s["moeserve:eplb_balancedness"] == 0.42
    s = _samples(m.render([_load(RebalanceReport(1, 0.97, 3, [0.001, 0.002, 0.004]))]))
    assert s["moeserve:eplb_rebalances_total"] == 1 and s["moeserve:eplb_balancedness"] == 0.97
    assert s["moeserve:eplb_stall_seconds_count"] == 3 and abs(s["moeserve:eplb_stall_seconds_sum"] - 0.007) < 1e-12
    s = _samples(m.render([_load(RebalanceReport(1, 0.97, 3, [0.001, 0.002, 0.004]))]))  # nothing new
    assert s["moeserve:eplb_rebalances_total"] == 1 and s["moeserve:eplb_stall_seconds_count"] == 3
    s = _samples(m.render([_load(RebalanceReport(2, 0.99, 5, [0.002, 0.004, 0.01, 0.02]))]))  # a trimmed list
    assert s["moeserve:eplb_rebalances_total"] == 2 and s["moeserve:eplb_stall_seconds_count"] == 5
    assert abs(s["moeserve:eplb_stall_seconds_sum"] - 0.037) < 1e-12
