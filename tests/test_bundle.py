"""Bundle inference: real zoo configs unchanged, orientation by construction, label range, bad bundles."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import highdicom as hd
import numpy as np
import pytest
import torch

from monai.bundle import ConfigParser

from medserve.bundle.predictor import BundlePredictor
from medserve.demo.phantom import dice, make_phantom
from medserve.demo.study import SeriesGeometry, write_ct_series
from medserve.errors import BundleError, InferenceError, InferenceOutOfMemory
from tests.conftest import MODEL_ZOO, THRESHOLD_HU, make_threshold_bundle, run_app, run_unprivileged
from tests.test_volume import ORIENTATIONS


def phantom_volume(shape=(24, 48, 48), spacing=(2.5, 2.0, 2.0), orientation=ORIENTATIONS["axial"], seed=1,
                   bone=True):
    phantom = make_phantom(shape=shape, spacing=spacing, seed=seed, bone=bone)
    geometry = SeriesGeometry(orientation=orientation, pixel_spacing=spacing[1:], slice_spacing=spacing[0])
    return hd.Volume(array=phantom.hu, affine=geometry.affine(), coordinate_system="PATIENT"), phantom


def zoo_bundle_params(root):
    """One parameter per bundle folder under `root`; a single None (the test then fails) when there are none."""
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if root.is_dir() else []
    return names or [pytest.param(None, id="no-bundles")]


def test_zoo_discovery_finds_every_bundle_folder_and_flags_none(tmp_path):
    assert zoo_bundle_params(tmp_path) == [pytest.param(None, id="no-bundles")]
    assert zoo_bundle_params(tmp_path / "absent") == [pytest.param(None, id="no-bundles")]
    for name in ("b_bundle", "a_bundle", ".hidden"):
        (tmp_path / name / "configs").mkdir(parents=True)
    (tmp_path / "README.md").write_text("not a bundle")
    assert zoo_bundle_params(tmp_path) == ["a_bundle", "b_bundle"]


def output_channels(config_path):
    """network_def's out_channels as the config states it (references resolved), or None."""
    parser = ConfigParser()
    parser.read_config(str(config_path))
    return parser.get_parsed_content("network_def#out_channels") if "network_def#out_channels" in parser else None


@pytest.mark.parametrize("name", zoo_bundle_params(MODEL_ZOO))
def test_model_zoo_configs_run_unchanged(zoo_bundle, name, caplog):
    if name is None:
        state = "holds no bundle folders" if MODEL_ZOO.is_dir() else "does not exist"
        pytest.fail(f"{MODEL_ZOO} {state}; expected the model-zoo test data, one folder per published bundle")
    predictor = BundlePredictor.from_dir(zoo_bundle(name), device="cpu")
    channels = output_channels(predictor.layout.config_path)
    assert predictor.labels, f"{name}: metadata.json names no foreground labels"
    if channels is not None:  # one output channel per label, plus background
        assert len(predictor.labels) == channels - 1
    labels = max(predictor.labels)
    volume, _ = phantom_volume()
    with caplog.at_level(logging.INFO, logger="medserve.bundle"):
        label_map = predictor.predict(volume)
    assert not [r for r in caplog.records if "not on the input grid" in r.getMessage()], "Invertd's result was moved"
    assert label_map.shape == volume.array.shape
    assert label_map.dtype == np.uint16
    assert label_map.flags.c_contiguous  # slices contiguous: what the SEG and NIfTI writers read fast
    assert label_map.max() <= labels
    # Loaded once, reused: a second call on another volume works with the same objects.
    other, _ = phantom_volume(shape=(20, 40, 44), seed=2)
    assert predictor.predict(other).shape == other.array.shape


def _spleen_variant(zoo_bundle, tmp_path, edit) -> Path:
    """The spleen zoo bundle (its random weights too) with its inference.json edited by `edit(config)`."""
    bundle = tmp_path / "variant"
    shutil.copytree(zoo_bundle("spleen_ct_segmentation"), bundle)
    config_path = bundle / "configs" / "inference.json"
    config = json.loads(config_path.read_text())
    edit(config)
    config_path.write_text(json.dumps(config))
    return bundle


def _preprocessing_by_reference(config: dict) -> None:
    config["pre"] = config.pop("preprocessing")
    config["preprocessing"] = "@pre"
    for step in config["postprocessing"]["transforms"]:
        if step.get("_target_") == "Invertd":
            step["transform"] = "@pre"


def _image_key_by_expression(config: dict) -> None:
    config["image_key"] = "$monai.utils.CommonKeys.IMAGE"


def _inferer_showing_progress(config: dict) -> None:
    config["inferer"]["progress"] = True


@pytest.mark.parametrize("edit", [_preprocessing_by_reference, _image_key_by_expression, _inferer_showing_progress],
                         ids=["preprocessing by reference", "image_key by expression", "inferer with progress"])
def test_config_spellings_monai_resolves_give_the_same_labels(zoo_bundle, tmp_path, edit):
    """The first two were refused ("'preprocessing' must be a Compose", KeyError 'image' in EnsureChannelFirstd),
    though MONAI's parser resolves both; the sliding window's progress bar needs tqdm, which MONAI does not
    install."""
    volume, _ = phantom_volume(shape=(24, 40, 40), seed=3)
    expected = BundlePredictor.from_dir(zoo_bundle("spleen_ct_segmentation"), device="cpu").predict(volume)
    variant = BundlePredictor.from_dir(_spleen_variant(zoo_bundle, tmp_path, edit), device="cpu")
    assert np.array_equal(variant.predict(volume), expected)


def test_a_network_that_cannot_be_built_is_refused_with_the_underlying_error(zoo_bundle, tmp_path):
    """MONAI's wrapper ("Failed to evaluate ConfigExpression: ...") hid torch's own reason."""
    def missing_file(config: dict) -> None:
        config["network_def"]["channels"] = "$torch.load('/nonexistent/search_code.pt')"

    with pytest.raises(BundleError,
                       match=r"cannot build network_def \(FileNotFoundError: .*/nonexistent/search_code.pt"):
        BundlePredictor.from_dir(_spleen_variant(zoo_bundle, tmp_path, missing_file), device="cpu")


@pytest.mark.parametrize("name", zoo_bundle_params(MODEL_ZOO))
def test_the_chosen_device_reaches_the_zoo_bundles_inferer(zoo_bundle, name, monkeypatch):
    """On a GPU host, --device cpu keeps all of a bundle on the CPU, also an inferer whose config picks a GPU
    itself (wholeBody_ct_segmentation's sliding window would stitch its 105-channel output on cuda:0)."""
    if name is None:
        pytest.fail(f"{MODEL_ZOO} holds no bundle folders")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU host; nothing here runs on it
    predictor = BundlePredictor.from_dir(zoo_bundle(name), device="cpu")
    assert {p.device.type for p in predictor.network.parameters()} == {"cpu"}
    for key in ("device", "sw_device"):
        value = getattr(predictor.inferer, key, None)
        assert value is None or torch.device(value).type == "cpu", (key, value)


