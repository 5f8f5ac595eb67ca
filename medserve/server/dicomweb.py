"""DICOMweb client side: WADO-RS pulls streamed to disk part by part, STOW-RS write-back of the SEG.

Failures map to HTTP statuses the sync endpoints return as-is: store unreachable -> 502, store too slow (silent for
a timeout, or a trickle: see `DicomWebClient`) -> 504, study/series unknown to the store -> 404, an answer that is not
what DICOMweb promises (parts that are not DICOM, a STOW-RS answer listing refused instances, whatever its status)
-> 502. `retryable` tells the job runner which ones to retry with backoff.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from xml.etree import ElementTree
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote, urlsplit

import httpx
import pydicom

from medserve.net import without_credentials
from medserve.server.errors import ApiError
from medserve.server.inputs import NOT_DICOM, sniff

log = logging.getLogger("medserve.server.dicomweb")

ACCEPT_DICOM = 'multipart/related; type="application/dicom"; transfer-syntax=*'

FAILED_SOP_SEQUENCE = "00081198"
FAILURE_REASON = "00081197"
# h11's words for a body that ended before its Content-Length, or inside a chunk.
_CUT_SHORT = re.compile(r"without sending complete message body|incomplete chunked read", re.IGNORECASE)
REFERENCED_SOP_SEQUENCE = "00081199"
REFERENCED_SOP_INSTANCE_UID = "00081155"
# PS3.18 Table 10.5.3-1 / PS3.4 Annex C: the failure reasons STOW-RS stores give.
FAILURE_REASONS = {0x0110: "processing failure", 0x0122: "SOP class not supported", 0x0124: "not authorized",
                   0xA700: "out of resources", 0xA900: "data set does not match SOP class",
                   0xC000: "cannot understand", 0xC122: "transfer syntax not supported"}


class DicomWebError(ApiError):
    def __init__(self, status: int, code: str, message: str, retryable: bool) -> None:
        super().__init__(status, code, message)
        self.retryable = retryable


def _bad_part(path: str, index: int, problem: str) -> DicomWebError:
    return DicomWebError(502, "dicomweb_bad_response",
                         f"part {index + 1} of the store's answer for {path} {problem}", False)


def _boundary(content_type: str) -> bytes:
    for param in content_type.split(";")[1:]:
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary":
            return value.strip('"').encode()
    raise DicomWebError(502, "dicomweb_bad_response", f"store answered {content_type!r} without a boundary", False)


def _part_headers(block: bytes) -> dict[str, str]:
    """A part's header lines, names lower-cased."""
    headers = {}
    for line in block.decode("latin-1").split("\r\n"):
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()
    return headers


def split_multipart(chunks: Iterable[bytes], boundary: bytes,
                    open_part: Callable[[dict[str, str]], BinaryIO]) -> int:
    """Incremental multipart/related parser: writes each part's body to a new file from `open_part(headers)`
    while the bytes arrive, holding at most one network chunk plus a delimiter in memory. Returns the number of
    parts."""
    delim = b"\r\n--" + boundary
    keep = len(delim) + 4
    buf = b"\r\n"  # lets the first boundary (at the very start of the body) match `delim`
    state, out, parts = "preamble", None, 0
    try:
        for chunk in chunks:
            buf += chunk
            while True:
                if state in ("preamble", "body"):
                    index = buf.find(delim)
                    if index < 0:
                        if len(buf) > keep:
                            if state == "body":
                                out.write(buf[:-keep])
                            buf = buf[-keep:]
                        break
                    if state == "body":
                        out.write(buf[:index])
                        out.close()
                        parts += 1
                    buf, state = buf[index + len(delim):], "delimiter"
                if state == "delimiter":
                    if len(buf) < 2:
                        break
                    if buf[:2] == b"--":
                        return parts
                    eol = buf.find(b"\r\n")
                    if eol < 0:
                        break
                    buf, state = buf[eol + 2:], "headers"
                if state == "headers":
                    if buf.startswith(b"\r\n"):
                        head, buf = b"", buf[2:]
                    else:
                        end = buf.find(b"\r\n\r\n")
                        if end < 0:
                            break
                        head, buf = buf[:end], buf[end + 4:]
                    out, state = open_part(_part_headers(head)), "body"
    except BaseException:  # the stream broke off: close the part being written
        if out is not None:
            out.close()
        raise
    if state == "body" and out is not None:
        out.close()
        raise DicomWebError(502, "dicomweb_truncated", "the store's response ended in the middle of an instance",
                            True)
    return parts


_ENCODE_SPECIALS = "a password holding '/', '?' or '#' must be percent-encoded (%2F, %3F, %23)"


