"""The Grafana dashboard (perf/grafana_dashboard.json) reads only metrics we export: the gateway's
(ensemble/gateway_metrics.py), the engine's (ensemble/metrics.py) and Triton's own nv_inference_*;
and the committed JSON is what perf/grafana_dashboard.py writes."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from deepinfer.ensemble import gateway_metrics, metrics

ROOT = Path(__file__).resolve().parents[2]
TRITON_OWN = {"nv_inference_queue_duration_us", "nv_inference_request_success"}


def exported() -> set[str]:
    names = {f"deepinfer_gateway_{n}" for n in gateway_metrics._HELP}
    names |= {f"deepinfer_{n}" for n in [*metrics.COUNTERS, *metrics.GAUGES, *metrics.PARALLEL_GAUGES]}
    names |= {f"deepinfer_{n}" for n in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                                         "e2e_request_latency_seconds")}
    return names | TRITON_OWN


def test_panels_read_exported_metrics():
    board = json.loads((ROOT / "perf" / "grafana_dashboard.json").read_text())
    used = set()
    for panel in board["panels"]:
        for target in panel["targets"]:
            used |= {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\b(?:deepinfer|nv)_[a-z0-9_]+", target["expr"])}
    assert used and not used - exported(), f"panels read metrics nobody exports: {sorted(used - exported())}"
    assert {"deepinfer_gateway_rejected_total", "deepinfer_preemptions_total", "nv_inference_queue_duration_us"} <= used


def test_committed_json_is_generated():
    spec = importlib.util.spec_from_file_location("grafana_dashboard", ROOT / "perf" / "grafana_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert json.loads((ROOT / "perf" / "grafana_dashboard.json").read_text()) == mod.dashboard()


def test_gateway_metrics_exposition():
    m = gateway_metrics.GatewayMetrics()
    m.request_done("messages", 404, 0.2)
    m.answered("chat.completions", 10, 4, "length")
    text = m.render()
    assert 'deepinfer_gateway_rejected_total{api="messages",reason="not_found"} 1' in text
    assert 'deepinfer_gateway_request_seconds_bucket{api="messages",le="0.25"} 1' in text
    assert 'deepinfer_gateway_request_seconds_bucket{api="messages",le="0.1"} 0' in text
    assert 'deepinfer_gateway_generation_tokens_total{api="chat.completions"} 4' in text