@pytest.mark.parametrize("orientation", ["axial", "sagittal", "coronal", "oblique", "feet_first_flipped"])
@pytest.mark.parametrize("axcodes", ["RAS", "LPS"])
def test_prediction_lands_on_the_source_voxels_for_any_orientation(tmp_path, orientation, axcodes, caplog):
    """The thresholding bundle resamples to 2 mm in its own axis order and back: its label map must be the
    threshold of the source voxels. A flip or transpose anywhere in the chain would break the overlap."""
    bundle = make_threshold_bundle(tmp_path / "threshold", pixdim=(2.0, 2.0, 2.0), axcodes=axcodes)
    predictor = BundlePredictor.from_dir(bundle, device="cpu")
    volume, _ = phantom_volume(spacing=(3.0, 1.5, 1.75), orientation=ORIENTATIONS[orientation], bone=False)
    with caplog.at_level(logging.INFO, logger="medserve.bundle"):
        label_map = predictor.predict(volume)
    assert dice(label_map, volume.array > THRESHOLD_HU) > 0.93
    assert not [r for r in caplog.records if "not on the input grid" in r.getMessage()], "Invertd's result was moved"


def _without_invertd(bundle: Path) -> Path:
    config_path = bundle / "configs" / "inference.json"
    config = json.loads(config_path.read_text())
    steps = config["postprocessing"]["transforms"]
    config["postprocessing"]["transforms"] = [step for step in steps if step["_target_"] != "Invertd"]
    config_path.write_text(json.dumps(config))
    return bundle


@pytest.mark.parametrize("orientation", ["axial", "sagittal", "coronal", "feet_first_flipped"])
@pytest.mark.parametrize("axcodes", ["RAS", "PLI"])
def test_without_invertd_a_reoriented_prediction_is_put_back_exactly(tmp_path, orientation, axcodes, caplog):
    """A bundle without Invertd leaves its prediction in its own orientation, as SaveImaged would write it: on an
    LPS axial series, RAS keeps the shape and mirrors rows and columns. At the volume's own spacing nothing is
    resampled, so the label map must be the threshold of the source voxels exactly."""
    bundle = _without_invertd(make_threshold_bundle(tmp_path / "b", pixdim=(2.0, 2.0, 2.0), axcodes=axcodes))
    predictor = BundlePredictor.from_dir(bundle, device="cpu")
    volume, _ = phantom_volume(spacing=(2.0, 2.0, 2.0), orientation=ORIENTATIONS[orientation], bone=False)
    with caplog.at_level(logging.INFO, logger="medserve.bundle"):
        label_map = predictor.predict(volume)
    np.testing.assert_array_equal(label_map, volume.array > THRESHOLD_HU)
    moved = [r for r in caplog.records if "not on the input grid" in r.getMessage()]
    assert bool(moved) == (orientation != "axial" or axcodes != "LPS")  # an LPS bundle on an LPS series: no move


def test_without_invertd_a_resampled_prediction_is_resampled_back(tmp_path):
    """At another spacing the prediction has another shape: it is resampled onto the input grid (nearest), not
    refused and not mirrored."""
    bundle = _without_invertd(make_threshold_bundle(tmp_path / "b", pixdim=(3.0, 3.0, 3.5)))
    volume, _ = phantom_volume(spacing=(2.5, 2.0, 2.0), bone=False)
    label_map = BundlePredictor.from_dir(bundle, device="cpu").predict(volume)
    truth = volume.array > THRESHOLD_HU
    assert label_map.shape == truth.shape
    # Nearest neighbour from 3 mm labels: Invertd, which resamples class scores, reaches 0.94 on this small organ.
    assert dice(label_map, truth) > 0.85
    assert dice(label_map, truth[:, ::-1, ::-1]) < 0.5


def test_any_array_layout_gives_the_same_label_map(threshold_bundle, monkeypatch):
    """Volumes arrive read-only, flipped (negative strides, as a multi-frame source's) or as float64: torch cannot
    wrap those; the prediction must not depend on it."""
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    from_numpy = torch.from_numpy

    def wrap_writable_only(array):
        assert array.flags.writeable, "torch was handed a read-only array"
        return from_numpy(array)

    monkeypatch.setattr(torch, "from_numpy", wrap_writable_only)
    volume, _ = phantom_volume(bone=False)
    expected = predictor.predict(volume)
    flipped = np.ascontiguousarray(volume.array[::-1])[::-1]  # same values, negative slice stride
    read_only = volume.array.copy()
    read_only.flags.writeable = False
    for array in (flipped, read_only, volume.array.astype(np.float64)):
        np.testing.assert_array_equal(predictor.predict(volume.with_array(array)), expected)


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


def sigmoid_bundle(root, channel_def, masks):
    """A threshold bundle turned into a sigmoid (multi-label) one: channel i is the binary mask of HU above (">")
    or below ("<") a threshold, masks[i] = (comparison, HU), named by `channel_def` (no background)."""
    def edit(config):
        config["network_def"]["out_channels"] = len(masks)
        config["postprocessing"]["transforms"] = [
            {"_target_": "Activationsd", "keys": "pred", "sigmoid": True},
            {"_target_": "Invertd", "keys": "pred", "transform": "@preprocessing", "orig_keys": "image",
             "nearest_interp": False},
            {"_target_": "AsDiscreted", "keys": "pred", "threshold": 0.5},
        ]
    signs = torch.tensor([1.0 if comparison == ">" else -1.0 for comparison, _ in masks])
    thresholds = torch.tensor([hu / 1000.0 for _, hu in masks])  # in the preprocessing's scaled intensities
    network = torch.nn.Conv3d(1, len(masks), 1)
    with torch.no_grad():  # steep logits, as in the threshold bundle
        network.weight.copy_((signs * 100.0).reshape(-1, 1, 1, 1, 1))
        network.bias.copy_(-signs * 100.0 * thresholds)
    bundle = edited_bundle(root, edit, weights=network)
    metadata = json.loads((bundle / "configs" / "metadata.json").read_text())
    metadata["network_data_format"]["outputs"]["pred"]["channel_def"] = channel_def
    (bundle / "configs" / "metadata.json").write_text(json.dumps(metadata))
    return bundle


def test_multi_label_channels_become_labels_one_up_keeping_channel_zero_and_its_name(tmp_path):
    bundle = sigmoid_bundle(tmp_path / "sigmoid", {"0": "air", "1": "organ"}, [("<", -500.0), (">", THRESHOLD_HU)])
    volume, _ = phantom_volume()
    predictor = BundlePredictor.from_dir(bundle, device="cpu")
    label_map = predictor.predict(volume)
    assert predictor.labels == {1: "air", 2: "organ"}
    assert dice(label_map == 1, volume.array < -500) > 0.95
    assert dice(label_map == 2, volume.array > THRESHOLD_HU) > 0.9


def test_single_channel_mask_is_named_by_its_channel(tmp_path):
    bundle = sigmoid_bundle(tmp_path / "one_mask", {"0": "organ"}, [(">", THRESHOLD_HU)])
    volume, _ = phantom_volume()
    predictor = BundlePredictor.from_dir(bundle, device="cpu")
    label_map = predictor.predict(volume)
    assert predictor.labels == {1: "organ"}
    assert dice(label_map == 1, volume.array > THRESHOLD_HU) > 0.9


