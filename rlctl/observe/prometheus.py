"""The controller's ``/metrics`` endpoint (Prometheus text format, via ``prometheus_client``).

A small HTTP/1.1 server on the controller's own event loop: a scrape reads the job model on the
loop (one consistent moment, no lock), then renders and compresses the text in a worker thread
so that a 4,096-node scrape does not hold the loop. Every series carries ``job_id``. Strangers
are bounded: a request head must arrive within ``READ_TIMEOUT_S`` and fit in ``MAX_HEAD_BYTES``,
and at most ``MAX_CONNECTIONS`` connections are served at once (more are closed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rlctl.core.telemetry import Family

log = logging.getLogger("rlctl.observe.prometheus")

MAX_HEAD_BYTES = 8192
READ_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 16


def render(job_id: str, families: list[Family], compress: bool = False) -> bytes:
    """The exposition text of ``families``, every sample labelled with ``job_id``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(job_id, families))
    body = generate_latest(registry)
    return gzip.compress(body, compresslevel=5) if compress else body


class _Families:
    """A collector over values already gathered (prometheus_client calls ``collect``)."""

    def __init__(self, job_id: str, families: list[Family]) -> None:
        self.job_id = job_id
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield _metric(self.job_id, family)


def _metric(job_id: str, family: Family) -> Metric:
    first = family.samples[0][0] if family.samples else (family.histograms[0][0] if family.histograms else {})
    keys = ["job_id", *first]
    if family.kind == "histogram":
        histogram_family = HistogramMetricFamily(family.name, family.help, labels=keys)
        for labels, histogram in family.histograms:
            buckets = [(_bound(bound), float(n)) for bound, n in zip(histogram.bounds, histogram.counts)]
            buckets.append(("+Inf", float(histogram.count)))
            histogram_family.add_metric([job_id, *(labels[k] for k in first)], buckets, histogram.total)
        return histogram_family
    metric_family: GaugeMetricFamily | CounterMetricFamily = (
        CounterMetricFamily(family.name, family.help, labels=keys) if family.kind == "counter"
        else GaugeMetricFamily(family.name, family.help, labels=keys))
    for labels, value in family.samples:
        metric_family.add_metric([job_id, *(labels[k] for k in first)], value)
    return metric_family


def _bound(bound: float) -> str:
    return repr(float(bound))


class MetricsEndpoint:
    """Serves ``GET /metrics``; ``gather`` is called on the loop for each scrape."""

    def __init__(self, job_id: str, gather: Callable[[], list[Family]]) -> None:
        self.job_id = job_id
        self.gather = gather
        self.port = 0
        self.scrapes = 0
        self._server: asyncio.base_events.Server | None = None
        self._open = 0

    async def start(self, host: str, port: int) -> int:
        """Bind (raises OSError when the address cannot be had); returns the bound port."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_CONNECTIONS:
            writer.close()
            return
        self._open += 1
        try:
            await self._answer(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            pass
        finally:
            self._open -= 1
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        parts = request_line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            await self._reply(writer, 400, b"bad request\n", "text/plain")
            return
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            await self._reply(writer, 405, b"only GET\n", "text/plain")
            return
        if target != "/metrics":
            await self._reply(writer, 404, b"see /metrics\n", "text/plain")
            return
        headers = {name.strip().lower(): value.strip() for name, _, value in
                   (line.partition(":") for line in header_lines if line)}
        compress = "gzip" in headers.get("accept-encoding", "")
        families = self.gather()
        body = await asyncio.to_thread(render, self.job_id, families, compress)
        self.scrapes += 1
        await self._reply(writer, 200, body if method == "GET" else b"", CONTENT_TYPE_LATEST,
                          gzip_encoded=compress, length=len(body))

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str,
                     gzip_encoded: bool = False, length: int | None = None) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}[status]
        lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}",
                 f"Content-Length: {len(body) if length is None else length}", "Connection: close"]
        if gzip_encoded:
            lines.append("Content-Encoding: gzip")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
