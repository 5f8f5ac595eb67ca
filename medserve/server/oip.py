"""Open Inference Protocol v2 (KServe / Triton HTTP) at /v2: health, metadata, readiness and tensor inference.

`POST /v2/models/{name}/infer` takes one input tensor (N, C, X, Y, Z) already preprocessed the bundle's way
(`BundlePredictor.preprocess`) and returns the raw network output through the bundle's inferer. JSON tensors
(`data` as a flat row-major list) and the binary tensor extension (`Inference-Header-Content-Length`,
`parameters.binary_data_size`, `binary_data` outputs) are both supported. Errors are `{"error": text}` (the
app's error handlers give every error under /v2 that shape, see `medserve.server.errors`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

import anyio
import numpy as np
from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse, Response

from medserve.server.auth import require
from medserve.errors import MedserveError
from medserve.server.errors import ApiError, header_int
from medserve.server.inputs import limited
from medserve.server.services import services

log = logging.getLogger("medserve.server.oip")

DTYPES: dict[str, np.dtype] = {
    "FP32": np.dtype("<f4"), "FP16": np.dtype("<f2"), "FP64": np.dtype("<f8"),
    "INT8": np.dtype("i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "UINT8": np.dtype("u1"), "UINT16": np.dtype("<u2"), "BOOL": np.dtype("?"),
}
OUTPUT_NAME = "OUTPUT"
INPUT_NAME = "INPUT"
JSON_MAX_BYTES = 64 * 1024**2

router = APIRouter(prefix="/v2", tags=["open inference protocol v2"])


def _in_channels(network: Any) -> int:
    for module in network.modules():
        channels = getattr(module, "in_channels", None)
        if isinstance(channels, int):
            return channels
    return -1


@router.get("")
async def server_metadata() -> dict[str, Any]:
    import medserve

    return {"name": "medserve", "version": getattr(medserve, "__version__", "0.1.0"),
            "extensions": ["binary_tensor_data"]}


@router.get("/health/live")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready")
async def ready(request: Request) -> JSONResponse:
    ok = services(request).store.ready.is_set()
    return JSONResponse({"ready": ok}, 200 if ok else 503)


def _versioned_entry(request: Request, name: str, version: str | None) -> Any:
    """The model's store entry; 404 when a version is asked for that is not the bundle's (metadata.json), 400
    for a MAP: it runs whole studies in a container and has no tensor entry point (nor tensor metadata)."""
    entry = services(request).store.entry(name)
    if version is not None and version != entry.version:
        have = f"version {entry.version}" if entry.version else "no version"
        raise ApiError(404, "unknown_version", f"model {name!r} has {have}, not {version!r}")
    if entry.is_map:
        raise ApiError(400, "unsupported_model", f"model {name!r} is a MAP: POST a study to /v1/models/{name}/infer")
    return entry


@router.get("/models/{name}", dependencies=[Depends(require("infer"))])
@router.get("/models/{name}/versions/{version}", dependencies=[Depends(require("infer"))])
async def model_metadata(request: Request, name: str, version: str | None = None) -> dict[str, Any]:
    entry = _versioned_entry(request, name, version)
    channels = _in_channels(entry.predictor.network) if entry.predictor is not None else -1
    return {
        "name": name, "versions": [entry.version] if entry.version else [], "platform": "pytorch_monai_bundle",
        "inputs": [{"name": INPUT_NAME, "datatype": "FP32", "shape": [-1, channels, -1, -1, -1]}],
        "outputs": [{"name": OUTPUT_NAME, "datatype": "FP32", "shape": [-1, -1, -1, -1, -1]}],
    }


@router.get("/models/{name}/ready", dependencies=[Depends(require("infer"))])
@router.get("/models/{name}/versions/{version}/ready", dependencies=[Depends(require("infer"))])
async def model_ready(request: Request, name: str, version: str | None = None) -> JSONResponse:
    entry = _versioned_entry(request, name, version)
    ok = entry.predictor is not None
    return JSONResponse({"name": name, "ready": ok}, 200 if ok else 400)


def _parse_request(headers: Any, body: bytes) -> tuple[dict[str, Any], memoryview]:
    header_length = headers.get("inference-header-content-length")
    if header_length is not None:
        split = header_int(header_length)
        if split is None or split > len(body):
            raise ApiError(400, "bad_request", "Inference-Header-Content-Length must be a byte count within the body, "
                           f"not {header_length!r}")
        head, binary = body[:split], memoryview(body)[split:]  # no copy of the tensor's bytes
    else:
        head, binary = body, memoryview(b"")
    if len(head) > JSON_MAX_BYTES:
        # Parsed, JSON numbers take about ten times their text in memory: larger tensors go as binary data.
        raise ApiError(413, "body_too_large", f"the request's JSON is {len(head)} bytes, over {JSON_MAX_BYTES}; send "
                       "the tensor as binary data (binary tensor extension: parameters.binary_data_size and "
                       "Inference-Header-Content-Length)")
    try:
        request = json.loads(head)
    except (ValueError, RecursionError) as error:  # RecursionError: nesting deeper than the parser goes
        raise ApiError(400, "bad_request", f"inference request header is not JSON: {error}") from error
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list) or len(request["inputs"]) != 1:
        raise ApiError(400, "bad_request", "expected exactly one input tensor in 'inputs'")
    if not isinstance(request["inputs"][0], dict):
        raise ApiError(400, "bad_request", f"inputs[0] must be a tensor object, not {request['inputs'][0]!r}")
    return request, binary


def _parameters(holder: dict[str, Any], where: str) -> dict[str, Any]:
    parameters = holder.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ApiError(400, "bad_request", f"{where}.parameters must be an object, not {parameters!r}")
    return parameters


def _tensor(spec: dict[str, Any], binary: memoryview) -> np.ndarray:
    if spec.get("name") != INPUT_NAME:
        raise ApiError(400, "bad_request", f"unknown input {spec.get('name')!r}; the model's input is {INPUT_NAME!r}")
    datatype = spec.get("datatype")
    shape = spec.get("shape")
    if not isinstance(datatype, str) or datatype not in DTYPES:  # a list or object is not even hashable
        raise ApiError(400, "bad_request", f"unsupported datatype {datatype!r}; expected one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or len(shape) != 5 or not all(_is_count(s) for s in shape):
        raise ApiError(400, "bad_request", f"input shape must be [N, C, X, Y, Z] of positive ints, got {shape}")
    dtype = DTYPES[datatype]
    size = _parameters(spec, "inputs[0]").get("binary_data_size")
    if size is not None:
        if spec.get("data") is not None:
            raise ApiError(400, "bad_request", "inputs[0] has both 'data' and parameters.binary_data_size; send "
                           "the values one way")
        expected = math.prod(shape) * dtype.itemsize
        if not _is_count(size) or size != expected:
            raise ApiError(400, "bad_request", f"binary_data_size {size} does not match shape {shape} {datatype} "
                           f"({expected} bytes)")
        if len(binary) != size:
            raise ApiError(400, "bad_request", f"the body holds {len(binary)} bytes of binary data after its "
                           f"Inference-Header-Content-Length JSON header; binary_data_size says {size}")
        array = np.frombuffer(binary, dtype=dtype)
    else:
        data = spec.get("data")
        if data is None:
            raise ApiError(400, "bad_request", "input has neither 'data' nor parameters.binary_data_size")
        array = _json_values(data, datatype, dtype)
        if array.size != math.prod(shape):
            raise ApiError(400, "bad_request", f"{array.size} values given for shape {shape}")
    with np.errstate(over="ignore"):  # an overflow becomes inf, refused just below
        tensor = array.reshape(shape).astype(np.float32, copy=False)
    if not np.isfinite(tensor).all():
        raise ApiError(400, "bad_request", f"inputs[0] holds NaN or infinite values (as FP32: {datatype} values "
                       "beyond 3.4e38 overflow); the model takes finite numbers")
    return tensor


# The JSON values each datatype takes, as numpy infers their kind: numbers for floats, whole numbers for integer
# types, true/false for BOOL. Casting alone would turn "1.5" into 1.5, 1.7 into 1 for INT32 and 5 into True.
_JSON_KINDS = {"f": "iuf", "i": "iu", "u": "iu", "b": "b"}


def _json_values(data: Any, datatype: str, dtype: np.dtype) -> np.ndarray:
    """`data` (flat or nested row-major lists) as a flat array of `dtype`; 400 naming what does not fit."""
    what = "values (true/false)" if dtype.kind == "b" else "numbers"
    expected = f"inputs[0].data must be a list of {datatype} {what}"
    try:
        values = np.asarray(data).reshape(-1)
    except (TypeError, ValueError, OverflowError) as error:  # ragged nesting
        raise ApiError(400, "bad_request", f"{expected}: {error}") from error
    if dtype.kind != "b" and values.dtype.kind in "iuf" and _holds_bool(data):  # [1, true] is int64 to numpy
        raise ApiError(400, "bad_request", f"{expected}; got true/false among them")
    if values.size and values.dtype.kind not in _JSON_KINDS[dtype.kind]:
        found = {"U": "text", "O": "objects or integers beyond 64 bits", "b": "true/false", "f": "fractional "
                 "numbers"}.get(values.dtype.kind, str(values.dtype))
        raise ApiError(400, "bad_request", f"{expected}; got {found}")
    if values.size and dtype.kind in "iu":
        limits = np.iinfo(dtype)
        if values.min() < limits.min or values.max() > limits.max:
            raise ApiError(400, "bad_request", f"{expected} within {limits.min}..{limits.max}")
    return values.astype(dtype, copy=False)


def _holds_bool(data: Any) -> bool:
    """Whether nested lists hold a JSON true/false (Python's bool is an int: numpy casts them silently)."""
    lists = [data]
    while lists:
        for value in lists.pop():
            if value is True or value is False:
                return True
            if type(value) is list:
                lists.append(value)
    return False


def _is_count(value: object) -> bool:
    """A positive JSON integer: true and false are ints to Python, not to the protocol."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _flag(parameters: dict[str, Any], key: str, where: str, default: bool) -> bool:
    """A boolean parameter; "false" as a string would be truthy, so only JSON true/false are taken."""
    value = parameters.get(key, default)
    if not isinstance(value, bool):
        raise ApiError(400, "bad_request", f"{where}.parameters.{key} must be true or false, not {value!r}")
    return value


def _binary_output(req: dict[str, Any]) -> bool:
    """Whether the output goes back in binary; checks 'outputs' and 'parameters' before anything runs."""
    binary_default = _flag(_parameters(req, "request"), "binary_data_output", "request", False)
    wanted = req.get("outputs") or [{"name": OUTPUT_NAME}]
    if not isinstance(wanted, list) or not all(isinstance(w, dict) for w in wanted):
        raise ApiError(400, "bad_request", f"'outputs' must be a list of objects such as {{\"name\": "
                       f"\"{OUTPUT_NAME}\"}}, not {wanted!r}")
    names = [w.get("name") for w in wanted]
    if any(n != OUTPUT_NAME for n in names):
        raise ApiError(400, "bad_request", f"unknown output(s) {names}; the only output is {OUTPUT_NAME!r}")
    if len(names) > 1:  # which entry's binary_data would count?
        raise ApiError(400, "bad_request", f"'outputs' names {OUTPUT_NAME!r} {len(names)} times; name it once")
    return _flag(_parameters(wanted[0], "outputs[0]"), "binary_data", "outputs[0]", binary_default)


@router.post("/models/{name}/infer", dependencies=[Depends(require("infer"))])
@router.post("/models/{name}/versions/{version}/infer", dependencies=[Depends(require("infer"))])
async def infer(request: Request, name: str, version: str | None = None) -> Response:
    shared = services(request)
    start = time.monotonic()
    with shared.metrics.counted("v2") as count:
        _versioned_entry(request, name, version)
        count.model = name
        body = await limited(request, shared.config.max_upload_bytes).body()
        req, binary = _parse_request(request.headers, body)
        array = _tensor(req["inputs"][0], binary)
        want_binary = _binary_output(req)

        def run() -> np.ndarray:
            import torch

            predictor = shared.store.predictor(name)
            channels = _in_channels(predictor.network)
            if channels > 0 and array.shape[1] != channels:
                raise ApiError(400, "bad_request", f"input shape {list(array.shape)} has {array.shape[1]} "
                               f"channel(s); model {name!r} takes {channels}")
            # Binary request data is a read-only view of the body; torch tensors must own writable memory.
            out = predictor.infer_tensor(torch.from_numpy(np.require(array, requirements=("C", "W"))))
            return out.detach().to("cpu", torch.float32).numpy()

        try:
            async with shared.store.admit(name) as (queued, limiter):
                shared.metrics.queue.labels(name).observe(queued)
                output = await anyio.to_thread.run_sync(run, limiter=limiter)
        except (ApiError, MedserveError):  # answered by the app's handlers, in the OIP shape under /v2
            raise
        except Exception as error:
            log.exception("v2 inference failed")
            raise ApiError(500, "inference_failed", f"{type(error).__name__}: {error}") from error
        response = _response(name, shared.store.entry(name).version, req, output, want_binary)
        count.status = "200"
    shared.metrics.latency.labels(name, "v2").observe(time.monotonic() - start)
    return response


def _response(name: str, version: str | None, req: dict[str, Any], output: np.ndarray, want_binary: bool) -> Response:
    tensor: dict[str, Any] = {"name": OUTPUT_NAME, "datatype": "FP32", "shape": list(output.shape)}
    result: dict[str, Any] = {"model_name": name, "model_version": version or "", "outputs": [tensor]}
    if "id" in req:
        result["id"] = req["id"]
    if not want_binary:
        if not np.isfinite(output).all():
            raise ApiError(500, "non_finite_output", f"model {name!r} gave NaN or infinite values, which JSON cannot "
                           "carry; ask for the output in binary (parameters.binary_data_output)")
        tensor["data"] = output.reshape(-1).tolist()
        return JSONResponse(result)
    raw = np.ascontiguousarray(output, dtype="<f4").tobytes()
    tensor["parameters"] = {"binary_data_size": len(raw)}
    head = json.dumps(result).encode()
    return Response(head + raw, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head))})
