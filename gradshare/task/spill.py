"""A partition larger than `spill_bytes`, streamed from its spill file with bounded memory.

The file holds one record per row: a field per input (batches.spill_dtype, every dtype and shape kept) and
the label ("y"). Nothing of it is mapped: rows come back by explicit reads (`os.preadv`) into one
reused buffer, so the process's resident memory does not grow with the file. A memory map would count
every page the epoch's shuffle touches as the process's RSS (RssFile) until the whole file is resident,
which is what YARN's and Kubernetes' memory limits kill executors for. The kernel's page cache still
keeps what it can of the file; that memory is the OS's, shared and reclaimable, not the task's.

Memory held by a spilled partition: one shuffle window (at most `window_bytes`, the trainer's
`spill_bytes`: the same budget as an in-memory partition's), the batch being assembled, and the epoch's
block order (a few bytes per block of ~1 MiB). Nothing else grows with the row count.

Row order of a spilled epoch (`BlockShuffle`), a function of (seed, rank, epoch) and the file's shape:
the file is cut into blocks of `block_rows` consecutive rows; the blocks are permuted; consecutive runs
of `window_blocks` permuted blocks form windows; the rows of each window are permuted. An epoch reads
each window once, each block of it with one contiguous read, which a disk serves at its sequential
speed. It is the block shuffle plus shuffle buffer that streaming loaders use for data larger than
memory (Petastorm: shuffled row groups into a shuffling queue; tf.data: a shuffle buffer); the order differs from an
in-memory partition's global permutation (`spark.epoch_order`), so a spilled and an in-memory run of the same data train
alike but not bit for bit. A resumed attempt starting at any batch reads the same rows in the same order (the order is
recomputed, not remembered).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from gradshare.errors import GradshareError
from gradshare.task.batches import InputLayout, spill_dtype

# Blocks of about 1 MiB: large enough that a disk reads them at sequential speed, small enough that a
# window holds many of them from all over the file (that is what mixes the rows).
BLOCK_BYTES = 1 << 20
# A window gets at least this many blocks when it can hold that many rows (smaller blocks then), so that
# a small budget still mixes rows from several places of the file.
MIN_WINDOW_BLOCKS = 16


class SpillError(GradshareError, OSError):
    """The spill file could not be written or read back whole (disk full, file truncated or removed)."""


class SpillWriter:
    """Appends chunks of rows to a new spill file in `directory` (the executor's Spark scratch space)."""

    def __init__(
        self, directory: str | None, index: int, layout: InputLayout, label_dtype: str, label_shape: tuple[int, ...]
    ):
        self.layout, self.dtype = layout, spill_dtype(layout, label_dtype, label_shape)
        fd, self.path = tempfile.mkstemp(prefix=f"gradshare-part{index}-", suffix=".bin", dir=directory)
        self.file = os.fdopen(fd, "wb")
        self.rows = 0

    def write(self, inputs: tuple[np.ndarray, ...], labels: np.ndarray) -> None:
        records = np.empty(len(labels), dtype=self.dtype)  # one chunk: bounded by the caller's chunk size
        for i, arr in enumerate(inputs):
            records[f"x{i}"] = arr
        records["y"] = labels
        try:
            records.tofile(self.file)
        except OSError as e:
            self.discard()
            raise SpillError(f"could not write the spill file {self.path}: {e}") from e
        self.rows += len(labels)

    def discard(self) -> None:
        """Close and remove the file (a failed materialisation leaves nothing behind)."""
        self.file.close()
        try:
            os.remove(self.path)
        except OSError:
            pass

    def finish(self, window_bytes: int) -> SpilledPartition:
        self.file.close()
        return SpilledPartition(self.path, self.dtype, self.layout, self.rows, window_bytes)


def block_layout(rows: int, record_bytes: int, window_bytes: int) -> tuple[int, int]:
    """(block_rows, window_blocks) for `rows` records of `record_bytes` under a `window_bytes` budget: the
    window holds at least one row and never more than the budget allows (module docstring)."""
    window_rows = max(1, min(rows, window_bytes // record_bytes))
    block_rows = max(1, min(BLOCK_BYTES // record_bytes, window_rows // MIN_WINDOW_BLOCKS))
    return block_rows, max(1, window_rows // block_rows)


class BlockShuffle:
    """The row order of one spilled epoch in bounded pieces (module docstring): pure bookkeeping, no I/O.

    Position p of the epoch (0 ≤ p < rows) lies in window `window_of(p)`; `window_rows(w)` is that
    window's rows (file row numbers) in epoch order.
    """

    def __init__(self, rows: int, block_rows: int, window_blocks: int, seed: int, rank: int, epoch: int):
        self.rows, self.block_rows, self.window_blocks = rows, block_rows, window_blocks
        self.key = (seed, rank, epoch)
        n_blocks = -(-rows // block_rows)
        self.blocks = np.random.default_rng([seed, rank, epoch]).permutation(n_blocks).astype(np.int32)
        # the last block may be short, and the permutation puts it in any window: where each window
        # starts in the epoch is summed from the block sizes
        sizes = np.full(n_blocks, block_rows, dtype=np.int64)
        sizes[-1] = rows - (n_blocks - 1) * block_rows
        per_window = np.add.reduceat(sizes[self.blocks], np.arange(0, n_blocks, window_blocks))
        self.starts = np.concatenate([[0], np.cumsum(per_window)])

    def __len__(self) -> int:
        """How many windows the epoch has."""
        return len(self.starts) - 1

    def window_of(self, position: int) -> int:
        return int(np.searchsorted(self.starts, position, side="right")) - 1

    def window_blocks_of(self, w: int) -> np.ndarray:
        return self.blocks[w * self.window_blocks : (w + 1) * self.window_blocks]

    def window_order(self, w: int) -> np.ndarray:
        """Positions within window w's buffer (its blocks read one after another) in epoch order."""
        seed, rank, epoch = self.key
        return np.random.default_rng([seed, rank, epoch, 1, w]).permutation(int(self.starts[w + 1] - self.starts[w]))

    def window_rows(self, w: int) -> np.ndarray:
        """File row numbers of window w in epoch order."""
        rows = np.concatenate(
            [
                np.arange(b * self.block_rows, min((b + 1) * self.block_rows, self.rows))
                for b in self.window_blocks_of(w)
            ]
        )
        ordered: np.ndarray = rows[self.window_order(w)]
        return ordered


class SpilledPartition:
    """A materialised partition in a spill file, read back in bounded windows (module docstring).

    The same surface as `spark.PartitionData` where the worker needs it (`len`, `multi`, `close`,
    `read`) plus `batch`, the epoch's b-th batch; it holds no `inputs`/`labels` arrays on purpose.
    """

    spilled = True

    def __init__(self, path: str, dtype: np.dtype, layout: InputLayout, rows: int, window_bytes: int):
        self.spill_path: str | None = path  # None once closed
        self.dtype, self.layout, self.rows = dtype, layout, rows
        self.multi = layout.multi
        self.block_rows, self.window_blocks = block_layout(rows, dtype.itemsize, window_bytes)
        self._fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        if size != rows * dtype.itemsize:
            self.close()
            raise SpillError(f"spill file {path} holds {size} bytes, {rows} rows need {rows * dtype.itemsize}")
        self._buffer = np.empty(min(rows, self.block_rows * self.window_blocks), dtype=dtype)  # one window
        self._shuffle: BlockShuffle | None = None
        self._window = -1  # which window of `_shuffle` the buffer holds
        self._order: np.ndarray | None = None
        self._windows_read = 0

    def __len__(self) -> int:
        return self.rows

    @property
    def window_rows(self) -> int:
        """Rows one window holds: the memory bound of an epoch's reads."""
        return len(self._buffer)

    @property
    def window(self) -> int:
        """The window of the current epoch's order the buffer holds (-1: none yet this epoch)."""
        return self._window

    @property
    def windows_read(self) -> int:
        """Windows read from the file so far: batches taken in order read each window once an epoch."""
        return self._windows_read

    def close(self) -> None:
        if self.spill_path is None:
            return
        os.close(self._fd)
        self._buffer, self._order = self._buffer[:0].copy(), None  # the window's memory goes
        try:
            os.remove(self.spill_path)
        except OSError:
            pass
        self.spill_path = None

    def _read_into(self, out: np.ndarray, start: int) -> None:
        """Rows start .. start+len(out) of the file into `out` (explicit reads, nothing mapped)."""
        view = memoryview(out.data).cast("B")
        offset, done = start * self.dtype.itemsize, 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise SpillError(
                    f"spill file {self.spill_path} ended at byte {offset + done}; rows "
                    f"{start}..{start + len(out) - 1} need {len(view)} bytes from {offset}"
                )
            done += got

    def read(self, start: int, stop: int) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        """Rows start..stop-1 in file order as (inputs, labels), each its own array: a bounded sequential
        pass (validation, tests) reads the file in such slices."""
        if not 0 <= start <= stop <= self.rows:
            raise ValueError(f"rows {start}..{stop} are outside the partition's 0..{self.rows}")
        records = np.empty(stop - start, dtype=self.dtype)
        self._read_into(records, start)
        return self._split(records)

    def _split(self, records: np.ndarray) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        inputs = tuple(np.ascontiguousarray(records[f"x{i}"]) for i in range(len(self.layout.dtypes)))
        return inputs, np.ascontiguousarray(records["y"])

    def _load(self, w: int) -> None:
        """Read window w of the current epoch's shuffle into the buffer, block by block."""
        shuffle, at = self._shuffle, 0
        assert shuffle is not None  # batch() makes the epoch's shuffle before it loads a window
        for block in shuffle.window_blocks_of(w):
            first = int(block) * shuffle.block_rows
            size = min(shuffle.block_rows, self.rows - first)
            self._read_into(self._buffer[at : at + size], first)
            at += size
        self._window, self._order = w, shuffle.window_order(w)
        self._windows_read += 1

    def batch(self, epoch: int, b: int, batch_size: int, seed: int, rank: int) -> tuple[np.ndarray, ...]:
        """The epoch's b-th batch as (*inputs, labels), new arrays each: positions b·batch_size onwards of
        the epoch's order (`BlockShuffle`). Called in order, each window is read once per epoch; any
        other call (a resumed attempt's first batch) reads what it needs."""
        if self._shuffle is None or self._shuffle.key != (seed, rank, epoch):
            self._shuffle = BlockShuffle(self.rows, self.block_rows, self.window_blocks, seed, rank, epoch)
            self._window = -1
        shuffle = self._shuffle
        position, stop = b * batch_size, min((b + 1) * batch_size, self.rows)
        if not 0 <= position < stop:
            raise ValueError(f"batch {b} of {batch_size} rows is outside the partition's {self.rows} rows")
        fields = [f"x{i}" for i in range(len(self.layout.dtypes))] + ["y"]
        pieces = []
        while position < stop:  # a batch may end in the next window (or span several small ones)
            w = shuffle.window_of(position)
            if w != self._window:
                self._load(w)
            first = position - int(shuffle.starts[w])
            take = min(stop, int(shuffle.starts[w + 1])) - position
            assert self._order is not None  # the window just loaded, or loaded before: its order
            rows = self._order[first : first + take]
            pieces.append([self._buffer[f][rows] for f in fields])  # one gather per field: no record copy
            position += take
        if len(pieces) == 1:
            return tuple(pieces[0])
        return tuple(np.concatenate(parts) for parts in zip(*pieces))