def url_problem(url: str) -> str:
    """Why `url` cannot be the DICOMweb root of a store, or '' when it can; without showing it, since it may hold a
    password."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected an http:// or https:// URL naming a host"
    try:
        parts.port
    except ValueError:
        return f"its port is not a number; {_ENCODE_SPECIALS}"
    if parts.query or parts.fragment:
        return f"expected nothing after the DICOMweb root's path; {_ENCODE_SPECIALS}"
    return ""


class DicomWebClient:
    """The store at `url` (credentials may be in it, `http://user:secret@host/dicom-web`; messages never show
    them). `timeout`: seconds a connection or a read may wait. A retrieve that has run `PATIENCE_WINDOWS` times
    that long must have brought at least `MIN_BYTES_PER_WINDOW` per `timeout` on average: a store sending a trickle
    would otherwise hold a pull for hours, while one that pauses (an archive fetching from slower storage) and then
    sends fast is let be."""

    MIN_BYTES_PER_WINDOW = 1024 * 1024
    PATIENCE_WINDOWS = 10

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.shown = without_credentials(self.url)
        self.timeout = timeout

    def _fail(self, error: Exception, what: str) -> DicomWebError:
        reason = str(error).replace(self.url, self.shown)
        if isinstance(error, httpx.TimeoutException):
            return DicomWebError(504, "dicomweb_timeout", f"DICOM store at {self.shown} timed out during {what}",
                                 True)
        if isinstance(error, httpx.RemoteProtocolError) and _CUT_SHORT.search(reason):
            return DicomWebError(502, "dicomweb_truncated", f"DICOM store at {self.shown}: its answer during {what} "
                                 f"ended early: {reason}", True)
        return DicomWebError(502, "dicomweb_unreachable",
                             f"DICOM store at {self.shown} is unreachable during {what}: {reason}", True)

    def _paced(self, chunks: Iterable[bytes], check: Callable[[], None] | None) -> Iterator[bytes]:
        """`chunks` as they arrive, refused as too slow (after a chunk is passed on, so that the one that ends the
        answer always counts) once the retrieve has run `PATIENCE_WINDOWS` windows of `timeout` seconds at less
        than `MIN_BYTES_PER_WINDOW` a window; `check()` is called about once a second between reads, and may
        raise to stop."""
        started = checked = time.monotonic()
        received = 0
        for chunk in chunks:
            yield chunk
            received += len(chunk)
            now = time.monotonic()
            windows = (now - started) / self.timeout
            if windows >= self.PATIENCE_WINDOWS and received < self.MIN_BYTES_PER_WINDOW * windows:
                raise DicomWebError(504, "dicomweb_timeout", f"DICOM store at {self.shown} is too slow: it sent "
                                    f"{received} bytes in {now - started:.0f} s of a retrieve (at least "
                                    f"{self.MIN_BYTES_PER_WINDOW} per {self.timeout:g} s expected)", True)
            if check is not None and now - checked >= 1.0:
                check()
                checked = now

    def pull(self, study: str, series: str | None, dest: Path, check: Callable[[], None] | None = None) -> int:
        """WADO-RS retrieve of a series (or the whole study) into `dest/NNNNNN.dcm`; returns instance count.
        `check()`, called about once a second while the answer arrives, may raise to stop (a cancelled job, a
        client gone); a store that sends nothing is given up after `timeout` seconds either way."""
        path = f"/studies/{quote(study, safe='')}" + (f"/series/{quote(series, safe='')}" if series else "")
        dest.mkdir(parents=True, exist_ok=True)
        counter = iter(range(10**9))

        def open_part(headers: dict[str, str]) -> BinaryIO:
            # A part without a Content-Type is let through: the DICOM check below still applies.
            kind = headers.get("content-type", "application/dicom").split(";")[0].strip().lower()
            index = next(counter)
            if kind != "application/dicom":
                raise _bad_part(path, index, f"is {kind!r}, not application/dicom")
            return open(dest / f"{index:06d}.dcm", "wb")

        try:
            with httpx.stream("GET", self.url + path, headers={"Accept": ACCEPT_DICOM}, timeout=self.timeout) as r:
                if r.status_code == 404:
                    raise DicomWebError(404, "not_in_store", f"{path} not found in the DICOM store", False)
                if r.status_code >= 400:
                    raise DicomWebError(502, "dicomweb_error", f"store answered {r.status_code} for {path}",
                                        r.status_code >= 500)
                count = split_multipart(self._paced(r.iter_bytes(), check),
                                        _boundary(r.headers.get("content-type", "")), open_part)
        except httpx.HTTPError as error:
            raise self._fail(error, "retrieve") from error
        if count == 0:
            raise DicomWebError(404, "not_in_store", f"{path}: the store returned no instances", False)
        for index, part in enumerate(sorted(dest.iterdir())):
            if sniff(part) != "dicom":  # the store's fault, not the client's: not a 400 bad_dicom later
                raise _bad_part(path, index, f"is not a DICOM file ({NOT_DICOM})")
        log.info("pulled %d instances of %s", count, path)
        return count

    def store(self, files: list[Path]) -> dict:
        """STOW-RS the files (the SEG) to the store; returns the store's JSON answer."""
        sent = [_instance_uids(path) for path in files]  # a SEG that cannot be read fails before it is sent
        boundary = uuid.uuid4().hex
        part_head = f"--{boundary}\r\nContent-Type: application/dicom\r\n\r\n".encode()
        closing = f"--{boundary}--\r\n".encode()

        def body() -> Iterable[bytes]:
            for path in files:
                yield part_head
                with open(path, "rb") as handle:
                    while block := handle.read(1024 * 1024):
                        yield block
                yield b"\r\n"
            yield closing

        # Streamed with its length stated, not chunked: an intermediary that drops a chunked request body made the
        # store answer 200 to an empty request.
        length = sum(len(part_head) + path.stat().st_size + 2 for path in files) + len(closing)
        headers = {"Content-Type": f'multipart/related; type="application/dicom"; boundary={boundary}',
                   "Accept": "application/dicom+json", "Content-Length": str(length)}
        try:
            r = httpx.post(self.url + "/studies", content=body(), headers=headers, timeout=self.timeout)
        except httpx.HTTPError as error:
            raise self._fail(error, "store") from error
        answer = _stow_answer(r)
        if answer is None and r.status_code == 202:  # 202: some instances refused, and the answer says which
            raise DicomWebError(502, "dicomweb_store_refused", f"STOW-RS answered 202 (some instances not stored) "
                                f"with an answer that is neither DICOM JSON nor XML: {r.text[:200]!r}", False)
        # A store may take some instances and refuse others (200 or 202), or refuse all (409): either way the
        # refused ones are listed in the Failed SOP Sequence, whatever the status says.
        refused = _sequence_items(answer, FAILED_SOP_SEQUENCE) or []
        if refused:
            reasons = ", ".join(sorted({_failure_reason(item) for item in refused}))
            raise DicomWebError(502, "dicomweb_store_refused", f"STOW-RS answered {r.status_code} but the store "
                                f"refused {len(refused)} of {len(files)} instances (failure reasons: {reasons})",
                                False)
        if r.status_code >= 400:
            raise DicomWebError(502, "dicomweb_store_failed", f"STOW-RS answered {r.status_code}: {r.text[:200]}",
                                r.status_code >= 500)
        stored = _stored_instances(answer)
        if stored is not None:  # an answer that lists what it stored must list what was sent
            missing = [path.name for path, uids in zip(files, sent) if uids[2] not in stored]
            if missing:
                raise DicomWebError(502, "dicomweb_store_refused", f"STOW-RS answered {r.status_code} but its "
                                    f"ReferencedSOPSequence does not list {len(missing)} of the {len(files)} "
                                    f"instances sent ({', '.join(missing[:3])}): the store did not keep them", False)
        for uids in sent:
            self._confirm_listed(*uids, stow_status=r.status_code)
        return answer if isinstance(answer, dict) else {}

    def _confirm_listed(self, study: str, series: str, instance: str, stow_status: int) -> None:
        """Search (QIDO-RS) for an instance just stored: a store may answer a STOW with success and drop the
        instance all the same (a filter rule, a quota), and a job must not report a write-back that left nothing.
        Asked four times over 3.5 s, as a store may list what it stored a moment later. A store that cannot be
        searched (an answer other than 200, 204 or 404) is taken at its word, with a warning."""
        path = f"/studies/{quote(study, safe='')}/series/{quote(series, safe='')}/instances"
        for attempt in range(4):
            try:
                r = httpx.get(self.url + path, params={"SOPInstanceUID": instance},
                              headers={"Accept": "application/dicom+json"}, timeout=self.timeout)
            except httpx.HTTPError as error:
                raise self._fail(error, "the search for the stored SEG") from error
            if r.status_code not in (200, 204, 404):
                log.warning("the DICOM store at %s answered %d to a search for the SEG it stored (%s); taking the "
                            "STOW-RS answer's word that it keeps it", self.shown, r.status_code, instance)
                return
            if r.status_code == 200 and _lists_an_instance(r):
                return
            if attempt < 3:
                time.sleep(0.5 * 2**attempt)
        raise DicomWebError(502, "dicomweb_store_refused", f"STOW-RS answered {stow_status}, but the store does not "
                            f"list instance {instance} afterwards (QIDO-RS {path}): it did not keep it (a filter or "
                            "rule of the store may drop SEGs)", False)