@pytest.mark.parametrize("channel_zero", ["other", "normal tissue", "unlabeled", "backgroud"])
def test_a_softmax_bundle_keeps_class_indices_whatever_its_channel_zero_is_called(tmp_path, threshold_bundle,
                                                                                   channel_zero):
    bundle = tmp_path / "softmax"
    shutil.copytree(threshold_bundle, bundle)
    metadata = json.loads((bundle / "configs" / "metadata.json").read_text())
    metadata["network_data_format"]["outputs"]["pred"]["channel_def"] = {"0": channel_zero, "1": "organ"}
    (bundle / "configs" / "metadata.json").write_text(json.dumps(metadata))
    predictor = BundlePredictor.from_dir(bundle, device="cpu")
    volume, _ = phantom_volume()
    assert predictor.labels == {1: "organ"}
    assert dice(predictor.predict(volume), volume.array > THRESHOLD_HU) > 0.9


def test_overlapping_masks_are_refused_naming_the_channels(tmp_path):
    bundle = sigmoid_bundle(tmp_path / "overlap", {"0": "whole", "1": "core"}, [(">", 0.0), (">", THRESHOLD_HU)])
    with pytest.raises(InferenceError, match=r"^bundle overlap: its multi-label output 'pred' \(2 channels\) has "
                                             r"channels that overlap: \d+ voxels are in more than one mask \(first: "
                                             r"channels 0 \('whole'\) and 1 \('core'\)\); medserve writes one label"):
        BundlePredictor.from_dir(bundle, device="cpu").predict(phantom_volume()[0])


@pytest.mark.parametrize(("channel_def", "masks"), [
    ({"0": "air", "1": "organ"}, [("<", -500.0), (">", THRESHOLD_HU)]),
    ({"0": "organ"}, [(">", THRESHOLD_HU)]),  # one sigmoid mask is not rounded at 0.5 either
])
def test_unthresholded_multi_label_output_is_refused(tmp_path, channel_def, masks):
    bundle = sigmoid_bundle(tmp_path / "probabilities", channel_def, masks)
    config = json.loads((bundle / "configs" / "inference.json").read_text())
    config["postprocessing"]["transforms"].pop()  # the threshold
    (bundle / "configs" / "inference.json").write_text(json.dumps(config))
    with pytest.raises(InferenceError, match=rf"'pred' \({len(masks)} channels\) holds values other than 0 and 1; "
                                             r"expected binary masks"):
        BundlePredictor.from_dir(bundle, device="cpu").predict(phantom_volume()[0])


@pytest.mark.parametrize("postprocessing_key", ["pred", "seg"])
def test_an_output_named_otherwise_in_the_metadata_reaches_the_postprocessing(tmp_path, threshold_bundle,
                                                                             postprocessing_key):
    """MONAI's evaluator puts the network output under "pred" whatever the metadata calls it, and bundles'
    postprocessing reads it there; one whose postprocessing reads the metadata's name instead finds it there."""
    bundle = tmp_path / "seg_output"
    shutil.copytree(threshold_bundle, bundle)
    metadata = json.loads((bundle / "configs" / "metadata.json").read_text())
    metadata["network_data_format"]["outputs"] = {"seg": {"channel_def": {"0": "background", "1": "organ"}}}
    (bundle / "configs" / "metadata.json").write_text(json.dumps(metadata))
    config = json.loads((bundle / "configs" / "inference.json").read_text())
    for step in config["postprocessing"]["transforms"]:
        step["keys"] = postprocessing_key
    (bundle / "configs" / "inference.json").write_text(json.dumps(config))
    predictor = BundlePredictor.from_dir(bundle, device="cpu")
    volume, _ = phantom_volume()
    assert dice(predictor.predict(volume), volume.array > THRESHOLD_HU) > 0.9
    assert predictor.labels == {1: "organ"}


@pytest.mark.parametrize("network_def", [True, False], ids=["with-network-def", "without-network-def"])
def test_torchscript_weights_load(tmp_path, threshold_bundle, network_def):
    bundle = tmp_path / "ts"
    shutil.copytree(threshold_bundle, bundle)
    network = torch.nn.Conv3d(1, 2, 1)
    network.load_state_dict(torch.load(bundle / "models" / "model.pt"))
    torch.jit.script(network).save(str(bundle / "models" / "model.ts"))
    (bundle / "models" / "model.pt").unlink()
    if not network_def:  # TorchScript holds its network
        config = json.loads((bundle / "configs" / "inference.json").read_text())
        del config["network_def"]
        (bundle / "configs" / "inference.json").write_text(json.dumps(config))
    volume, _ = phantom_volume()
    label_map = BundlePredictor.from_dir(bundle, device="cpu").predict(volume)
    assert dice(label_map, volume.array > THRESHOLD_HU) > 0.93


def test_torchscript_saved_as_model_pt_is_refused_saying_to_rename_it(tmp_path, threshold_bundle):
    bundle = tmp_path / "ts_as_pt"
    shutil.copytree(threshold_bundle, bundle)
    network = torch.nn.Conv3d(1, 2, 1)
    torch.jit.script(network).save(str(bundle / "models" / "model.pt"))
    with pytest.raises(BundleError, match=r"models/model.pt: a TorchScript model, where model.pt holds a state dict; "
                                          r"rename it to models/model.ts$"):
        BundlePredictor.from_dir(bundle, device="cpu")


