"""The controller's /metrics endpoint over real loopback HTTP: the exposition Prometheus parses,
gzip when asked, 404/405 for anything else, a stranger that never finishes its request cut off,
and the gather run on the event loop for each scrape."""

from __future__ import annotations

import asyncio
import gzip
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlctl.core.telemetry import LATENCY_BUCKETS_S, Family, Histogram
from rlctl.observe import prometheus
from rlctl.observe.prometheus import MetricsEndpoint


def sample_families(calls: list[int]) -> list[Family]:
    calls.append(1)
    return [
        Family("rlctl_step", "gauge", "steps", [({}, 7.0)]),
        Family("rlctl_faults_total", "counter", "faults", [({"kind": "crash", "role": "trainer"}, 2.0)]),
        Family("rlctl_fault_detection_seconds", "histogram", "detection",
               histograms=[({}, Histogram.of(LATENCY_BUCKETS_S, [0.3, 4.0]))]),
    ]


def fetch(url: str, gzip_ok: bool = False) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"} if gzip_ok else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


async def serve_and(check, monkeypatch: pytest.MonkeyPatch | None = None) -> list[int]:
    calls: list[int] = []
    endpoint = MetricsEndpoint("job-7", lambda: sample_families(calls))
    port = await endpoint.start("127.0.0.1", 0)
    try:
        await asyncio.to_thread(check, port)
    finally:
        await endpoint.close()
    return calls


def test_a_scrape_is_what_prometheus_parses_with_the_job_label() -> None:
    def check(port: int) -> None:
        status, headers, body = fetch(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=")
        parsed = {f.name: f for f in text_string_to_metric_families(body.decode())}
        assert parsed["rlctl_step"].samples[0].value == 7.0
        assert parsed["rlctl_faults"].samples[0].labels == {"job_id": "job-7", "kind": "crash", "role": "trainer"}
        buckets = {s.labels["le"]: s.value for s in parsed["rlctl_fault_detection_seconds"].samples
                   if s.name.endswith("_bucket")}
        assert buckets["0.5"] == 1 and buckets["5.0"] == 2 and buckets["+Inf"] == 2
        status, headers, packed = fetch(f"http://127.0.0.1:{port}/metrics", gzip_ok=True)
        assert headers.get("Content-Encoding") == "gzip" and gzip.decompress(packed) == body

    assert len(asyncio.run(serve_and(check))) == 2


def test_other_paths_and_methods_are_refused_and_a_slow_stranger_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prometheus, "READ_TIMEOUT_S", 0.5)

    def check(port: int) -> None:
        assert fetch(f"http://127.0.0.1:{port}/")[0] == 404
        post = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(post, timeout=10)
        assert refused.value.code == 405
        with socket.create_connection(("127.0.0.1", port), timeout=5) as stranger:
            stranger.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
            stranger.settimeout(5)
            assert stranger.recv(100) == b"", "the endpoint closes a request head that does not come"
        assert fetch(f"http://127.0.0.1:{port}/metrics")[0] == 200

    assert len(asyncio.run(serve_and(check))) == 1