def _stow_answer(response: httpx.Response) -> dict | None:
    """A STOW-RS answer in the DICOM JSON shape: as sent, or converted from DICOM XML (PS3.19 native model),
    which some stores send whatever was asked for; {} for an empty body, None when it is neither."""
    text = response.text.strip()
    if not text:
        return {}
    try:
        answer = response.json()
    except ValueError:
        return _json_from_xml(text)
    return answer if isinstance(answer, dict) else None


def _json_from_xml(text: str) -> dict | None:
    """The parts of a DICOM XML answer we read, as DICOM JSON: the Failed SOP Sequence's failure reasons and the
    Referenced SOP Sequence's instance UIDs."""
    try:
        root = ElementTree.fromstring(text)
    except ElementTree.ParseError:
        return None
    answer: dict = {}
    for sequence in root.iter("DicomAttribute"):
        tag = sequence.get("tag", "").upper()
        if tag == FAILED_SOP_SEQUENCE:
            items = []
            for item in sequence.findall("Item"):
                reason = _xml_value(item, FAILURE_REASON)
                code = int(reason) if reason is not None and reason.strip().isdigit() else None
                items.append({FAILURE_REASON: {"vr": "US", "Value": [code]}} if code is not None else {})
            if items:
                answer[tag] = {"vr": "SQ", "Value": items}
        elif tag == REFERENCED_SOP_SEQUENCE:
            uids = [_xml_value(item, REFERENCED_SOP_INSTANCE_UID) for item in sequence.findall("Item")]
            answer[tag] = {"vr": "SQ", "Value": [{REFERENCED_SOP_INSTANCE_UID: {"vr": "UI", "Value": [uid]}}
                                                 for uid in uids if uid]}
    return answer