@pytest.mark.parametrize("declared,message", [
    ({"num_channels": 4, "spatial_shape": [128, 128, 128]},
     r"num_channels is 4; medserve feeds a bundle one series, a single-channel image"),
    ({"num_channels": "4"}, r'num_channels is "4"; expected a whole number \(1: medserve feeds a bundle one series'),
    ({"num_channels": 4.0}, r"num_channels is 4; medserve feeds a bundle one series"),  # 1.0 is as good as 1
    ({"num_channels": 1.5}, r"num_channels is 1.5; expected a whole number"),
    ({"num_channels": 1, "spatial_shape": [512, 512]}, r"spatial_shape \[512, 512\] is 2D; medserve feeds a bundle a "
                                                       r"3D volume"),
], ids=["four-channels", "a-string", "a-whole-float", "a-fraction", "2d"])
def test_an_input_other_than_one_3d_image_is_refused_when_loading(tmp_path, threshold_bundle, declared, message):
    bundle = tmp_path / "other_input"
    shutil.copytree(threshold_bundle, bundle)
    metadata = json.loads((bundle / "configs" / "metadata.json").read_text())
    metadata["network_data_format"]["inputs"] = {"image": {"type": "image", **declared}}
    (bundle / "configs" / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(BundleError, match=r"^bundle other_input: metadata.json network_data_format.inputs " + message):
        BundlePredictor.from_dir(bundle, device="cpu")


def test_yaml_config_is_found(tmp_path, threshold_bundle):
    import yaml

    bundle = tmp_path / "yml"
    shutil.copytree(threshold_bundle, bundle)
    config = json.loads((bundle / "configs" / "inference.json").read_text())
    (bundle / "configs" / "inference.json").unlink()
    (bundle / "configs" / "inference.yml").write_text(yaml.safe_dump(config))
    assert BundlePredictor.from_dir(bundle, device="cpu").layout.config_path.name == "inference.yml"


# The layout of the zoo's segmentation_template config: constants from MONAI, the transforms defined at the top level
# and referenced from the Compose, a dataset/evaluator/run section that an in-memory run never builds.
_TEMPLATE_STYLE_CONFIG = """
imports:
- $import os
- $import glob
image: $monai.utils.CommonKeys.IMAGE
pred: $monai.utils.CommonKeys.PRED
device: $torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')
bundle_root: .
dataset_dir: $@bundle_root + '/test_data'
network_def: {_target_: torch.nn.Conv3d, in_channels: 1, out_channels: 2, kernel_size: 1}
network: $@network_def.to(@device)
data_dicts: '$[{@image: i} for i in sorted(glob.glob(os.path.join(@dataset_dir, "*.nii*")))]'
transforms:
- {_target_: LoadImaged, keys: '@image', image_only: true}
- {_target_: EnsureChannelFirstd, keys: '@image'}
- {_target_: ScaleIntensityRanged, keys: '@image', a_min: -1000, a_max: 1000, b_min: -1.0, b_max: 1.0, clip: true}
preprocessing: {_target_: Compose, transforms: $@transforms}
dataset: {_target_: Dataset, data: '@data_dicts', transform: '@preprocessing'}
inferer: {_target_: SimpleInferer}
postprocessing:
  _target_: Compose
  transforms:
  - {_target_: Activationsd, keys: '@pred', softmax: true}
  - {_target_: AsDiscreted, keys: '@pred', argmax: true}
  - {_target_: SaveImaged, keys: '@pred', output_dir: ./outputs, output_postfix: '', separate_folder: true}
evaluator: {_target_: SupervisedEvaluator, device: '@device', val_data_loader: '@dataset', network: '@network',
            inferer: '@inferer', postprocessing: '@postprocessing'}
run: [$@evaluator.run()]
"""


def test_a_template_style_yaml_config_with_referenced_transforms_runs(tmp_path, threshold_bundle):
    bundle = tmp_path / "template"
    shutil.copytree(threshold_bundle, bundle)
    (bundle / "configs" / "inference.json").unlink()
    (bundle / "configs" / "inference.yaml").write_text(_TEMPLATE_STYLE_CONFIG)
    volume, _ = phantom_volume()
    label_map = BundlePredictor.from_dir(bundle, device="cpu").predict(volume)
    assert dice(label_map, volume.array > THRESHOLD_HU) > 0.95  # no spacing: the threshold holds voxel by voxel


def test_file_transforms_named_by_reference_in_the_list_are_removed_too(tmp_path, threshold_bundle):
    """Items such as "@load_image" in a transforms list, defined elsewhere in the config: a LoadImaged left in
    would fail on the in-memory volume, a SaveImaged left in would write into its output_dir (inside the bundle, in
    a MAP a read-only folder)."""
    bundle = tmp_path / "referenced"
    shutil.copytree(threshold_bundle, bundle)
    config = json.loads((bundle / "configs" / "inference.json").read_text())
    preprocessing, postprocessing = config["preprocessing"]["transforms"], config["postprocessing"]["transforms"]
    config["load_image"], preprocessing[0] = preprocessing[0], "@load_image"
    config["save_image"] = {**postprocessing[-1], "output_dir": str(tmp_path / "saved")}
    config["saving"], postprocessing[-1] = "$@save_image", "@saving"  # a reference to a reference
    (bundle / "configs" / "inference.json").write_text(json.dumps(config))
    volume, _ = phantom_volume(bone=False)
    label_map = BundlePredictor.from_dir(bundle, device="cpu").predict(volume)
    assert dice(label_map, volume.array > THRESHOLD_HU) > 0.93
    assert not (tmp_path / "saved").exists()


def test_file_transforms_inside_a_nested_compose_are_removed_too(tmp_path, threshold_bundle):
    """A SaveImaged in a Compose within the postprocessing wrote into the bundle folder, and stayed there; a
    LoadImaged within one failed on the in-memory volume ("expected str ... not MetaTensor")."""
    bundle = tmp_path / "nested"
    shutil.copytree(threshold_bundle, bundle)
    config = json.loads((bundle / "configs" / "inference.json").read_text())
    preprocessing, postprocessing = config["preprocessing"]["transforms"], config["postprocessing"]["transforms"]
    preprocessing[:2] = [{"_target_": "Compose", "transforms": preprocessing[:2]}]  # LoadImaged, EnsureChannelFirstd
    saver = {**postprocessing[-1], "output_dir": str(tmp_path / "saved")}
    config["saving"] = {"_target_": "Compose", "transforms": [saver]}
    postprocessing[-1] = "@saving"
    (bundle / "configs" / "inference.json").write_text(json.dumps(config))
    volume, _ = phantom_volume(bone=False)
    predictor = BundlePredictor.from_dir(bundle, device="cpu")
    assert predictor._expects_channel_first  # EnsureChannelFirstd is found inside the Compose too
    assert dice(predictor.predict(volume), volume.array > THRESHOLD_HU) > 0.93
    assert not (tmp_path / "saved").exists()


_BUNDLE_NETWORK = """
import torch


class Network(torch.nn.Conv3d):
    \"\"\"The threshold bundle's 1x1x1 convolution, with its classes {order}.\"\"\"

    def __init__(self):
        super().__init__(1, 2, 1)

    def forward(self, x):
        return super().forward(x){flip}
"""


def bundle_with_scripts(root: Path, threshold_bundle: Path, flipped: bool) -> Path:
    """The threshold bundle with its network in its own `scripts` package, as zoo bundles ship code; `flipped`
    swaps the classes, so which package a bundle ran is visible in its label map."""
    shutil.copytree(threshold_bundle, root)
    (root / "scripts").mkdir()
    (root / "scripts" / "__init__.py").write_text("")
    (root / "scripts" / "net.py").write_text(_BUNDLE_NETWORK.format(
        order="swapped" if flipped else "as trained", flip=".flip(1)" if flipped else ""))
    config = json.loads((root / "configs" / "inference.json").read_text())
    config["imports"] = ["$import scripts"]
    config["network_def"] = {"_target_": "scripts.net.Network"}
    (root / "configs" / "inference.json").write_text(json.dumps(config))
    return root


def test_a_bundle_package_named_like_an_installed_one_does_not_replace_it(tmp_path, threshold_bundle, caplog):
    """A `torch/` (or `monai/`) folder in a bundle took the process's torch out of sys.modules while the bundle
    loaded: a confusing failure, and in the server every other thread's torch gone meanwhile."""
    import sys

    bundle = bundle_with_scripts(tmp_path / "shadowing", threshold_bundle, flipped=False)
    (bundle / "torch").mkdir()
    (bundle / "torch" / "__init__.py").write_text("raise ImportError('the bundle folder torch was imported')\n")
    torch_before = sys.modules["torch"]
    with caplog.at_level(logging.WARNING, logger="medserve.bundle"):
        predictor = BundlePredictor.from_dir(bundle, device="cpu")
    assert sys.modules["torch"] is torch_before and "scripts" not in sys.modules
    assert any("its top-level modules torch have the names of installed packages" in m for m in caplog.messages)
    volume, _ = phantom_volume(bone=False)
    assert dice(predictor.predict(volume), volume.array > THRESHOLD_HU) > 0.93


def test_bundles_with_their_own_scripts_package_load_side_by_side(tmp_path, threshold_bundle):
    import sys

    plain = bundle_with_scripts(tmp_path / "plain", threshold_bundle, flipped=False)
    flipped = bundle_with_scripts(tmp_path / "flipped", threshold_bundle, flipped=True)
    path_before = list(sys.path)
    first = BundlePredictor.from_dir(plain, device="cpu")
    second = BundlePredictor.from_dir(flipped, device="cpu")
    assert sys.path == path_before
    assert "scripts" not in sys.modules  # the next bundle's `scripts` must not find this one's
    volume, _ = phantom_volume()
    organ = volume.array > THRESHOLD_HU
    assert dice(first.predict(volume), organ) > 0.9
    assert dice(second.predict(volume), ~organ) > 0.9


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


@pytest.mark.parametrize(("text", "found"), [("[1, 2]", r"a list \(\[1, 2\]\)"), ("null", "null")])
def test_a_config_that_is_not_a_mapping_is_refused_saying_what_it_is(tmp_path, threshold_bundle, text, found):
    """It was "cannot read config (AttributeError: 'list' object has no attribute 'items')"."""
    bundle = tmp_path / "listed"
    shutil.copytree(threshold_bundle, bundle)
    (bundle / "configs" / "inference.json").write_text(text)
    with pytest.raises(BundleError, match=rf"inference.json: the config is {found}; expected a mapping of ids "
                                          r"\(network_def, preprocessing, inferer, postprocessing, ...\)$"):
        BundlePredictor.from_dir(bundle, device="cpu")


@pytest.mark.parametrize(("network_def", "found"), [
    ([1, 2], r"a list \(\[1, 2\]\)"), ("UNet", r"a str \('UNet'\)"), ("$1", r"an int \(1\)"),
    ({"_target_": "monai.transforms.Identity"}, r"an Identity \(<monai.transforms.*\)"),
], ids=["list", "string", "expression", "transform"])
def test_a_network_def_that_builds_no_network_is_refused_saying_what_it_built(tmp_path, threshold_bundle,
                                                                             network_def, found):
    """It was an internal error (exit 1): "'list' object has no attribute 'load_state_dict'"."""
    bundle = edited_bundle(tmp_path / "notanet", lambda config: config.update(network_def=network_def))
    with pytest.raises(BundleError, match=rf"inference.json: network_def builds {found}; expected a "
                                          r"torch.nn.Module \(a `_target_` naming a network class"):
        BundlePredictor.from_dir(bundle, device="cpu")


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


def _whole_model(path: Path) -> None:
    torch.save(torch.nn.Conv3d(1, 2, 1), path)


def _cut_archive(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:200])


