"""Checksums of flat weight buffers: self-describing, and computed leaf by leaf on several threads.

Role: a holder checksums what it publishes and a joiner verifies what it received; for a 16 GB
model one thread hashing the whole buffer (xxh3 about 7 GB/s, sha256 under 1 GB/s here) costs
more than moving it. A checksum is the string ``"<algorithm>:<hex digest>"``:

* ``xxh3_128-t64m`` / ``sha256-t64m`` (the defaults, xxh3 when ``xxhash`` imports): a two-level
  tree. The buffer is cut into 64 MiB leaves (the last one shorter, none for an empty buffer);
  the digest is the base hash of the concatenated leaf digests. Leaves are hashed on a thread
  pool (both hashes release the GIL), and a holder hashes each leaf as soon as its bytes are
  staged (``LeafHasher``), so the checksum overlaps the copy instead of following it.
* ``xxh3_128`` / ``sha256``: the base hash of the whole buffer on one thread (still verified, so
  a joiner accepts what an older holder publishes).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from rlctl.weights.errors import WeightIntegrityError

LEAF_BYTES = 64 * 2**20
COPY_PIECE_BYTES = 2**20  # ``copy_leaves``: a piece copied then hashed while it is in the core's cache
TREE_SUFFIX = "-t64m"
BASE_ALGORITHMS = ("xxh3_128", "sha256")
MAX_HASH_THREADS = 16

Buffer = np.ndarray  # a 1-D, C-contiguous uint8 array

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def hash_threads() -> int:
    """Threads the leaf hashing uses: one per CPU this process may run on, at most ``MAX_HASH_THREADS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_HASH_THREADS, cpus))


def _forget_pool_in_child() -> None:
    """A forked child has none of the pool's threads: it makes its own on first use."""
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool_in_child)


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=hash_threads(), thread_name_prefix="rlctl-hash")
        return _pool


def default_checksum_algorithm() -> str:
    """``xxh3_128-t64m`` when xxhash is importable, else ``sha256-t64m``."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "sha256" + TREE_SUFFIX
    return "xxh3_128" + TREE_SUFFIX


def checksum_algorithm_of(checksum: str) -> str:
    """The algorithm part of ``checksum``; ``WeightIntegrityError`` unless it is ``<algorithm>:<hex>``."""
    algorithm, sep, digest = checksum.partition(":")
    if not sep or not digest:
        raise WeightIntegrityError(f"checksum {checksum!r} is not '<algorithm>:<hex>'")
    return algorithm


def _split(algorithm: str) -> tuple[str, bool]:
    """``(base hash, tree?)``; ``WeightIntegrityError`` for an unknown algorithm."""
    tree = algorithm.endswith(TREE_SUFFIX)
    base = algorithm.removesuffix(TREE_SUFFIX)
    if base not in BASE_ALGORITHMS:
        raise WeightIntegrityError(f"unknown checksum algorithm {algorithm!r}")
    return base, tree


def _digest_function(base: str) -> Callable[[memoryview], bytes]:
    if base == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    return _xxhash(base).xxh3_128_digest  # type: ignore[no-any-return]


def _streaming_hash(base: str) -> Callable[[], Any]:
    """A factory of incremental hashers (``update``, ``digest``) of ``base``: the same digest as
    ``_digest_function(base)`` of the bytes fed."""
    if base == "sha256":
        return hashlib.sha256
    return _xxhash(base).xxh3_128  # type: ignore[no-any-return]


def _xxhash(base: str) -> Any:
    try:
        import xxhash
    except ImportError as exc:
        raise WeightIntegrityError(f"checksum uses {base} but xxhash is not installed here") from exc
    return xxhash


def leaf_count(nbytes: int) -> int:
    return -(-nbytes // LEAF_BYTES)


def compute_checksum(buffer: Buffer, algorithm: str | None = None) -> str:
    """Checksum of the whole buffer as ``"<algorithm>:<hex>"`` (tree leaves hashed in parallel)."""
    algorithm = algorithm or default_checksum_algorithm()
    base, tree = _split(algorithm)
    digest = _digest_function(base)
    data = buffer.data.cast("B")
    if not tree:
        return f"{algorithm}:{digest(data).hex()}"
    hasher = LeafHasher(algorithm, buffer)
    hasher.staged_up_to(buffer.nbytes)
    return hasher.checksum()


def copy_leaves(source: Buffer, dest: Buffer, algorithm: str | None = None) -> str | None:
    """Copy ``source`` into ``dest`` (same size) leaf by leaf on the thread pool; with a tree
    ``algorithm``, each leaf is hashed from ``dest`` as its copy lands, and the checksum of what
    landed is returned (None otherwise: the caller hashes ``dest`` when it needs to). A leaf is
    copied and hashed in pieces of ``COPY_PIECE_BYTES``, so the hash reads each piece from the
    core's cache instead of memory (docs/weight-sync.md has the figures)."""
    if source.nbytes != dest.nbytes:
        raise ValueError(f"copying {source.nbytes} bytes into a buffer of {dest.nbytes}")
    streaming: Callable[[], Any] | None = None
    digest: Callable[[memoryview], bytes] | None = None
    if algorithm is not None:
        base, tree = _split(algorithm)
        if tree:
            streaming, digest = _streaming_hash(base), _digest_function(base)

    def leaf(start: int) -> bytes:
        stop = min(start + LEAF_BYTES, dest.nbytes)
        hasher = streaming() if streaming is not None else None
        for piece in range(start, stop, COPY_PIECE_BYTES):
            end = min(piece + COPY_PIECE_BYTES, stop)
            np.copyto(dest[piece:end], source[piece:end])
            if hasher is not None:
                hasher.update(dest[piece:end].data.cast("B"))
        return hasher.digest() if hasher is not None else b""

    leaves = [_hash_pool().submit(leaf, start) for start in range(0, dest.nbytes, LEAF_BYTES)]
    try:
        combined = b"".join(done.result() for done in leaves)
    finally:  # on a failure, no copy may still write into ``dest`` or read ``source`` once this returns
        for pending in leaves:
            pending.cancel()
        wait(leaves)
    if digest is None or algorithm is None:
        return None
    return f"{algorithm}:{digest(memoryview(combined)).hex()}"


