"""Writes perf/grafana_dashboard.json: a Grafana dashboard over the gateway's metrics (its /metrics),
the engine's (Triton's metrics port, deepinfer_*) and Triton's own (nv_inference_*: queue time).

    .venv/bin/python perf/grafana_dashboard.py        # rewrite the JSON (import it in Grafana; datasource: Prometheus)

tests/ensemble/test_dashboard.py checks that every metric a panel reads is one we export.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "grafana_dashboard.json"


def q(expr: str, legend: str) -> dict:
    return {"expr": expr, "legendFormat": legend, "datasource": {"type": "prometheus", "uid": "${datasource}"}}


def quantiles(metric: str, by: str = "") -> list[dict]:
    group = f"le{', ' + by if by else ''}"
    label = f"{{{{{by}}}}} " if by else ""
    return [q(f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket[5m])))", f"{label}p{int(p * 100)}")
            for p in (0.5, 0.99)]


PANELS = [
    ("Requests/s by API and status", "reqps", [q("sum by (api, status) (rate(deepinfer_gateway_requests_total[1m]))", "{{api}} {{status}}")]),
    ("Rejected/s by reason", "reqps", [q("sum by (reason) (rate(deepinfer_gateway_rejected_total[5m]))", "{{reason}}")]),
    ("End-to-end latency (gateway)", "s", quantiles("deepinfer_gateway_request_seconds", "api")),
    ("Time to first response (gateway: queue + prefill)", "s", quantiles("deepinfer_gateway_first_chunk_seconds", "api")),
    ("Time to first token (engine)", "s", quantiles("deepinfer_time_to_first_token_seconds")),
    ("Inter-token latency (engine)", "s", quantiles("deepinfer_inter_token_latency_seconds")),
    ("Engine request latency", "s", quantiles("deepinfer_e2e_request_latency_seconds")),
    ("Triton queue time per request", "µs", [q("sum by (model) (rate(nv_inference_queue_duration_us[1m])) / "
                                              "sum by (model) (rate(nv_inference_request_success[1m]))", "{{model}}")]),
    ("Tokens/s per API", "short", [q("sum by (api) (rate(deepinfer_gateway_prompt_tokens_total[1m]))", "{{api}} prompt"),
                                   q("sum by (api) (rate(deepinfer_gateway_generation_tokens_total[1m]))", "{{api}} generated")]),
    ("Finish reasons/s", "short", [q("sum by (api, reason) (rate(deepinfer_gateway_finish_total[5m]))", "{{api}} {{reason}}")]),
    ("Engine finishes/s", "short", [q(f"rate(deepinfer_requests_finished_{r}[5m])", r) for r in ("stop", "length", "abort", "error")]),
    ("Running / waiting / in flight", "short", [q("sum(deepinfer_num_requests_running)", "running"),
                                                q("sum(deepinfer_num_requests_waiting)", "waiting"),
                                                q("sum(deepinfer_gateway_requests_in_flight)", "gateway in flight")]),
    ("KV cache usage", "percentunit", [q("max(deepinfer_cache_usage)", "usage")]),
    ("Preemptions/s", "short", [q("rate(deepinfer_preemptions_total[5m])", "preemptions")]),
    ("DSpark acceptance", "short", [q("max(deepinfer_spec_acceptance_rate)", "acceptance rate"),
                                    q("max(deepinfer_spec_mean_accepted_length)", "tokens per verify step")]),
    ("Images encoded/s (vision tower)", "short", [q("sum(rate(deepinfer_images_encoded_total[1m]))", "images/s"),
                                                  q("sum(rate(deepinfer_image_encode_failures_total[5m]))",
                                                    "failed requests/s")]),
    ("Engine alive / stream errors", "short", [q("min(deepinfer_gateway_engine_alive)", "engine alive"),
                                               q("sum(rate(deepinfer_gateway_stream_errors_total[5m]))", "stream errors/s")]),
]


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({"id": i + 1, "type": "timeseries", "title": title, "targets": targets,
                       "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                       "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                       "datasource": {"type": "prometheus", "uid": "${datasource}"}})
    return {"title": "DeepSeek-V4.1-Flash on Triton (deepinfer)", "uid": "deepinfer-triton", "schemaVersion": 39,
            "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "panels": panels,
            "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]}}


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=1) + "\n")
    print(OUT)
