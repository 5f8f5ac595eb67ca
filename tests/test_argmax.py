"""argmax as torch.max indices: the same answer as torch.argmax in every case a bundle can hit, and in use."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from monai.transforms import AsDiscreted

from medserve.bundle.predictor import BundlePredictor
from medserve.bundle.argmax import MaxIndicesArgmax, class_indices
from tests.conftest import make_threshold_bundle
from tests.test_bundle import phantom_volume

NAN = float("nan")


def scores_with_ties_and_nans(channels: int) -> torch.Tensor:
    """Whole-number scores (many exact ties) with a few NaNs, including several NaNs along one reduction."""
    generator = torch.Generator().manual_seed(channels)
    scores = torch.randint(0, 3, (channels, 6, 7, 5), generator=generator).float()
    scores[0, 0, 0, 0] = NAN
    scores[1, 1, 1, 1] = NAN
    scores[:, 2, 2, 2] = NAN
    scores[-1, 3, 3, 3] = -float("inf")
    return scores


@pytest.mark.parametrize("channels", [2, 3, 14])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_class_indices_equal_torch_argmax(channels, dim, keepdim):
    scores = scores_with_ties_and_nans(channels)
    assert torch.equal(class_indices(scores, dim, keepdim), torch.argmax(scores, dim=dim, keepdim=keepdim))


def test_argmax_under_the_mode_answers_as_torch_argmax():
    scores = scores_with_ties_and_nans(3)
    strided = scores.transpose(0, 2)  # not contiguous
    calls = [
        lambda x: torch.argmax(x, 0),
        lambda x: torch.argmax(x, dim=1, keepdim=True),
        lambda x: x.argmax(-1),
        lambda x: x.argmax(dim=0, keepdim=True),
        lambda x: torch.argmax(x),  # no dim: the flat index, left to torch
    ]
    for source in (scores, strided):
        expected = [call(source) for call in calls]
        with MaxIndicesArgmax():
            answered = [call(source) for call in calls]
        for want, got in zip(expected, answered):
            assert torch.equal(want, got)


def test_monai_asdiscreted_gives_the_same_metatensor_under_the_mode():
    scores = MetaTensor(scores_with_ties_and_nans(2), affine=torch.diag(torch.tensor([2.0, 3.0, 4.0, 1.0])),
                        meta={"filename_or_obj": "volume"})
    transform = AsDiscreted(keys="pred", argmax=True)
    expected = transform({"pred": scores})["pred"]
    with MaxIndicesArgmax():
        answered = transform({"pred": scores})["pred"]
    assert type(answered) is type(expected) and answered.dtype == expected.dtype
    assert torch.equal(answered.as_tensor(), expected.as_tensor())
    assert torch.equal(answered.affine, expected.affine)
    assert answered.meta["filename_or_obj"] == "volume"


def test_the_bundles_postprocessing_argmax_is_answered_by_max(threshold_bundle, monkeypatch):
    answered: list[str] = []
    original = MaxIndicesArgmax.__torch_function__

    def recording(self, func, types, args=(), kwargs=None):
        if func in (torch.argmax, torch.Tensor.argmax):
            answered.append(func.__name__)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(MaxIndicesArgmax, "__torch_function__", recording)
    volume, _ = phantom_volume(bone=False)
    BundlePredictor.from_dir(threshold_bundle, device="cpu").predict(volume)
    assert answered == ["argmax"]  # the bundle's AsDiscreted(argmax=True)


def test_class_scores_left_by_a_bundle_give_the_same_label_map(tmp_path, threshold_bundle):
    """A bundle without AsDiscreted leaves class scores: the predictor takes the winning class itself."""
    bundle = make_threshold_bundle(tmp_path / "scores")
    config_path = bundle / "configs" / "inference.json"
    config = json.loads(config_path.read_text())
    config["postprocessing"]["transforms"] = [t for t in config["postprocessing"]["transforms"]
                                              if t["_target_"] != "AsDiscreted"]
    config_path.write_text(json.dumps(config))
    volume, _ = phantom_volume(bone=False)
    with_argmax = BundlePredictor.from_dir(threshold_bundle, device="cpu").predict(volume)
    from_scores = BundlePredictor.from_dir(bundle, device="cpu").predict(volume)
    assert with_argmax.any()
    np.testing.assert_array_equal(from_scores, with_argmax)
