"""Optional OpenTelemetry tracing (`OTEL_TRACING=on`; the `tracing` extra: pip install '.[tracing]').

Every client made by core.temporal.connect (the workers' and the CLI's) gets Temporal's
`OpenTelemetryPlugin` with its Temporal spans: the span context travels in the workflow's and the
activities' headers, so a cleanup started by `starter.py cleanup` is one trace (StartWorkflow,
RunWorkflow, then StartActivity/RunActivity for the claim, each partition and the settlement),
whichever workers run its parts. A cleanup the planner starts belongs to the trace of the planner's
step that started it. Spans go to an OTLP exporter configured by the standard variables
(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`, ...). Off by default; with it off nothing of
OpenTelemetry is imported.
"""

from __future__ import annotations

from typing import Any

from core.config import Settings
from core.errors import InputError

_installed: list[Any] = []


def install_provider(provider: Any | None = None) -> None:
    """Make `provider` (default: a replay-safe one exporting over OTLP in batches) the process's
    tracer provider; only the first call counts, as OpenTelemetry allows one global provider."""
    if _installed:
        return
    import opentelemetry.trace
    from temporalio.contrib.opentelemetry import create_tracer_provider

    if provider is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = create_tracer_provider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    opentelemetry.trace.set_tracer_provider(provider)
    _installed.append(provider)


def plugins(settings: Settings) -> list[Any]:
    """The client plugins tracing needs: none when it is off."""
    if not settings.otel_tracing:
        return []
    try:
        from temporalio.contrib.opentelemetry import OpenTelemetryPlugin

        install_provider()
    except ImportError as err:
        raise InputError(
            f"OTEL_TRACING=on needs the tracing extra (pip install 'deadline-cleanup[tracing]'): {err}"
        ) from None
    return [OpenTelemetryPlugin(add_temporal_spans=True)]
