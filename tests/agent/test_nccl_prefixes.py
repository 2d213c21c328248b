"""The watchdog timeout line is recognised with both PyTorch prefixes ("[Rank N]" and the newer
"[PG ID p PG GUID g Rank N]")."""

from __future__ import annotations

import pytest
from rlctl_agent.nccl import parse_line

BODY = ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, "
        "Timeout(ms)=60000) ran for 60015 milliseconds before timing out.")


@pytest.mark.parametrize("prefix,rank", [("[Rank 3]", 3), ("[PG ID 0 PG GUID 0(default_pg) Rank 1]", 1)])
def test_both_prefixes_parse(prefix: str, rank: int) -> None:
    event = parse_line(f"[rank{rank}]:[E1121 18:33:34.811716000 ProcessGroupNCCL.cpp:684] {prefix} {BODY}")
    assert event is not None and event.kind == "nccl-timeout"
    assert (event.rank, event.seq, event.op_type, event.timeout_ms, event.ran_ms) == (rank, 7, "ALLREDUCE", 60000, 60015)
