"""The launcher-held store: the ranks' port is owned from before they start until the block ends."""

from __future__ import annotations

import errno
import socket

import pytest

from rlctl.workload.rendezvous import held_store


def test_the_port_is_bound_while_held_and_ranks_join_as_clients() -> None:
    with held_store() as rendezvous:
        port = int(rendezvous["MASTER_PORT"])
        assert rendezvous["MASTER_ADDR"] == "127.0.0.1" and rendezvous["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        with socket.socket() as other, pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))  # no other process can be handed this port meanwhile
        assert refused.value.errno == errno.EADDRINUSE
        from torch.distributed import TCPStore

        client = TCPStore("127.0.0.1", port, is_master=False)
        client.set("k", "v")
        assert client.get("k") == b"v"
        del client