@pytest.mark.parametrize(("damage", "message"), [
    (lambda path: path.write_bytes(b"not a checkpoint"),
     r"not a PyTorch weights file \(neither the zip archive torch.save writes nor a pickle\)$"),  # was "(110)"
    # torch's own text advised unpickling unsafely, with terminal escape codes, cut off
    (_whole_model, r"holds a pickled torch.nn.modules.conv.Conv3d object, which medserve does not unpickle "
                   r"\(unpickling can run any code\); expected a state dict, saved with "
                   r"torch.save\(model.state_dict\(\), path\)$"),
    (_cut_archive, r"not a readable PyTorch weights file \(RuntimeError: .*\)$"),
], ids=["not-torch", "a-pickled-model", "cut"])
def test_weights_file_that_is_not_a_state_dict_is_refused_saying_what_it_is(tmp_path, threshold_bundle, damage,
                                                                            message):
    bundle = tmp_path / "garbage"
    shutil.copytree(threshold_bundle, bundle)
    damage(bundle / "models" / "model.pt")
    with pytest.raises(BundleError, match=r"model.pt: " + message) as caught:
        BundlePredictor.from_dir(bundle)
    assert "\n" not in str(caught.value) and "\x1b" not in str(caught.value)


def test_weights_that_cannot_be_read_are_a_user_error(tmp_path, threshold_bundle):
    """Explaining torch's refusal opened the file again, and an unreadable one raised PermissionError: exit 1."""
    bundle = tmp_path / "unreadable"
    shutil.copytree(threshold_bundle, bundle)
    (bundle / "models" / "model.pt").chmod(0)
    code = ("import sys; from medserve.bundle import BundlePredictor; from medserve.errors import BundleError\n"
            "try:\n    BundlePredictor.from_dir(sys.argv[1], device='cpu')\n"
            "except BundleError as error:\n    print(error)")
    shown = run_unprivileged(code, bundle)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.strip().endswith("models/model.pt: cannot be read (Permission denied)"), shown.stdout


def test_missing_metadata_is_refused(tmp_path, threshold_bundle):
    bundle = tmp_path / "nometa"
    shutil.copytree(threshold_bundle, bundle)
    (bundle / "configs" / "metadata.json").unlink()
    with pytest.raises(BundleError, match="configs/metadata.json is missing"):
        BundlePredictor.from_dir(bundle)


@pytest.mark.parametrize(("data_format", "field", "found"), [
    (None, "network_data_format", "null"),
    ({"inputs": [1]}, "network_data_format.inputs", "a JSON array"),
    ({"outputs": {"pred": None}}, "network_data_format.outputs.pred", "null"),
    ({"outputs": {"pred": {"channel_def": "liver"}}}, "network_data_format.outputs.pred.channel_def",
     "a JSON string"),
])
def test_metadata_whose_data_format_is_not_made_of_objects_is_refused_naming_the_field(
        tmp_path, threshold_bundle, data_format, field, found):
    bundle = tmp_path / "badmeta"
    shutil.copytree(threshold_bundle, bundle)
    metadata_path = bundle / "configs" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["network_data_format"] = data_format
    metadata_path.write_text(json.dumps(metadata))
    with pytest.raises(BundleError, match=rf"^{re.escape(str(metadata_path))}: {re.escape(field)} is {found}; "
                                          r"expected a JSON object$"):
        BundlePredictor.from_dir(bundle, device="cpu")


@pytest.mark.parametrize(("name", "found"), [("", "blank"), ("  ", "blank"), (None, "null"),
                                           (["liver", "organ"], "a JSON array"),
                                           ("\ud800", r"holds '\\ud800', a lone surrogate; expected text$")])
def test_an_output_channel_without_a_name_is_refused_naming_the_channel(tmp_path, threshold_bundle, name, found):
    """Segment labels are made of these names: a blank one would make an invalid SEG (SegmentLabel is Type 1)."""
    bundle = tmp_path / "unnamed"
    shutil.copytree(threshold_bundle, bundle)
    metadata_path = bundle / "configs" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["network_data_format"]["outputs"]["pred"]["channel_def"] = {"0": "background", "1": name}
    metadata_path.write_text(json.dumps(metadata))
    expected = found if "surrogate" in found else rf"is {found}; expected the name of what the channel"
    with pytest.raises(BundleError, match=rf'^{re.escape(str(metadata_path))}: network_data_format.outputs.pred.'
                                          rf'channel_def\["1"\] {expected}'):
        BundlePredictor.from_dir(bundle, device="cpu")


@pytest.mark.parametrize("key", ["70000", "background", "-1", "1.0", "01", "\u0661"])
def test_an_output_channel_whose_key_is_not_a_channel_number_is_refused_naming_it(tmp_path, threshold_bundle, key):
    """"70000" stopped the run after the inference with an internal error from highdicom (exit 1); names, "-1" and
    "1.0" were dropped without a word (a segment called "label 1"), "01" overwrote or was overwritten by "1"."""
    bundle = tmp_path / "keys"
    shutil.copytree(threshold_bundle, bundle)
    metadata_path = bundle / "configs" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["network_data_format"]["outputs"]["pred"]["channel_def"] = {"0": "background", key: "spleen"}
    metadata_path.write_text(json.dumps(metadata))
    with pytest.raises(BundleError, match=rf'^{re.escape(str(metadata_path))}: network_data_format.outputs.pred.'
                                          rf'channel_def\[{re.escape(json.dumps(key))}\]: the key is not a channel '
                                          r'number; expected a whole number 0..65535 written without leading zeros$'):
        BundlePredictor.from_dir(bundle, device="cpu")