class LeafHasher:
    """Hashes the 64 MiB leaves of ``buffer`` on the thread pool as its bytes become final.

    The caller fills ``buffer`` front to back and calls ``staged_up_to(offset)`` whenever every
    byte below ``offset`` is final; each leaf wholly below it is handed to the pool then. The
    last call must cover the whole buffer; ``checksum()`` waits for the leaves and combines them.
    A non-tree algorithm hashes the whole buffer once at the end (on the pool, but in one piece).
    """

    def __init__(self, algorithm: str, buffer: Buffer) -> None:
        self.algorithm = algorithm
        self._base, self._tree = _split(algorithm)
        self._digest = _digest_function(self._base)
        self._data = buffer.data.cast("B")
        self._nbytes = buffer.nbytes
        self._next_leaf = 0
        self._leaves: list[Future[bytes]] = []

    def staged_up_to(self, offset: int) -> None:
        """Every byte below ``offset`` is final: hash the leaves that lie wholly below it."""
        if not self._tree:
            return
        pool = _hash_pool()
        while self._next_leaf * LEAF_BYTES < self._nbytes:
            start = self._next_leaf * LEAF_BYTES
            stop = min(start + LEAF_BYTES, self._nbytes)
            if stop > offset:
                break
            self._leaves.append(pool.submit(self._digest, self._data[start:stop]))
            self._next_leaf += 1

    def checksum(self) -> str:
        """The finished checksum (blocks until every leaf is hashed)."""
        if not self._tree:
            return f"{self.algorithm}:{self._digest(self._data).hex()}"
        if self._next_leaf != leaf_count(self._nbytes):
            raise RuntimeError(f"only {self._next_leaf} of {leaf_count(self._nbytes)} leaves were staged")
        combined = b"".join(leaf.result() for leaf in self._leaves)
        return f"{self.algorithm}:{self._digest(memoryview(combined)).hex()}"

    def abandon(self) -> None:
        """Cancel the leaves not yet started (staging failed: the checksum will never be asked for)."""
        for leaf in self._leaves:
            leaf.cancel()
