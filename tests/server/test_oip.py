"""Open Inference Protocol v2 with the official tritonclient.http client: JSON and binary tensors."""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.server.conftest import add_bundle, bundle_snapshot, with_thr


def test_tritonclient_json_and_binary(make_server) -> None:
    server = make_server()
    add_bundle(server.config.store, "demo")
    server.store.wait_until("demo", ("loaded",), 60)
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("demo")
    meta = client.get_model_metadata("demo")
    assert meta["inputs"][0]["name"] == "INPUT" and meta["inputs"][0]["shape"][1] == 1
    version = meta["versions"][0]  # the bundle's metadata.json version; no other is served
    assert client.get_model_metadata("demo", model_version=version)["versions"] == [version]
    assert client.is_model_ready("demo", model_version=version)
    with pytest.raises(InferenceServerException, match=f"has version {version}, not '9'"):
        client.get_model_metadata("demo", model_version="9")
    assert not client.is_model_ready("demo", model_version="9")

    rng = np.random.default_rng(0)
    batch = rng.random((1, 1, 32, 32, 16), dtype=np.float32)
    # What the server must return: the same bundle's network + inferer, run here in-process.
    from medserve.bundle.predictor import BundlePredictor

    expected = BundlePredictor.from_dir(bundle_snapshot(), device="cpu").infer_tensor(torch.from_numpy(batch)).numpy()
    for binary in (False, True):
        tensor = triton.InferInput("INPUT", list(batch.shape), "FP32")
        tensor.set_data_from_numpy(batch, binary_data=binary)
        output = triton.InferRequestedOutput("OUTPUT", binary_data=binary)
        result = client.infer("demo", [tensor], outputs=[output])
        got = result.as_numpy("OUTPUT")
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(InferenceServerException, match="unknown|no model"):
        client.infer("nope", [tensor])
    bad = triton.InferInput("INPUT", [1, 1, 4], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 1, 4), np.float32))
    with pytest.raises(InferenceServerException, match="shape"):
        client.infer("demo", [bad])


