"""Read one slice's pixels into a float32 array, in modality units (rescale applied).

Uncompressed little-endian pixel data is read straight from the file at the offset the index recorded (no
per-file dataset copy) and so is RLE Lossless, decoded by imagecodecs (its decoder releases the GIL, so threads
decode in parallel; pylibjpeg-rle's holds it); other compressed transfer syntaxes, and slices whose modality
transform is a Modality LUT Sequence rather than a rescale, are read by pydicom. How stored values become
modality units (`PixelFormat`) is parsed from the header once per distinct set of stored attribute bytes: a
series has one or a few, and pydicom's attribute access costs more than reading a slice.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import imagecodecs
import numpy as np
import pydicom
from pydicom.encaps import generate_frames
from pydicom.pixels import apply_modality_lut
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian, RLELossless

from medserve.dicom.index import Instance, read_dataset
from medserve.dicom.values import decimal_values, integer_value, stored_bytes
from medserve.errors import VolumeError, on_one_line

log = logging.getLogger("medserve.dicom.pixels")

# Read from the stored offset. Deflated Explicit VR (1.2.840.10008.1.2.1.99) is not here: its Pixel Data is
# inside the deflated stream, so pydicom reads it whole.
_NATIVE_LITTLE_ENDIAN = {ImplicitVRLittleEndian, ExplicitVRLittleEndian}
_PIXEL_DATA_VRS = (b"OB", b"OW", b"UN")
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FORMAT_KEYWORDS = ("BitsAllocated", "BitsStored", "PixelRepresentation", "RescaleSlope", "RescaleIntercept")


@dataclass(frozen=True)
class PixelFormat:
    """How a slice's stored pixel values become modality units."""

    dtype: np.dtype
    unused_bits: int  # BitsAllocated - BitsStored: high bits that are not part of the value
    slope: np.float32
    intercept: np.float32


class PixelFormats:
    """Each instance's `PixelFormat`, parsed and checked once per distinct set of stored attribute bytes.

    An attribute pydicom has converted already has no stored bytes left to compare; such an instance is parsed
    on its own.
    """

    def __init__(self) -> None:
        self._parsed: dict[tuple[bytes | None, ...], PixelFormat] = {}

    def of(self, instance: Instance) -> PixelFormat:
        """The instance's format; VolumeError naming the file when its header does not describe readable pixels."""
        dataset = instance.dataset
        stored = tuple(stored_bytes(dataset, keyword) for keyword in _FORMAT_KEYWORDS)
        if any(value is None and keyword in dataset for value, keyword in zip(stored, _FORMAT_KEYWORDS)):
            return _pixel_format(instance)  # converted already: no stored bytes to compare
        found = self._parsed.get(stored)
        if found is None:
            found = self._parsed[stored] = _pixel_format(instance)
        return found


