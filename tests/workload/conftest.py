"""Workload tests share a 2-core machine with other suites: run torch on one thread.

Session-scoped so it also covers session fixtures (the cached warm-start): with two OpenMP threads
on an oversubscribed machine, torch's spinning threads made the warm-start many times slower.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