def _xml_value(item: ElementTree.Element, tag: str) -> str | None:
    return next((attribute.findtext("Value") for attribute in item.findall("DicomAttribute")
                 if attribute.get("tag", "").upper() == tag), None)


def _sequence_items(answer: object, tag: str) -> list[dict] | None:
    """The items of a STOW-RS answer's sequence `tag` (DICOM JSON); None when the answer has no such sequence."""
    sequence = answer.get(tag) if isinstance(answer, dict) else None
    if not isinstance(sequence, dict):
        return None
    items = sequence.get("Value")
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []


def _first_value(item: dict, tag: str) -> object:
    """The first value of the element `tag` of a DICOM JSON item; None when it has none."""
    element = item.get(tag)
    values = element.get("Value") if isinstance(element, dict) else None
    return values[0] if isinstance(values, list) and values else None


def _stored_instances(answer: object) -> set[str] | None:
    """The SOP Instance UIDs a STOW-RS answer's Referenced SOP Sequence (0008,1199) lists as stored; None when the
    answer has no such sequence (an empty answer, which some stores give)."""
    items = _sequence_items(answer, REFERENCED_SOP_SEQUENCE)
    if items is None:
        return None
    return {str(uid) for item in items if (uid := _first_value(item, REFERENCED_SOP_INSTANCE_UID)) is not None}


def _instance_uids(path: Path) -> tuple[str, str, str]:
    """(study, series, SOP instance) UIDs of a file."""
    header = pydicom.dcmread(path, stop_before_pixels=True,
                             specific_tags=["StudyInstanceUID", "SeriesInstanceUID", "SOPInstanceUID"])
    return str(header.StudyInstanceUID), str(header.SeriesInstanceUID), str(header.SOPInstanceUID)


def _lists_an_instance(response: httpx.Response) -> bool:
    """Whether a QIDO-RS answer (a DICOM JSON list) lists an instance: the search named the one wanted, and a store
    may leave SOPInstanceUID out of what it returns."""
    try:
        found = response.json()
    except ValueError:
        return False
    return isinstance(found, list) and any(isinstance(item, dict) for item in found)


def _failure_reason(item: dict) -> str:
    """An item's Failure Reason (0008,1197) as `0xA700 (out of resources)`; "unknown" when it has none."""
    code = _first_value(item, FAILURE_REASON)
    if not isinstance(code, int):
        return "unknown"
    name = FAILURE_REASONS.get(code)
    return f"0x{code:04X}" + (f" ({name})" if name else "")


def with_retries(action: Callable[[], object], retries: int, backoff: float,
                 on_retry: Callable[[int, Exception], None] | None = None) -> object:
    """Run `action`, retrying retryable DICOMweb failures with exponential backoff (jobs only)."""
    for attempt in range(retries + 1):
        try:
            return action()
        except DicomWebError as error:
            if not error.retryable or attempt == retries:
                raise
            if on_retry is not None:
                on_retry(attempt + 1, error)
            time.sleep(backoff * (2**attempt))
    raise AssertionError("unreachable")
