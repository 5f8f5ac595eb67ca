"""Open Inference Protocol v2 with the official tritonclient.http client: JSON and binary tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.server.conftest import add_bundle, bundle_snapshot


def test_tritonclient_json_and_binary(make_server) -> None:
    server = make_server()
    add_bundle(server.config.store, "demo")
    server.store.wait_until("demo", ("loaded",), 60)
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("demo")
    meta = client.get_model_metadata("demo")
    assert meta["inputs"][0]["name"] == "INPUT" and meta["inputs"][0]["shape"][1] == 1

    rng = np.random.default_rng(0)
    batch = rng.random((1, 1, 32, 32, 16), dtype=np.float32)
    # What the server must return: the same bundle's network + inferer, run here in-process.
    from medserve.bundle import BundlePredictor

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