def test_the_last_channel_of_a_multi_label_output_must_leave_room_for_its_label(tmp_path, threshold_bundle):
    """Channel i of a multi-label output is label i + 1: channel 65535 would be 65536, which no label map holds."""
    from medserve.bundle.layout import BundleLayout

    bundle = tmp_path / "wide"
    shutil.copytree(threshold_bundle, bundle)
    metadata_path = bundle / "configs" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["network_data_format"]["outputs"]["pred"]["channel_def"] = {"0": "liver", "65535": "spleen"}
    metadata_path.write_text(json.dumps(metadata))
    layout = BundleLayout.find(bundle)
    assert layout.labels() == {65535: "spleen"}
    with pytest.raises(BundleError, match=r"metadata.json: channel 65535 of the multi-label output 'pred' would be "
                                          r"label 65536; labels go up to 65535$"):
        layout.labels(multi_label=True)


def test_label_names_come_from_pred_when_the_metadata_lists_another_output_first(tmp_path, threshold_bundle):
    """The first listed output's channel_def named the segments: an auxiliary output before `pred` took them."""
    bundle = tmp_path / "aux"
    shutil.copytree(threshold_bundle, bundle)
    metadata_path = bundle / "configs" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    outputs = metadata["network_data_format"]["outputs"]
    metadata["network_data_format"]["outputs"] = {"aux": {"type": "image", "channel_def": {"0": "x"}}, **outputs}
    metadata_path.write_text(json.dumps(metadata))
    predictor = BundlePredictor.from_dir(bundle, device="cpu")
    assert predictor.output_key == "pred"
    assert predictor.labels == BundlePredictor.from_dir(threshold_bundle, device="cpu").labels != {}


def test_a_bundle_given_as_the_working_directory_is_named_by_its_folder(threshold_bundle, monkeypatch):
    monkeypatch.chdir(threshold_bundle)
    assert BundlePredictor.from_dir(".", device="cpu").name == threshold_bundle.name


# ---- device: refused when the predictor is created, naming what was asked for and what exists ----------------

@pytest.mark.parametrize("device", ["foo", "cuda:x", "", "CPU"])
def test_device_that_is_not_a_torch_device_is_refused(threshold_bundle, device):
    with pytest.raises(BundleError, match=rf"^device '{device}' is not a torch device name \(e.g. cpu, cuda, "
                                          rf"cuda:0\); available here: cpu"):
        BundlePredictor.from_dir(threshold_bundle, device=device)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "meta", "xla"])
def test_device_this_machine_lacks_is_refused(monkeypatch, threshold_bundle, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BundleError, match=rf"^device '{device}' is not available on this machine; "
                                          rf"available here: cpu$"):
        BundlePredictor.from_dir(threshold_bundle, device=device)


def test_gpu_index_beyond_the_gpus_present_is_refused_listing_them(monkeypatch, threshold_bundle):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(BundleError, match=r"^device 'cuda:3' is not available on this machine; available here: "
                                          r"cpu, cuda:0, cuda:1$"):
        BundlePredictor.from_dir(threshold_bundle, device="cuda:3")


def test_cpu_device_is_accepted_as_name_and_object(threshold_bundle):
    assert BundlePredictor.from_dir(threshold_bundle, device="cpu").device == torch.device("cpu")
    assert BundlePredictor.from_dir(threshold_bundle, device=torch.device("cpu")).device == torch.device("cpu")


def test_app_reports_a_bad_device_as_one_error_line(tmp_path, threshold_bundle):
    (tmp_path / "in").mkdir()
    completed = run_app("-i", tmp_path / "in", "-o", tmp_path / "out", "-m", threshold_bundle, "--device", "foo")
    assert completed.returncode == 2, completed.stderr
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: device 'foo' is not a torch device name (e.g. cpu, cuda, cuda:0); available here: "
                      f"{', '.join(['cpu'] + [f'cuda:{i}' for i in range(torch.cuda.device_count())])}"]
    assert "Traceback" not in completed.stderr


# ---- failures of the bundle's own components while predicting ------------------------------------------------

def edited_bundle(root, edit, weights=None):
    """A threshold bundle whose inference config is changed by `edit(config)` (and its weights replaced)."""
    bundle = make_threshold_bundle(root)
    config = json.loads((bundle / "configs" / "inference.json").read_text())
    edit(config)
    (bundle / "configs" / "inference.json").write_text(json.dumps(config))
    if weights is not None:
        torch.save(weights.state_dict(), bundle / "models" / "model.pt")
    return bundle


def test_network_that_expects_other_channels_fails_naming_bundle_stage_shape_and_cause(tmp_path):
    bundle = edited_bundle(tmp_path / "four_channels", lambda c: c["network_def"].update(in_channels=4),
                           weights=torch.nn.Conv3d(4, 2, 1))
    predictor = BundlePredictor.from_dir(bundle, device="cpu")
    volume, _ = phantom_volume()
    with pytest.raises(InferenceError) as raised:
        predictor.predict(volume)
    assert not isinstance(raised.value, InferenceOutOfMemory)
    message = str(raised.value)
    assert re.fullmatch(r"bundle four_channels: network/inferer \(SlidingWindowInferer\) failed on the input volume "
                        r"of shape \(24, 48, 48\) \(slice, row, column\): RuntimeError: .*expected input\[.*\] to "
                        r"have 4 channels, but got 1 channels instead", message), message
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_preprocessing_failure_names_the_transform_and_the_original_error(tmp_path):
    bundle = edited_bundle(tmp_path / "needs_label", lambda c: c["preprocessing"]["transforms"].append(
        {"_target_": "ScaleIntensityd", "keys": "label"}))
    volume, _ = phantom_volume()
    with pytest.raises(BundleError, match=r"^bundle needs_label: preprocessing failed on the input volume of shape "
                                          r"\(24, 48, 48\) \(slice, row, column\): in ScaleIntensityd: KeyError: "
                                          r"Key `label` of transform `ScaleIntensityd` was missing") as raised:
        BundlePredictor.from_dir(bundle, device="cpu").predict(volume)
    assert raised.value.__cause__ is not None
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("raised", ["SystemExit(3)", "GeneratorExit()"])
def test_a_bundle_transform_that_exits_is_a_failure_of_the_bundle(tmp_path, raised):
    """`exit(3)` in a Lambdad ended the app with Holoscan's traceback, exit 3, and its output folder left."""
    throw = {"_target_": "Lambdad", "keys": "image", "func": f"$lambda x: (_ for _ in ()).throw({raised})"}
    bundle = edited_bundle(tmp_path / "exits", lambda c: c["preprocessing"]["transforms"].append(throw))
    with pytest.raises(InferenceError, match=rf"^bundle exits: preprocessing failed on the input volume of shape "
                                             rf"\(24, 48, 48\) \(slice, row, column\): {raised.split('(')[0]}"):
        BundlePredictor.from_dir(bundle, device="cpu").predict(phantom_volume()[0])


