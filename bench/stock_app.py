"""The bundle_seg pipeline built only from the stock MONAI Deploy App SDK operators (the benchmark's baseline).

    python bench/stock_app.py -i DICOM_DIR -o OUT_DIR -m BUNDLE_DIR [--import-only]

DICOMDataLoaderOperator -> DICOMSeriesSelectorOperator -> DICOMSeriesToVolumeOperator ->
MonaiBundleInferenceOperator (the bundle directory through `bundle_path=`, with a model path that does not exist so
that the app context holds no model) -> DICOMSegmentationWriterOperator (one segment per label of
the bundle's metadata). The stock bundle operator casts its output to uint8: fine for a bundle with < 256 labels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from monai.deploy.conditions import CountCondition
from monai.deploy.core import Application, Image, IOType
from monai.deploy.operators.dicom_data_loader_operator import DICOMDataLoaderOperator
from monai.deploy.operators.dicom_seg_writer_operator import DICOMSegmentationWriterOperator, SegmentDescription
from monai.deploy.operators.dicom_series_selector_operator import DICOMSeriesSelectorOperator
from monai.deploy.operators.dicom_series_to_volume_operator import DICOMSeriesToVolumeOperator
from monai.deploy.operators.monai_bundle_inference_operator import (BundleConfigNames, IOMapping,
                                                                    MonaiBundleInferenceOperator)
from pydicom.sr.codedict import codes

# The stock selector's usual CT rule (as in the SDK's example apps).
RULES = json.dumps({"selections": [{"name": "CT Series", "conditions": {"Modality": "(?i)CT"}}]})


def bundle_labels(bundle: Path) -> list[str]:
    """Foreground label names from the bundle metadata's output channel_def, in channel order."""
    metadata = json.loads((bundle / "configs" / "metadata.json").read_text())
    outputs = metadata["network_data_format"]["outputs"]
    channel_def = next(iter(outputs.values())).get("channel_def", {"1": "label"})
    return [name for key, name in sorted(channel_def.items(), key=lambda kv: int(kv[0])) if int(key) != 0]


class StockBundleSegApp(Application):
    def compose(self):
        context = Application.init_app_context(self.argv)
        bundle = Path(os.environ["STOCK_APP_BUNDLE"])
        descriptions = [SegmentDescription(segment_label=name, segmented_property_category=codes.SCT.Organ,
                                           segmented_property_type=codes.SCT.Organ, algorithm_name="stock-bundle",
                                           algorithm_version="1.0")
                        for name in bundle_labels(bundle)]
        loader = DICOMDataLoaderOperator(self, CountCondition(self, 1), input_folder=Path(context.input_path),
                                         name="dicom_loader")
        selector = DICOMSeriesSelectorOperator(self, rules=RULES, name="series_selector")
        to_volume = DICOMSeriesToVolumeOperator(self, name="series_to_volume")
        inference = MonaiBundleInferenceOperator(
            self, input_mapping=[IOMapping("image", Image, IOType.IN_MEMORY)],
            output_mapping=[IOMapping("pred", Image, IOType.IN_MEMORY)], app_context=context,
            bundle_config_names=BundleConfigNames(config_names=["inference"]), bundle_path=bundle,
            name="bundle_inference")
        writer = DICOMSegmentationWriterOperator(self, segment_descriptions=descriptions,
                                                 output_folder=Path(context.output_path), name="seg_writer")
        self.add_flow(loader, selector, {("dicom_study_list", "dicom_study_list")})
        self.add_flow(selector, to_volume, {("study_selected_series_list", "study_selected_series_list")})
        self.add_flow(to_volume, inference, {("image", "image")})
        self.add_flow(inference, writer, {("pred", "seg_image")})
        self.add_flow(selector, writer, {("study_selected_series_list", "study_selected_series_list")})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-i", "--input", type=Path, required=True)
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("-m", "--model", type=Path, required=True, help="bundle directory")
    parser.add_argument("--import-only", action="store_true", help="import everything and exit (RSS baseline)")
    args = parser.parse_args()
    if args.import_only:
        return 0
    args.output.mkdir(parents=True, exist_ok=True)
    os.environ["HOLOSCAN_INPUT_PATH"] = str(args.input.resolve())
    os.environ["HOLOSCAN_OUTPUT_PATH"] = str(args.output.resolve())
    # The directory form of a bundle only works through `bundle_path=` when the app context holds no model:
    # with the bundle folder as model path the SDK makes a predictor-less Model of it ("A predictor of the
    # model is not set"), and so does an empty folder; a path that does not exist gives no model at all, and
    # the bundle goes in by `bundle_path=`.
    os.environ["HOLOSCAN_MODEL_PATH"] = str(args.output.resolve() / "no-models-here")
    os.environ["STOCK_APP_BUNDLE"] = str(args.model.resolve())
    # App(argv) drops argv[0] and the SDK's parser drops another: the paths go through the environment, and
    # the SDK must not see our -m (it would override HOLOSCAN_MODEL_PATH).
    StockBundleSegApp([sys.executable, __file__, "--log-level", "WARN"]).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
