"""Memory for volumes: float32 arrays on ordinary pages, faulted in while the folder is still being indexed.

Building a 512x512x300 volume first-touches 300 MB of fresh memory, which on the VMs we run on costs as much as
parsing the 300 headers (0.25 s of page faults on one core). Header parsing is Python and holds the GIL on one
core; page faults need no GIL. So `index_folder` starts a `VolumeMemory` for the first series it finds, which
faults in float32 slices on a background thread as that series' headers are parsed, and `load_series` builds that
series' volume in it. Only the first series found is prepared this way: a folder whose first series is not the
one used holds at most that series' volume in memory until the index is dropped.
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref

import numpy as np
from pydicom.dataset import Dataset

from medserve.dicom.values import integer_value, number_of_frames

log = logging.getLogger("medserve.dicom.memory")

_ITEM_BYTES = np.dtype(np.float32).itemsize
# Slices faulted in per step: large enough that the thread's GIL handovers between steps cost little.
_STEP_SLICES = 16
# Larger slices are not prepared: volumes rarely have them, and a damaged Rows or Columns (65535) must not fault in
# gigabytes before `load_series` has compared them with the pixel data.
_LARGEST_PREPARED_SLICE = 4096 * 4096


def volume_array(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised float32 array on ordinary 4 KiB pages, in an anonymous mapping of its own.

    numpy asks the kernel for transparent huge pages on large arrays. On the VMs we run on, first-touching a
    300 MB array of huge pages took anywhere from 0.05 to 1.1 s (bimodal, run to run), and the same array on
    ordinary pages a steady 0.15-0.25 s: a fresh huge page is a whole free block of guest memory, which the host
    may have to back anew. A volume is filled once and then read, so huge pages buy little afterwards.
    """
    count = int(np.prod(shape))
    # Private: anonymous shared memory (the mmap module's default) is shmem, slower to fault in (0.17-0.29 s
    # against 0.13-0.15 s for these 300 MB here).
    mapping = mmap.mmap(-1, max(count, 1) * _ITEM_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mapping, dtype=np.float32, count=count).reshape(shape)


class _Faulting:
    """The background thread's side: how many slices to fault in, how many are, and whether to stop.

    Kept apart from `VolumeMemory` so that the thread does not keep its owner alive: when the owner is collected,
    its finalizer stops the thread.
    """

    def __init__(self, slices: np.ndarray) -> None:
        self.slices: np.ndarray | None = slices
        self.wanted = 0
        self.done = 0
        self.stopped = False
        self.condition = threading.Condition()

    def run(self) -> None:
        page_items = mmap.PAGESIZE // _ITEM_BYTES
        while True:
            with self.condition:
                while not self.stopped and self.done >= self.wanted:
                    self.condition.wait()
                if self.stopped:
                    return
                start, stop = self.done, min(self.wanted, self.done + _STEP_SLICES)
                slices = self.slices
            # One write per page faults it in; numpy releases the GIL for the strided assignment.
            slices[start:stop].reshape(-1)[::page_items] = 0.0
            with self.condition:
                self.done = stop

    def stop(self) -> None:
        with self.condition:
            self.stopped = True
            self.condition.notify()


class VolumeMemory:
    """float32 memory for up to `capacity` slices of one series, faulted in ahead of use by a background thread.

    `reserve(n)` asks for the first n slices (the indexer calls it as it finds the series' files); `take(shape)`
    stops the thread and hands the memory over once, as the array the volume is read into. Slices the thread had
    not reached yet are faulted in by the volume's own writes.
    """

    def __init__(self, slice_shape: tuple[int, int], capacity: int) -> None:
        self.slice_shape = slice_shape
        self.capacity = capacity
        self._faulting: _Faulting | None = _Faulting(volume_array((capacity, *slice_shape)))
        self._thread = threading.Thread(target=self._faulting.run, name="medserve-volume-memory", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._faulting.stop)

    @classmethod
    def for_header(cls, dataset: Dataset, capacity: int) -> VolumeMemory | None:
        """Memory for a series whose first header is `dataset`, or None when it is not a stack of single frames of
        at most 4096 x 4096 pixels."""
        rows, columns = integer_value(dataset, "Rows"), integer_value(dataset, "Columns")
        if not rows or not columns or rows * columns > _LARGEST_PREPARED_SLICE or number_of_frames(dataset) != 1:
            return None
        try:
            return cls((rows, columns), capacity)
        except (OSError, ValueError):  # address space refused (a huge folder): the volume allocates later
            log.info("no volume memory prepared", extra={"slices": capacity, "rows": rows, "columns": columns})
            return None

    def reserve(self, slices: int) -> None:
        faulting = self._faulting
        if faulting is None:
            return
        with faulting.condition:
            faulting.wanted = min(max(faulting.wanted, slices), self.capacity)
            faulting.condition.notify()

    def take(self, shape: tuple[int, int, int]) -> np.ndarray | None:
        """The memory as an array of `shape`, once; None when it was taken already or the shape does not fit."""
        faulting, self._faulting = self._faulting, None
        if faulting is None:
            return None
        faulting.stop()
        self._thread.join()
        slices, faulting.slices = faulting.slices, None  # the finalizer keeps `faulting`, not the memory
        if tuple(shape[1:]) != self.slice_shape or shape[0] > self.capacity:
            return None
        return slices[:shape[0]]

    @property
    def slices_faulted_in(self) -> int:
        faulting = self._faulting
        return faulting.done if faulting is not None else 0