def read_slices(instances: Sequence[Instance], array: np.ndarray) -> None:
    """Fill `array[k]` with the pixels of `instances[k]`, in place.

    Formats are worked out first, in slice order, so that a bad header is reported as the first bad slice. Then
    each of a few threads reads a run of consecutive slices: file reads, decoding and numpy conversions release the
    GIL for most of their time. When reading fails, the failure of the first failing slice is raised.
    """
    formats = PixelFormats()
    plan = [formats.of(instance) for instance in instances]
    workers = max(1, min(len(instances), os.cpu_count() or 1))
    bounds = [len(instances) * w // workers for w in range(workers + 1)]
    padded: list[tuple[int, int]] = []  # (slice, bytes after its frame), appended by the threads

    def read_run(start: int, stop: int) -> tuple[int, Exception] | None:
        for k in range(start, stop):
            try:
                if padding := read_slice(instances[k], plan[k], array[k]):
                    padded.append((k, padding))
            except Exception as error:
                return k, error
        return None

    with ThreadPoolExecutor(max_workers=workers) as pool:
        failures = [failure for failure in pool.map(read_run, bounds[:-1], bounds[1:]) if failure is not None]
    if failures:
        raise min(failures, key=lambda failure: failure[0])[1]
    if padded:  # pydicom ignores such bytes too; once per series, not once per slice
        log.warning("%d slice(s) hold up to %d bytes of pixel data after their frame (e.g. %s); ignoring them",
                    len(padded), max(size for _, size in padded), instances[min(padded)[0]].path)


def read_slice(instance: Instance, pixel_format: PixelFormat, out: np.ndarray) -> int:
    """The instance's one frame into `out` (rows x columns, float32), rescaled; VolumeError naming the file.
    Returns the number of padding bytes found after an uncompressed frame (beyond the one to an even length)."""
    syntax = instance.transfer_syntax
    if "ModalityLUTSequence" in instance.dataset:
        _decode_slice(instance, out)
    elif syntax in _NATIVE_LITTLE_ENDIAN:
        return _read_native_slice(instance, pixel_format, out)
    elif syntax == RLELossless:
        _decode_rle_slice(instance, pixel_format, out)
    else:
        _decode_slice(instance, out)
    return 0


def _pixel_format(instance: Instance) -> PixelFormat:
    dataset = instance.dataset
    for keyword in ("BitsAllocated", "PixelRepresentation"):
        if dataset.get(keyword) is None:
            raise VolumeError(f"{instance.path}: {keyword} is missing; the pixels cannot be read without it")
    bits = integer_value(dataset, "BitsAllocated")
    if bits not in (8, 16, 32):
        raise VolumeError(f"{instance.path}: BitsAllocated {bits} is not supported; expected 8, 16 or 32")
    stored = integer_value(dataset, "BitsStored") or bits
    if not 0 < stored <= bits:
        raise VolumeError(f"{instance.path}: BitsStored {stored} does not fit BitsAllocated {bits}; expected 1 to "
                          f"{bits}")
    representation = integer_value(dataset, "PixelRepresentation")
    if representation not in (0, 1):
        raise VolumeError(f"{instance.path}: PixelRepresentation {representation} is not supported; expected 0 "
                          "(unsigned) or 1 (two's complement)")
    kind = "i" if representation == 1 else "u"
    return PixelFormat(np.dtype(f"<{kind}{bits // 8}"), bits - stored, *_rescale(dataset, stored))


def _pixel_value(instance: Instance, expected: int | None = None) -> tuple[int, bytes]:
    """The Pixel Data element's declared length and the bytes after its header, read from the stored offset.

    The header is read as it is written, not as the transfer syntax says: files whose body is Explicit VR under
    an Implicit VR transfer syntax (or the reverse) exist, and pydicom reads their headers either way. After
    the tag, an Explicit VR header has the VR (OB, OW or UN) and two zero bytes, then the length; an Implicit VR
    one has the length. Only when that length is the `expected` one does an Explicit-looking header count as
    Implicit (its length's low bytes spelling a VR).
    """
    if instance.pixel_data_offset is None:
        raise VolumeError(f"{instance.path}: no Pixel Data element")
    with instance.path.open("rb") as stream:
        stream.seek(instance.pixel_data_offset + 4)
        header = stream.read(8)
        implicit_length = int.from_bytes(header[:4], "little")
        explicit = header[:2] in _PIXEL_DATA_VRS and header[2:4] == b"\0\0"
        if explicit and (expected is None or implicit_length not in (expected, expected + 1)):
            return int.from_bytes(header[4:8], "little"), stream.read()
        stream.seek(instance.pixel_data_offset + 8)
        return implicit_length, stream.read()


def check_first_frame_length(instance: Instance, rows: int, columns: int) -> None:
    """Refuse an uncompressed slice whose pixel data is shorter than Rows x Columns before a volume is allocated
    from them: a damaged Rows or Columns (65535) would otherwise ask for hundreds of GB first."""
    if instance.transfer_syntax in _NATIVE_LITTLE_ENDIAN and "ModalityLUTSequence" not in instance.dataset:
        _native_frame(instance, _pixel_format(instance), rows * columns)


def _native_frame(instance: Instance, pixel_format: PixelFormat, pixels: int) -> tuple[int, bytes]:
    """The Pixel Data element's declared length and its bytes; VolumeError when they are fewer than `pixels`."""
    expected = pixels * pixel_format.dtype.itemsize
    declared, value = _pixel_value(instance, expected)
    if declared < expected or len(value) < expected:
        raise VolumeError(f"{instance.path}: pixel data is truncated ({min(len(value), declared)} of the "
                          f"{expected} bytes Rows x Columns x BitsAllocated/8 call for)")
    return declared, value


def _read_native_slice(instance: Instance, pixel_format: PixelFormat, out: np.ndarray) -> int:
    expected = out.size * pixel_format.dtype.itemsize
    declared, value = _native_frame(instance, pixel_format, out.size)
    # Padding is shorter than a row; a row or more is an image whose Rows/Columns do not match its pixels, which
    # would be read sheared.
    if declared - expected >= out.shape[-1] * pixel_format.dtype.itemsize:
        raise VolumeError(f"{instance.path}: pixel data holds {declared} bytes; Rows x Columns x BitsAllocated/8 "
                          f"is {expected}: more than one frame, or Rows/Columns/BitsAllocated are wrong")
    raw = np.frombuffer(value, dtype=pixel_format.dtype, count=out.size)
    _rescale_into(pixel_format, _mask_stored_bits(pixel_format, raw).reshape(out.shape), out)
    return declared - expected if declared > expected + 1 else 0


def _decode_rle_slice(instance: Instance, pixel_format: PixelFormat, out: np.ndarray) -> None:
    """RLE Lossless straight from the file's encapsulated fragments with imagecodecs' DICOM RLE decoder."""
    _, value = _pixel_value(instance)
    try:
        frame = next(generate_frames(value, number_of_frames=1))
        pixels = np.frombuffer(imagecodecs.dicomrle_decode(frame, pixel_format.dtype.str), dtype=pixel_format.dtype)
    except Exception as error:  # damaged streams: StopIteration, ValueError, DicomrleError
        raise VolumeError(f"{instance.path}: cannot decode pixel data ({_transfer_syntax_name(instance)}): "
                          f"{error}") from error
    if pixels.size != out.size:
        raise VolumeError(f"{instance.path}: decoded frame has {pixels.size} pixels; expected {out.size}")
    _rescale_into(pixel_format, _mask_stored_bits(pixel_format, pixels).reshape(out.shape), out)


def _decode_slice(instance: Instance, out: np.ndarray) -> None:
    """Other transfer syntaxes, and slices whose modality transform is a Modality LUT Sequence: pydicom's
    decoders, which apply BitsStored themselves, and its modality LUT."""
    try:
        dataset = read_dataset(instance)
        if "PixelData" not in dataset and instance.pixel_data_offset is not None:  # pydicom drops a cut element
            raise VolumeError(f"{instance.path}: pixel data is truncated: the file ends inside its Pixel Data "
                              "element")
        check_jpeg_end(dataset.PixelData, instance)
        pixels = dataset.pixel_array
    except VolumeError:
        raise
    except Exception as error:  # decoders raise assorted types on damaged data; some list each plugin's on a line
        raise VolumeError(f"{instance.path}: cannot decode pixel data "
                          f"({_transfer_syntax_name(instance)}): {on_one_line(error)}") from error
    if pixels.shape != out.shape:
        raise VolumeError(f"{instance.path}: decoded frame has shape {pixels.shape}; expected {out.shape}")
    if "ModalityLUTSequence" in dataset:
        try:
            np.copyto(out, apply_modality_lut(pixels, dataset), casting="unsafe")
        except Exception as error:  # a malformed LUT descriptor or data
            raise VolumeError(f"{instance.path}: ModalityLUTSequence cannot be applied ({error})") from error
        return
    _rescale_into(PixelFormat(pixels.dtype, 0, *_rescale(dataset, pixels.dtype.itemsize * 8)), pixels, out)


def check_jpeg_end(pixel_data: bytes, instance: Instance, frames: int = 1) -> None:
    """Refuse a JPEG-family frame (of `frames` in the encapsulated pixel data) that does not end with its
    end-of-image marker (FFD9; JPEG 2000's end of codestream is the same bytes), give or take a few bytes of
    padding: the JPEG and JPEG-LS decoders pydicom uses return noise for a cut stream rather than an error."""
    prefix, _, last = str(instance.transfer_syntax).rpartition(".")
    # .50-.99: JPEG, JPEG-LS, JPEG 2000; .201-.203: HTJ2K (not MPEG, HEVC or JPEG XL, which end otherwise)
    if prefix != "1.2.840.10008.1.2.4" or not (50 <= int(last) < 100 or 200 < int(last) < 210):
        return
    for number, frame in enumerate(generate_frames(pixel_data, number_of_frames=frames), start=1):
        # Entropy-coded data never holds FFD9 (0xFF is stuffed or starts a marker), so finding it near the end
        # is finding the marker; a few bytes of padding after it are tolerated.
        if b"\xff\xd9" not in frame[-16:]:
            raise VolumeError(f"{instance.path}: pixel data frame {number} ({_transfer_syntax_name(instance)}) does "
                              "not end with the end-of-image marker FFD9: the stream is cut or damaged")


def _transfer_syntax_name(instance: Instance) -> str:
    uid = instance.transfer_syntax
    return f"{uid.name} {uid}" if uid else "no transfer syntax"


def _mask_stored_bits(pixel_format: PixelFormat, raw: np.ndarray) -> np.ndarray:
    """Honour BitsStored < BitsAllocated: drop the unused high bits, sign-extending signed values."""
    unused = pixel_format.unused_bits
    if unused <= 0:
        return raw
    if raw.dtype.kind == "i":
        return (raw << unused) >> unused
    return raw & np.array((1 << (raw.dtype.itemsize * 8 - unused)) - 1, dtype=raw.dtype)


def mask_native_frames(dataset: pydicom.Dataset) -> None:
    """Drop the unused high bits of a native (uncompressed) multi-frame object's frames, in place, sign-extending
    signed values, as `read_slice` does for single-frame slices: highdicom decodes an Enhanced image's frames as
    the bytes are, so 12-bit two's complement values in 16-bit words read as 0..4095 (-1000 HU became 3096), and
    junk in the high bits read as values. Encapsulated frames are decoded as pydicom decodes them; big-endian
    ones highdicom refuses."""
    syntax = dataset.file_meta.get("TransferSyntaxUID")
    if "PixelData" not in dataset or (syntax is not None and (syntax.is_encapsulated or not syntax.is_little_endian)):
        return
    bits = integer_value(dataset, "BitsAllocated")
    stored = integer_value(dataset, "BitsStored") or bits
    if bits not in (8, 16, 32) or not 0 < stored < bits:
        return
    kind = "i" if integer_value(dataset, "PixelRepresentation") == 1 else "u"
    data = bytearray(dataset.PixelData)
    values = np.frombuffer(data, dtype=f"<{kind}{bits // 8}", count=len(data) // (bits // 8))  # a view of `data`
    values[...] = _mask_stored_bits(PixelFormat(values.dtype, bits - stored, np.float32(1), np.float32(0)), values)
    dataset.PixelData = bytes(data)  # an odd padding byte stays


def _rescale_into(pixel_format: PixelFormat, pixels: np.ndarray, out: np.ndarray) -> None:
    """out = pixels * slope + intercept, in float32.

    The integers are cast into `out` first and scaled there: numpy's plain cast loop plus float32 arithmetic on
    the cache-warm slice take 0.6x the time of one mixed-type ufunc, which casts through a small buffer.
    """
    np.copyto(out, pixels, casting="unsafe")
    if pixel_format.slope != 1.0:
        out *= pixel_format.slope
    if pixel_format.intercept != 0.0:
        out += pixel_format.intercept


def _rescale(dataset: pydicom.Dataset, stored_bits: int) -> tuple[np.float32, np.float32]:
    """(RescaleSlope, RescaleIntercept), 1 and 0 when absent, as float32: the volume's type. A VolumeError when
    the slope is zero or the intercept not finite, in float32 too (1e-50 is zero there), or when stored values
    of `stored_bits` bits would rescale beyond float32's range (to infinity)."""
    slope = _first_decimal(dataset, "RescaleSlope")
    intercept = _first_decimal(dataset, "RescaleIntercept")
    slope = 1.0 if slope is None else slope
    intercept = 0.0 if intercept is None else intercept
    largest = 2.0 ** stored_bits * abs(slope) + abs(intercept)  # inf when either is
    if not largest <= _FLOAT32_MAX or np.float32(slope) == 0.0:
        raise VolumeError(f"{dataset.filename}: RescaleSlope {slope} / RescaleIntercept {intercept}: expected a "
                          f"finite, non-zero slope and a finite intercept that keep {stored_bits}-bit stored values "
                          f"within float32 range (magnitudes up to {_FLOAT32_MAX:.3g})")
    return np.float32(slope), np.float32(intercept)


def _first_decimal(dataset: pydicom.Dataset, keyword: str) -> float | None:
    try:
        values = decimal_values(dataset, keyword)
    except ValueError as error:
        raise VolumeError(f"{dataset.filename}: {error}") from None
    return values[0] if values else None
