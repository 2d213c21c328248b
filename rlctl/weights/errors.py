"""Errors raised by weight publication and transfer.

`WeightIntegrityError` means the bytes or the metadata that arrived are not what the source
descriptor promised (version, size or checksum mismatch, malformed manifest). The joiner must
not use them. `WeightTransferError` means the transfer itself failed (holder gone, timeout,
refused request); the joiner may retry against another holder.
"""

from __future__ import annotations


class WeightError(Exception):
    """Base class of every error raised by `rlctl.weights`."""


class WeightIntegrityError(WeightError):
    """Received weights do not match the version, size or checksum that was announced."""


class WeightVersionMovedError(WeightIntegrityError):
    """The holder serves another version than the descriptor named (it moved on to a newer one, or
    was rolled back): ``sent`` is the version it serves, ``expected`` the one asked for."""

    def __init__(self, expected: int, sent: int) -> None:
        super().__init__(f"version mismatch: expected v{expected}, holder sent v{sent}")
        self.expected, self.sent = expected, sent


class WeightTransferError(WeightError):
    """A transfer could not complete: holder unreachable or gone, timeout, refused request."""


class WeightTimeoutError(WeightTransferError):
    """A transfer did not complete before its deadline (the holder may be hung or overloaded)."""


class TransportUnavailableError(WeightError):
    """The requested transport cannot be used in this process (e.g. ucxx is not installed)."""