def test_postprocessing_failure_is_reported_as_such(tmp_path):
    bundle = edited_bundle(tmp_path / "bad_post", lambda c: c["postprocessing"]["transforms"].insert(
        0, {"_target_": "AsDiscreted", "keys": "probabilities"}))
    volume, _ = phantom_volume()
    with pytest.raises(BundleError, match=r"^bundle bad_post: postprocessing failed on the input volume of shape "
                                          r"\(24, 48, 48\) .*: in AsDiscreted: KeyError: Key `probabilities`"):
        BundlePredictor.from_dir(bundle, device="cpu").predict(volume)


def appended_to_postprocessing(step):
    """An edit that runs `step` (a transform config, or a "$..." callable) after the bundle's AsDiscreted."""
    def edit(config):
        transforms = config["postprocessing"]["transforms"]
        transforms.insert(transforms.index(next(t for t in transforms if t["_target_"] == "AsDiscreted")) + 1, step)
    return edit


@pytest.mark.parametrize("step,expected", [
    ({"_target_": "DeleteItemsd", "keys": "pred"},
     r"postprocessing left no 'pred' \(keys: image\); expected the label map or class scores under 'pred', where "
     r"MONAI's evaluators put the network output"),
    ("$lambda d: [d]", r"postprocessing returned a list; expected a dict holding the prediction under 'pred'"),
    ("$lambda d: {**d, 'pred': 'labels'}",
     r"postprocessing left 'pred' as builtins.str of dtype <U6; expected a tensor or array of labels or class scores"),
    ("$lambda d: {**d, 'pred': None}", r"postprocessing left 'pred' as builtins.NoneType of dtype object; expected"),
    ("$lambda d: {**d, 'pred': [[1, 2], [3]]}", r"postprocessing left 'pred' as builtins.list; expected a tensor"),
    ("$lambda d: {**d, 'pred': d['pred'] * float('nan')}",
     r"postprocessing returned NaN or infinite values in 'pred'; expected labels"),
    ("$lambda d: {**d, 'pred': d['pred'] / 0.0}", r"postprocessing returned NaN or infinite values in 'pred'"),
], ids=["key-removed", "not-a-dict", "string", "none", "ragged-list", "nan", "infinite"])
def test_postprocessing_output_that_is_not_a_label_map_is_refused_saying_what_it_is(tmp_path, step, expected):
    bundle = edited_bundle(tmp_path / "odd_output", appended_to_postprocessing(step))
    with pytest.raises(InferenceError, match=r"^bundle odd_output: " + expected):
        BundlePredictor.from_dir(bundle, device="cpu").predict(phantom_volume()[0])


def test_postprocessing_that_keeps_the_largest_connected_component_runs(tmp_path, threshold_bundle):
    """KeepLargestConnectedComponentd, common in published bundles' postprocessing, needs scikit-image on the CPU:
    without it the run stopped with "Skimage.measure required"."""
    from scipy import ndimage

    volume, _ = phantom_volume()  # with bone: several structures above the threshold
    everything = BundlePredictor.from_dir(threshold_bundle, device="cpu").predict(volume)
    components, count = ndimage.label(everything == 1, structure=np.ones((3, 3, 3)))  # MONAI: full connectivity
    assert count > 1
    largest = components == 1 + np.argmax(ndimage.sum_labels(everything == 1, components, range(1, count + 1)))
    keep = {"_target_": "KeepLargestConnectedComponentd", "keys": "pred", "applied_labels": [1]}
    bundle = edited_bundle(tmp_path / "largest", appended_to_postprocessing(keep))
    np.testing.assert_array_equal(BundlePredictor.from_dir(bundle, device="cpu").predict(volume), largest)


@pytest.mark.parametrize("step", [
    "$lambda d: {**d, 'pred': d['pred'].numpy()[..., ::-1].copy()[..., ::-1]}",
    "$lambda d: {**d, 'pred': d['pred'].numpy().astype('float32')}",
    "$lambda d: {**d, 'pred': (lambda a: (a.setflags(write=False), a)[1])(d['pred'].numpy().copy())}",
], ids=["negative-strides", "float32", "read-only"])
def test_numpy_predictions_give_the_tensor_prediction(tmp_path, threshold_bundle, step, recwarn):
    volume, _ = phantom_volume()
    expected = BundlePredictor.from_dir(threshold_bundle, device="cpu").predict(volume)
    bundle = edited_bundle(tmp_path / "numpy_output", appended_to_postprocessing(step))
    np.testing.assert_array_equal(BundlePredictor.from_dir(bundle, device="cpu").predict(volume), expected)
    assert not [w for w in recwarn if "not writable" in str(w.message)]  # torch shares only arrays it may write


def test_class_scores_made_nan_by_the_postprocessing_are_refused_before_the_argmax(tmp_path):
    """Without the bundle's argmax, medserve's own took NaN scores as class 0: an empty SEG, exit 0."""
    def edit(config):
        transforms = config["postprocessing"]["transforms"]
        transforms[:] = [t for t in transforms if t["_target_"] != "AsDiscreted"]
        transforms.append({"_target_": "Lambdad", "keys": "pred", "func": "$lambda x: x * float('nan')"})

    bundle = edited_bundle(tmp_path / "nan_scores", edit)
    with pytest.raises(InferenceError, match=r"^bundle nan_scores: postprocessing returned NaN or infinite values "
                                             r"in 'pred'; expected labels$"):
        BundlePredictor.from_dir(bundle, device="cpu").predict(phantom_volume()[0])


def test_a_network_whose_output_is_nan_is_refused_even_when_the_bundle_takes_the_argmax(tmp_path):
    """NaN weights: the bundle's own AsDiscreted(argmax) made every voxel background, exit 0."""
    broken = torch.nn.Conv3d(1, 2, 1)
    with torch.no_grad():
        broken.weight.fill_(float("nan"))
    bundle = edited_bundle(tmp_path / "nan_weights", lambda config: None, weights=broken)
    with pytest.raises(InferenceError, match=r"^bundle nan_weights: network/inferer \(SlidingWindowInferer\) "
                                             r"returned NaN or infinite values on the input volume of shape "
                                             r"\(24, 48, 48\) \(slice, row, column\); expected finite class scores"):
        BundlePredictor.from_dir(bundle, device="cpu").predict(phantom_volume()[0])


def test_a_prediction_that_lost_its_geometry_is_taken_on_the_input_grid_or_refused(tmp_path, threshold_bundle,
                                                                                   caplog):
    """Lambdad wraps a plain result in a MetaTensor with the identity affine: resampled from there, the organ
    moved (227 of 5984 voxels kept, exit 0). Of the input's shape it is taken as on its grid (as SaveImaged would
    write its voxels); of another shape nothing places it, and it is refused."""
    volume, _ = phantom_volume()
    expected = BundlePredictor.from_dir(threshold_bundle, device="cpu").predict(volume)
    plain = {"_target_": "Lambdad", "keys": "pred", "func": "$lambda x: torch.as_tensor(x.numpy())"}
    bundle = edited_bundle(tmp_path / "plain", appended_to_postprocessing(plain))
    with caplog.at_level(logging.WARNING, logger="medserve.bundle"):
        np.testing.assert_array_equal(BundlePredictor.from_dir(bundle, device="cpu").predict(volume), expected)
    assert any("carries no geometry" in message for message in caplog.messages)
    cut = {**plain, "func": "$lambda x: torch.as_tensor(x.numpy())[:, 2:]"}
    bundle = edited_bundle(tmp_path / "cut", appended_to_postprocessing(cut))
    with pytest.raises(InferenceError, match=r"^bundle cut: postprocessing returned 'pred' of shape \(1, 46, 48, "
                                             r"24\) without its geometry .*; expected the spatial shape \(48, 48, "
                                             r"24\) \(X, Y, Z\) of the input, or a MetaTensor"):
        BundlePredictor.from_dir(bundle, device="cpu").predict(volume)


