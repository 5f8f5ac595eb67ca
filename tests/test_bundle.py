"""Bundle inference: real zoo configs unchanged, orientation by construction, label range, bad bundles."""

from __future__ import annotations

import json
import shutil

import highdicom as hd
import numpy as np
import pytest
import torch

from medserve.bundle import BundlePredictor
from medserve.demo.phantom import dice, make_phantom
from medserve.demo.study import SeriesGeometry
from medserve.errors import BundleError
from tests.conftest import THRESHOLD_HU, make_threshold_bundle
from tests.test_volume import ORIENTATIONS


def phantom_volume(shape=(24, 48, 48), spacing=(2.5, 2.0, 2.0), orientation=ORIENTATIONS["axial"], seed=1,
                   bone=True):
    phantom = make_phantom(shape=shape, spacing=spacing, seed=seed, bone=bone)
    geometry = SeriesGeometry(orientation=orientation, pixel_spacing=spacing[1:], slice_spacing=spacing[0])
    return hd.Volume(array=phantom.hu, affine=geometry.affine(), coordinate_system="PATIENT"), phantom


@pytest.mark.parametrize("name,labels", [("spleen_ct_segmentation", 1), ("swin_unetr_btcv_segmentation", 13),
                                         ("wholeBody_ct_segmentation", 104)])
def test_model_zoo_configs_run_unchanged(zoo_bundle, name, labels):
    predictor = BundlePredictor.from_dir(zoo_bundle(name), device="cpu")
    assert len(predictor.labels) == labels
    volume, _ = phantom_volume()
    label_map = predictor.predict(volume)
    assert label_map.shape == volume.array.shape
    assert label_map.dtype == np.uint16
    assert label_map.max() <= labels
    # Loaded once, reused: a second call on another volume works with the same objects.
    other, _ = phantom_volume(shape=(20, 40, 44), seed=2)
    assert predictor.predict(other).shape == other.array.shape


@pytest.mark.parametrize("orientation", ["axial", "sagittal", "coronal", "oblique", "feet_first_flipped"])
@pytest.mark.parametrize("axcodes", ["RAS", "LPS"])
def test_prediction_lands_on_the_source_voxels_for_any_orientation(tmp_path, orientation, axcodes):
    """The thresholding bundle resamples to 2 mm in its own axis order and back: its label map must be the
    threshold of the source voxels. A flip or transpose anywhere in the chain would break the overlap."""
    bundle = make_threshold_bundle(tmp_path / "threshold", pixdim=(2.0, 2.0, 2.0), axcodes=axcodes)
    predictor = BundlePredictor.from_dir(bundle, device="cpu")
    volume, _ = phantom_volume(spacing=(3.0, 1.5, 1.75), orientation=ORIENTATIONS[orientation], bone=False)
    label_map = predictor.predict(volume)
    assert dice(label_map, volume.array > THRESHOLD_HU) > 0.93


def test_real_ct_prediction_overlaps_its_threshold(threshold_bundle, real_ct):
    geometry = SeriesGeometry(pixel_spacing=(1.5, 1.5), slice_spacing=2.0)
    volume = hd.Volume(array=real_ct, affine=geometry.affine(), coordinate_system="PATIENT")
    label_map = BundlePredictor.from_dir(threshold_bundle, device="cpu").predict(volume)
    assert dice(label_map, real_ct > THRESHOLD_HU) > 0.9


def test_label_values_above_255_survive(tmp_path):
    bundle = make_threshold_bundle(tmp_path / "many")
    config = json.loads((bundle / "configs" / "inference.json").read_text())
    config["network_def"]["out_channels"] = 300
    (bundle / "configs" / "inference.json").write_text(json.dumps(config))
    weight = torch.zeros(300, 1, 1, 1, 1)
    bias = torch.zeros(300)
    weight[299] = 10.0  # class 299 wins wherever the scaled intensity is positive
    torch.save({"weight": weight, "bias": bias}, bundle / "models" / "model.pt")
    volume, _ = phantom_volume()
    label_map = BundlePredictor.from_dir(bundle, device="cpu").predict(volume)
    assert label_map.max() == 299
    assert set(np.unique(label_map)) <= {0, 299}


def test_torchscript_weights_load(tmp_path, threshold_bundle):
    bundle = tmp_path / "ts"
    shutil.copytree(threshold_bundle, bundle)
    network = torch.nn.Conv3d(1, 2, 1)
    network.load_state_dict(torch.load(bundle / "models" / "model.pt"))
    torch.jit.script(network).save(str(bundle / "models" / "model.ts"))
    (bundle / "models" / "model.pt").unlink()
    volume, _ = phantom_volume()
    label_map = BundlePredictor.from_dir(bundle, device="cpu").predict(volume)
    assert dice(label_map, volume.array > THRESHOLD_HU) > 0.93


def test_yaml_config_is_found(tmp_path, threshold_bundle):
    import yaml

    bundle = tmp_path / "yml"
    shutil.copytree(threshold_bundle, bundle)
    config = json.loads((bundle / "configs" / "inference.json").read_text())
    (bundle / "configs" / "inference.json").unlink()
    (bundle / "configs" / "inference.yml").write_text(yaml.safe_dump(config))
    assert BundlePredictor.from_dir(bundle, device="cpu").layout.config_path.name == "inference.yml"


def test_bundle_without_weights_is_refused(tmp_path, threshold_bundle):
    bundle = tmp_path / "noweights"
    shutil.copytree(threshold_bundle, bundle)
    (bundle / "models" / "model.pt").unlink()
    with pytest.raises(BundleError, match="no weights; expected models/model.pt"):
        BundlePredictor.from_dir(bundle)


def test_malformed_config_is_refused_naming_the_file(tmp_path, threshold_bundle):
    bundle = tmp_path / "malformed"
    shutil.copytree(threshold_bundle, bundle)
    (bundle / "configs" / "inference.json").write_text('{"network_def": {')
    with pytest.raises(BundleError, match="inference.json: cannot read config"):
        BundlePredictor.from_dir(bundle)


def test_config_without_network_is_refused(tmp_path, threshold_bundle):
    bundle = tmp_path / "nonet"
    shutil.copytree(threshold_bundle, bundle)
    config = json.loads((bundle / "configs" / "inference.json").read_text())
    del config["network_def"]
    (bundle / "configs" / "inference.json").write_text(json.dumps(config))
    with pytest.raises(BundleError, match="'network_def' is missing"):
        BundlePredictor.from_dir(bundle)


def test_weights_that_do_not_fit_the_network_are_refused(tmp_path, threshold_bundle):
    bundle = tmp_path / "mismatch"
    shutil.copytree(threshold_bundle, bundle)
    torch.save(torch.nn.Conv3d(1, 5, 3).state_dict(), bundle / "models" / "model.pt")
    with pytest.raises(BundleError, match="weights do not fit network_def Conv3d.*size mismatch"):
        BundlePredictor.from_dir(bundle)


def test_weights_file_that_is_not_torch_is_refused(tmp_path, threshold_bundle):
    bundle = tmp_path / "garbage"
    shutil.copytree(threshold_bundle, bundle)
    (bundle / "models" / "model.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(BundleError, match="model.pt: not a readable PyTorch weights file"):
        BundlePredictor.from_dir(bundle)


def test_missing_metadata_is_refused(tmp_path, threshold_bundle):
    bundle = tmp_path / "nometa"
    shutil.copytree(threshold_bundle, bundle)
    (bundle / "configs" / "metadata.json").unlink()
    with pytest.raises(BundleError, match="configs/metadata.json is missing"):
        BundlePredictor.from_dir(bundle)
