"""Volume memory faulted in ahead of use, and header values read without pydicom's per-value conversion."""

from __future__ import annotations

import gc
import time

import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file

import medserve.dicom.memory as memory_module
from medserve.dicom.memory import VolumeMemory, volume_array
from medserve.dicom.values import decimal_values, stored_bytes, uid_value


def wait_until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_volume_memory_faults_in_what_is_reserved_and_is_handed_out_once():
    memory = VolumeMemory((64, 48), capacity=40)
    memory.reserve(25)
    assert wait_until(lambda: memory.slices_faulted_in == 25)
    array = memory.take((25, 64, 48))
    assert array.shape == (25, 64, 48) and array.dtype == np.float32 and array.flags.writeable
    array[:] = 7.0
    assert memory.take((25, 64, 48)) is None
    assert not memory._thread.is_alive()


def test_volume_memory_refuses_a_shape_it_was_not_prepared_for():
    memory = VolumeMemory((64, 48), capacity=10)
    assert memory.take((10, 64, 47)) is None
    assert VolumeMemory((8, 8), capacity=10).take((11, 8, 8)) is None


def test_volume_memory_dropped_unused_stops_its_thread():
    memory = VolumeMemory((32, 32), capacity=4)
    memory.reserve(2)
    thread = memory._thread
    del memory
    gc.collect()
    assert wait_until(lambda: not thread.is_alive())


def test_volume_memory_is_not_prepared_for_multiframe_images():
    enhanced = pydicom.dcmread(get_testdata_file("eCT_Supplemental.dcm"), stop_before_pixels=True)
    assert VolumeMemory.for_header(enhanced, capacity=1) is None
    single = pydicom.dcmread(get_testdata_file("CT_small.dcm"), stop_before_pixels=True)
    assert VolumeMemory.for_header(single, capacity=3).slice_shape == (128, 128)


def test_memory_is_not_prepared_for_slices_larger_than_4096_squared():
    """A damaged Rows or Columns (65535) would have the indexer fault in 16 GiB a slice before the pixel data is
    read and found too short for it."""
    single = pydicom.dcmread(get_testdata_file("CT_small.dcm"), stop_before_pixels=True)
    single.Rows, single.Columns = 4096, 4096
    assert VolumeMemory.for_header(single, capacity=1).slice_shape == (4096, 4096)
    single.Rows, single.Columns = 65535, 65535
    assert VolumeMemory.for_header(single, capacity=1) is None


def test_memory_that_cannot_be_mapped_is_not_prepared(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(memory_module.mmap, "mmap", refuse)
    single = pydicom.dcmread(get_testdata_file("CT_small.dcm"), stop_before_pixels=True)
    assert VolumeMemory.for_header(single, capacity=10**7) is None


def test_volume_array_is_a_writable_float32_array():
    array = volume_array((3, 4, 5))
    array[:] = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    assert array.dtype == np.float32 and array.flags.c_contiguous and array[2, 3, 4] == 59


@pytest.mark.parametrize("converted", [False, True])
def test_values_agree_with_pydicom_whether_or_not_it_converted_them(converted):
    dataset = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
    expected = (dataset.SeriesInstanceUID, tuple(float(v) for v in dataset.ImagePositionPatient),
                tuple(float(v) for v in dataset.PixelSpacing), float(dataset.RescaleSlope))
    fresh = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
    if converted:
        _ = (fresh.SeriesInstanceUID, fresh.ImagePositionPatient, fresh.PixelSpacing, fresh.RescaleSlope)
    assert (uid_value(fresh, "SeriesInstanceUID"), decimal_values(fresh, "ImagePositionPatient"),
            decimal_values(fresh, "PixelSpacing"), decimal_values(fresh, "RescaleSlope")[0]) == expected
    assert (stored_bytes(fresh, "PixelSpacing") is None) == converted


def test_absent_and_empty_values():
    dataset = pydicom.Dataset()
    dataset.SliceThickness = None
    assert uid_value(dataset, "SeriesInstanceUID") == ""
    assert decimal_values(dataset, "PixelSpacing") is None
    assert decimal_values(dataset, "SliceThickness") is None
    assert stored_bytes(dataset, "PixelSpacing") is None