def test_a_prediction_that_lost_its_geometry_without_invertd_is_placed_from_the_network_grid(tmp_path):
    """Without Invertd the prediction lies on the grid the network saw (here reoriented and resampled to 2 mm,
    another shape than the input's): taken as lying on the input's grid, it would be refused or, for an LPS series
    reoriented to RAS, mirrored."""
    def without_invertd(config):
        transforms = config["postprocessing"]["transforms"]
        transforms[:] = [t for t in transforms if t["_target_"] != "Invertd"]

    volume, _ = phantom_volume()
    expected = BundlePredictor.from_dir(edited_bundle(tmp_path / "own_space", without_invertd),
                                        device="cpu").predict(volume)
    plain = {"_target_": "Lambdad", "keys": "pred", "func": "$lambda x: torch.as_tensor(x.numpy())"}

    def stripped(config):
        without_invertd(config)
        appended_to_postprocessing(plain)(config)

    label_map = BundlePredictor.from_dir(edited_bundle(tmp_path / "stripped", stripped), device="cpu").predict(volume)
    np.testing.assert_array_equal(label_map, expected)


class Raising(torch.nn.Module):
    def __init__(self, error):
        super().__init__()
        self.error = error

    def forward(self, batch):
        raise self.error


class Structured(torch.nn.Conv3d):
    """The threshold network whose output comes wrapped, as deep-supervision or multi-head networks return it."""

    def __init__(self, wrap):
        super().__init__(1, 2, 1)
        self.wrap = wrap

    def forward(self, batch):
        return self.wrap(super().forward(batch))


@pytest.mark.parametrize(("wrap", "found"), [(lambda out: {"seg": out}, r"a dict \(keys 'seg'\)"),
                                             (lambda out: (out, out), r"a tuple \(2 items\)")], ids=["dict", "tuple"])
def test_a_network_whose_output_is_not_one_tensor_is_refused_saying_what_it_returned(threshold_bundle, wrap, found):
    """A TorchScript network returning a dict was "KeyError: 0"; one returning a tuple failed later, in Invertd."""
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    network = Structured(wrap)
    network.load_state_dict(predictor.network.state_dict())
    predictor.network = network
    with pytest.raises(InferenceError, match=r"^bundle threshold: network/inferer \(SlidingWindowInferer\) returned "
                                             rf"{found} on the input volume of shape \(24, 48, 48\) \(slice, row, "
                                             r"column\); expected one tensor of class scores$"):
        predictor.predict(phantom_volume()[0])


@pytest.mark.parametrize("error,expected", [
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
     r"out of GPU memory on cpu \(OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB\); free GPU "
     r"memory, lower the inferer's sw_batch_size/roi_size, or use device cpu$"),
    (MemoryError(), r"out of host memory \(MemoryError\); use a machine with more memory or a smaller volume$"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 96000000000 bytes."), r"out of host memory \(RuntimeError: .*\)"),
])
def test_out_of_memory_says_so_and_the_predictor_stays_usable(threshold_bundle, error, expected):
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    network = predictor.network
    volume, _ = phantom_volume()
    predictor.network = Raising(error)
    with pytest.raises(InferenceOutOfMemory, match=r"^bundle threshold: network/inferer \(SlidingWindowInferer\) "
                                                   r"failed on the input volume of shape \(24, 48, 48\) "
                                                   r"\(slice, row, column\): " + expected) as raised:
        predictor.predict(volume)
    assert raised.value.__cause__ is error
    predictor.network = network  # the failed call released the predictor's lock
    assert dice(predictor.predict(volume), volume.array > THRESHOLD_HU) > 0.93


class FailingOnce:
    """The predictor's postprocessing, raising `error` at the end of its first call (after running it whole, as
    memory can run out in its last step); records the data of every call."""

    def __init__(self, postprocessing, error):
        self.postprocessing = postprocessing
        self.error = error
        self.calls = []

    def __call__(self, data):
        self.calls.append(data)
        result = self.postprocessing(data)
        if len(self.calls) == 1:
            raise self.error
        return result


def test_postprocessing_out_of_gpu_memory_runs_again_on_the_cpu(threshold_bundle, caplog):
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    volume, _ = phantom_volume()
    expected = predictor.predict(volume)
    predictor.postprocessing = FailingOnce(predictor.postprocessing,
                                           torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 30 GiB"))
    with caplog.at_level(logging.WARNING, logger="medserve.bundle"):
        np.testing.assert_array_equal(predictor.predict(volume), expected)
    first, retry = predictor.postprocessing.calls
    assert retry is not first and retry.keys() == first.keys()
    assert all(value.device.type == "cpu" for value in retry.values() if isinstance(value, torch.Tensor))
    assert "postprocessing ran out of GPU memory; running it on the CPU" in caplog.text


@pytest.mark.parametrize("error,raised", [(MemoryError(), InferenceOutOfMemory),
                                          (RuntimeError("a transform's own bug"), InferenceError)])
def test_other_postprocessing_failures_are_not_run_again(threshold_bundle, error, raised):
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    predictor.postprocessing = FailingOnce(predictor.postprocessing, error)
    with pytest.raises(raised, match=r"^bundle threshold: postprocessing failed on the input volume") as caught:
        predictor.predict(phantom_volume()[0])
    assert caught.value.__cause__ is error
    assert len(predictor.postprocessing.calls) == 1


def test_keyboard_interrupt_is_not_turned_into_a_bundle_error(threshold_bundle):
    predictor = BundlePredictor.from_dir(threshold_bundle, device="cpu")
    predictor.network = Raising(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        predictor.predict(phantom_volume()[0])


def test_app_reports_a_failing_bundle_as_one_error_line(tmp_path):
    bundle = edited_bundle(tmp_path / "four_channels", lambda c: c["network_def"].update(in_channels=4),
                           weights=torch.nn.Conv3d(4, 2, 1))
    phantom = make_phantom(shape=(16, 32, 32), spacing=(3.0, 2.0, 2.0), seed=3)
    write_ct_series(phantom.hu, tmp_path / "study", SeriesGeometry(pixel_spacing=(2.0, 2.0), slice_spacing=3.0))
    completed = run_app("-i", tmp_path / "study", "-o", tmp_path / "out", "-m", bundle)
    assert completed.returncode == 2, completed.stderr
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, completed.stderr
    assert re.fullmatch(r"error: bundle four_channels: network/inferer \(SlidingWindowInferer\) failed on the input "
                        r"volume of shape \(16, 32, 32\) \(slice, row, column\): RuntimeError: .*to have 4 channels, "
                        r"but got 1 channels instead", errors[0]), errors[0]
    assert "Traceback" not in completed.stderr
