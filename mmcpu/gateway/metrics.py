"""Prometheus metrics of one gateway app (own registry, so several apps can live in one process, e.g. in tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "mmcpu_gateway_requests",
            "Requests answered, by route template, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        # Buckets reach minutes: a CPU transcription or a long generation can take that long.
        self.latency = Histogram(
            "mmcpu_gateway_request_duration_seconds",
            "Time from request to the last byte of the response",
            ["route"],
            registry=r,
            buckets=(0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.upstream_errors = Counter(
            "mmcpu_gateway_upstream_errors",
            "Failed calls to an engine (connect, timeout, 5xx, broken stream)",
            ["engine", "kind"],
            registry=r,
        )
        self.engine_up = Gauge(
            "mmcpu_gateway_engine_up",
            "1 when the engine answered its last probe or request, else 0",
            ["engine"],
            registry=r,
        )
