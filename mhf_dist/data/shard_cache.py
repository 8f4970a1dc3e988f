"""Shards of a bucket on the local disk: each downloaded whole (a few large ranged GETs) into a temporary
file, read there by index, and dropped again past a bound.

An object store answers a request far slower than a disk (tens of milliseconds), and a whole shard
costs about one request's latency plus its transfer, so a worker downloads the shards its coming steps
need (`ShardPrefetch` in the reader says which) and reads its rows from the copies, each checked
against the manifest first. Disk use is bounded by the shard count `capacity`, never the corpus: past
it the least recently used shard that no coming step needs is dropped. Each download goes to a private
directory (`tempfile.mkdtemp`); once checked, the copy is opened and its name deleted at once, so its
space is freed when the cache drops it or the process ends, however it ends (a killed worker too).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from mhf_dist.data.shards import ShardEntry, check_shard
from mhf_dist.errors import DataError
from mhf_dist.storage import Location, storage_errors

FETCH_THREADS = 4  # requests to an object store wait on latency, not bandwidth: a few at once
COPY_CHUNK = 8 << 20  # bytes per ranged GET of a download: 3 for a 100m-preset shard of 2,048 rows (18 MB)


class ShardCache:
    """At most `capacity` of `shards` (the entries of one split in `directory`) on the local disk,
    downloaded in the background FETCH_THREADS at a time; `fetched` lists the downloads made, in order."""

    def __init__(self, directory: Location, shards: list[ShardEntry], capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a shard cache holds at least 1 shard, not {capacity}")
        self.directory, self.shards, self.capacity = directory, shards, capacity
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="fetch-shard")
        self._lock = threading.Lock()
        # Shards on disk, least recently used first: their open copies; None while downloading.
        self._on_disk: OrderedDict[int, pq.ParquetFile | None] = OrderedDict()
        self._fetching: dict[int, Future[pq.ParquetFile]] = {}  # asked for, not on disk yet
        self._queue: deque[int] = deque()  # asked for, not handed to a thread yet
        self._running = 0
        self._kept: frozenset[int] = frozenset()
        self.fetched: list[int] = []

    def fetch(self, shards: Iterable[int]) -> list[Future[pq.ParquetFile]]:
        """Ask for the downloads of those of `shards` neither on disk nor on their way, in that order."""
        with self._lock:
            return [future for shard in shards if (future := self._ask(shard)) is not None]

    def keep(self, shards: Iterable[int]) -> None:
        """Never drop these shards (until the next call): the coming steps read them."""
        self._kept = frozenset(shards)

    def local(self, shard: int) -> pq.ParquetFile:
        """The shard's checked local copy, downloaded now if it is neither there nor on its way."""
        with self._lock:
            copy = self._on_disk.get(shard)
            if copy is not None:
                self._on_disk.move_to_end(shard)
                return copy
            future = self._fetching.get(shard) or self._ask(shard)
        return future.result()

    def cancel(self) -> None:
        """Forget the downloads asked for that no thread has started."""
        with self._lock:
            self._cancel_queued()

    def close(self) -> None:
        """Stop downloading and drop the copies (their disk space is freed)."""
        self.cancel()
        self._pool.shutdown(wait=True)
        self._on_disk.clear()

    def _ask(self, shard: int) -> Future[pq.ParquetFile] | None:
        if shard in self._on_disk or shard in self._fetching:
            return None
        self._fetching[shard] = future = Future()
        self._queue.append(shard)
        self._hand_out()
        return future

    def _hand_out(self) -> None:
        """Give queued shards to idle threads. The pool never holds more than it has threads, so a process
        exiting waits for the downloads under way only (Python joins a pool's threads after its queue)."""
        while self._queue and self._running < FETCH_THREADS:
            try:
                self._pool.submit(self._download, self._queue[0])
            except RuntimeError:  # closed, or the interpreter is exiting: nothing more is downloaded
                self._cancel_queued()
                return
            self._queue.popleft()
            self._running += 1

    def _cancel_queued(self) -> None:
        for shard in self._queue:
            self._fetching.pop(shard).cancel()  # anyone waiting for it gets CancelledError
        self._queue.clear()

    def _download(self, shard: int) -> None:
        with self._lock:
            future = self._fetching[shard]
            self._make_room()
            self._on_disk[shard] = None
        copy, failure = None, None
        try:
            copy = self._copy(self.shards[shard])
        except BaseException as err:
            failure = err
        with self._lock:
            del self._on_disk[shard], self._fetching[shard]
            if failure is None:
                self._on_disk[shard] = copy  # the most recently used
                self.fetched.append(shard)
            self._running -= 1
            self._hand_out()
        if failure is None:
            future.set_result(copy)
        else:
            future.set_exception(failure)

    def _make_room(self) -> None:
        """Drop the least recently used shards no coming step reads until one more fits (a step that
        alone needs more than `capacity` shards keeps them all)."""
        for shard, copy in list(self._on_disk.items()):
            if len(self._on_disk) < self.capacity:
                return
            if copy is not None and shard not in self._kept:
                del self._on_disk[shard]

    def _copy(self, entry: ShardEntry) -> pq.ParquetFile:
        """Download `entry` whole, check it and open it; a bad shard is named as in the bucket."""
        source, staging = self.directory / entry.file, Path(tempfile.mkdtemp(prefix="mhf-shard-"))
        target = staging / entry.file
        target.parent.mkdir(exist_ok=True)  # a version folder (`shards.VERSION_FOLDER`)
        try:
            with storage_errors(source):
                local = pafs.LocalFileSystem()
                pafs.copy_files(
                    source.path, str(target), source.fs, local, chunk_size=COPY_CHUNK, use_threads=False
                )
            metadata = check_shard(Location.of(staging), entry)
            return pq.ParquetFile(pa.OSFile(str(target)), metadata=metadata)
        except (FileNotFoundError, DataError):
            check_shard(self.directory, entry)  # says what is wrong with the shard in the bucket
            raise
        finally:
            shutil.rmtree(staging)  # the open copy stays readable until it is dropped