def test_malformed_requests_give_400_before_inference(make_server) -> None:
    """Every malformed part of a request is refused with 400 naming it, before the model runs; a model that fails
    to load on demand answers like /v1 (409 model_failed), not 500."""
    thr_server = with_thr(make_server(max_models=1))  # a second bundle is then loaded on demand only
    url = thr_server.url + "/v2/models/thr/infer"
    tensor = {"name": "INPUT", "datatype": "FP32", "shape": [1, 1, 2, 2, 2], "data": [0.0] * 8}
    for request, expected in (
            ({"inputs": [{**tensor, "data": ["a"] * 8}]}, "inputs[0].data"),
            ({"inputs": [{**tensor, "data": [[1, 2], [3]]}]}, "inputs[0].data"),
            ({"inputs": [{**tensor, "parameters": [1]}]}, "inputs[0].parameters"),
            ({"inputs": [5]}, "inputs[0]"),
            ({"inputs": [tensor], "parameters": [1]}, "request.parameters"),
            ({"inputs": [tensor], "outputs": ["x"]}, "'outputs'"),
            ({"inputs": [tensor], "outputs": [{"name": "OUTPUT", "parameters": 3}]}, "outputs[0].parameters"),
            ({"inputs": [{**tensor, "shape": [1, 3, 2, 2, 2], "data": [0.0] * 24}]}, "3 channel(s)"),
            ({"inputs": [{**tensor, "data": [0.0] * 7 + [float("nan")]}]}, "NaN or infinite"),
            ({"inputs": [{**tensor, "datatype": "FP64", "data": [1e40] * 8}]}, "NaN or infinite"),
            ({"inputs": [{**tensor, "datatype": "INT8", "data": [300] * 8}]}, "list of INT8 numbers"),
            ({"inputs": [{**tensor, "datatype": "UINT8", "data": [-1] * 8}]}, "list of UINT8 numbers"),
            ({"inputs": [{**tensor, "datatype": "INT64", "data": [2**70] * 8}]}, "list of INT64 numbers"),
            # Unhashable datatypes and boolean sizes were 500s (TypeError), a "false" string a binary answer.
            ({"inputs": [{**tensor, "datatype": ["FP32"]}]}, "unsupported datatype ['FP32']; expected one of"),
            ({"inputs": [{**tensor, "datatype": {"FP32": 1}}]}, "unsupported datatype {'FP32': 1}"),
            ({"inputs": [{**tensor, "shape": [True, True, 2, 2, 2]}]}, "[N, C, X, Y, Z] of positive ints"),
            ({"inputs": [tensor], "parameters": {"binary_data_output": "false"}},
             "request.parameters.binary_data_output must be true or false, not 'false'"),
            ({"inputs": [tensor], "outputs": [{"name": "OUTPUT", "parameters": {"binary_data": 1}}]},
             "outputs[0].parameters.binary_data must be true or false, not 1"),
            # Accepted before (200): values cast to the datatype whatever they were, other input names.
            ({"inputs": [{**tensor, "name": "FOO"}]}, "unknown input 'FOO'; the model's input is 'INPUT'"),
            ({"inputs": [{k: v for k, v in tensor.items() if k != "name"}]}, "unknown input None"),
            ({"inputs": [{**tensor, "datatype": "INT32", "data": [1.7] * 8}]},
             "inputs[0].data must be a list of INT32 numbers; got fractional numbers"),
            ({"inputs": [{**tensor, "datatype": "BOOL", "data": [5] * 8}]},
             "inputs[0].data must be a list of BOOL values (true/false); got int64"),
            ({"inputs": [{**tensor, "data": ["1.5"] * 8}]}, "inputs[0].data must be a list of FP32 numbers; got text"),
            ({"inputs": [{**tensor, "data": [True] * 8}]}, "got true/false"),
            ({"inputs": [{**tensor, "data": [0.5] * 7 + [True]}]}, "got true/false among them"),
            ({"inputs": [{**tensor, "datatype": "INT32", "data": [[1, 2], [3, 4], [5, 6], [7, False]]}]},
             "got true/false among them"),
            ({"inputs": [tensor], "outputs": [{"name": "OUTPUT"}, {"name": "OUTPUT", "parameters": {"binary_data":
                                                                                                 True}}]},
             "'outputs' names 'OUTPUT' 2 times; name it once"),
            ({"inputs": [{**tensor, "parameters": {"binary_data_size": 32}}]},
             "inputs[0] has both 'data' and parameters.binary_data_size")):
        r = httpx.post(url, content=json.dumps(request), headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and expected in r.json()["error"], (request, r.text)
    binary = {"inputs": [{**tensor, "data": None, "parameters": {"binary_data_size": 32.0}}]}
    head = json.dumps(binary).encode()
    r = httpx.post(url, content=head + bytes(32), headers={"Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 400 and "binary_data_size 32.0" in r.json()["error"], r.text
    good = {"inputs": [{**tensor, "data": None, "parameters": {"binary_data_size": 32}}]}
    head = json.dumps(good).encode()
    for body, expected in ((head + bytes(16), "the body holds 16 bytes of binary data after its "
                                              "Inference-Header-Content-Length JSON header; binary_data_size says 32"),
                           (head + bytes(40), "the body holds 40 bytes")):  # the extra 8 were ignored: 200
        r = httpx.post(url, content=body, headers={"Inference-Header-Content-Length": str(len(head))})
        assert r.status_code == 400 and expected in r.json()["error"], r.text
    for digits in ("9" * 5000, "9" * 20):  # int() refuses over 4,300 digits: that was a 500
        r = httpx.post(url, content=head + bytes(32), headers={"Inference-Header-Content-Length": digits})
        assert r.status_code == 400 and "Inference-Header-Content-Length must be a byte count" in r.json()["error"]
    big = b'{"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 1, 1, 1, 1], "data": [' + b"0," * (
        33 * 1024**2) + b"0]}]}"  # parsed, about 10x its size in memory: refused unread
    r = httpx.post(url, content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "send the tensor as binary data" in r.json()["error"], r.text[:300]
    r = httpx.post(url, content="[" * 100_000 + "]" * 100_000, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"], r.text
    metrics = httpx.get(thr_server.url + "/metrics").text
    assert 'medserve_requests_total{endpoint="v2",model="thr",status="200"}' not in metrics  # nothing ran

    broken = thr_server.config.store / "broken"
    shutil.copytree(thr_server.config.store / "thr", broken)
    (broken / "models" / "model.pt").write_bytes(b"not a torch file")
    thr_server.store.wait_until("broken", ("failed",), 30)  # told from the file, before any load
    r = httpx.post(thr_server.url + "/v2/models/broken/infer", json={"inputs": [tensor]})
    assert r.status_code == 409 and "failed to load" in r.json()["error"], r.text

    # A MAP has no tensor entry point: its metadata and readiness say so as its infer does (its metadata described
    # a bundle's INPUT/OUTPUT tensors).
    (thr_server.config.store / "seg.map.json").write_text(json.dumps({"image": "localhost/medserve-none:1"}))
    thr_server.store.wait_until("seg", ("failed", "available"), 60)
    for path in ("", "/ready", "/infer"):
        model_url = thr_server.url + f"/v2/models/seg{path}"
        r = httpx.post(model_url, json={"inputs": [tensor]}) if path == "/infer" else httpx.get(model_url)
        assert r.status_code == 400 and r.json() == {"error": "model 'seg' is a MAP: POST a study to "
                                                              "/v1/models/seg/infer"}, (path, r.text)


class Raising(torch.nn.Module):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        raise self.error


@pytest.mark.parametrize("error,status", [(RuntimeError("Sizes of tensors must match"), 422), (MemoryError(), 503)],
                         ids=["fails", "out-of-memory"])
def test_a_failing_network_is_a_4xx_or_503_naming_bundle_and_shape(thr_server, error, status) -> None:
    predictor = thr_server.store.predictor("thr")
    network, predictor.network = predictor.network, Raising(error)
    tensor = {"name": "INPUT", "datatype": "FP32", "shape": [1, 1, 2, 2, 2], "data": [0.0] * 8}
    try:
        r = httpx.post(thr_server.url + "/v2/models/thr/infer", json={"inputs": [tensor]})
    finally:
        predictor.network = network
    assert r.status_code == status, r.text
    assert r.json()["error"].startswith("bundle thr: network/inferer (SlidingWindowInferer) failed on the input "
                                        "tensor of shape [1, 1, 2, 2, 2]: "), r.text
    metrics = httpx.get(thr_server.url + "/metrics").text
    assert f'medserve_requests_total{{endpoint="v2",model="thr",status="{status}"}} 1.0' in metrics


class NaNs(torch.nn.Module):
    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.full((batch.shape[0], 2, *batch.shape[2:]), float("nan"))


def test_a_non_finite_output_is_an_error_in_json_and_sent_in_binary(thr_server) -> None:
    """JSON cannot carry NaN: the JSON answer is a 500 saying so (and counted as one), the binary answer
    carries the values."""
    predictor = thr_server.store.predictor("thr")
    network, predictor.network = predictor.network, NaNs()
    tensor = {"name": "INPUT", "datatype": "FP32", "shape": [1, 1, 2, 2, 2], "data": [0.0] * 8}
    url = thr_server.url + "/v2/models/thr/infer"
    try:
        as_json = httpx.post(url, json={"inputs": [tensor]})
        as_binary = httpx.post(url, json={"inputs": [tensor], "parameters": {"binary_data_output": True}})
    finally:
        predictor.network = network
    assert as_json.status_code == 500 and "NaN or infinite" in as_json.json()["error"], as_json.text
    split = int(as_binary.headers["Inference-Header-Content-Length"])
    assert as_binary.status_code == 200 and np.isnan(np.frombuffer(as_binary.content[split:], "<f4")).all()
    metrics = httpx.get(thr_server.url + "/metrics").text
    assert 'medserve_requests_total{endpoint="v2",model="thr",status="500"} 1.0' in metrics
