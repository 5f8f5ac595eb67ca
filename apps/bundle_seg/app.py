"""bundle_seg: segment a DICOM study with any MONAI segmentation bundle and write a DICOM SEG and a NIfTI map.

    python apps/bundle_seg/app.py -i DICOM_DIR -o OUT_DIR -m BUNDLE_DIR [--rules RULES.json [--all-matched
        [--sort-by-sop-instance-count]]] [--device cpu]

or, as inside a MAP, with HOLOSCAN_INPUT_PATH / HOLOSCAN_OUTPUT_PATH / HOLOSCAN_MODEL_PATH set. The model path
is a bundle folder, or a folder holding exactly one bundle folder (a MAP's /opt/holoscan/models).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import time
from pathlib import Path

from medserve.home import ensure_writable_home
from medserve.stopping import block_stop_signals, watch_stop_signals

if __name__ == "__main__":
    block_stop_signals()  # before torch, Holoscan and the SDK start threads (see medserve.stopping)
    ensure_writable_home()  # before the SDK's imports write caches there (see medserve.home)

from monai.deploy.core import Application  # noqa: E402
from monai.deploy.conditions import CountCondition  # noqa: E402

from medserve.bundle.predictor import BundlePredictor  # noqa: E402
from medserve.errors import BundleError, OutputError, one_line  # noqa: E402
from medserve.logs import configure_logging, sdk_log_level  # noqa: E402
from medserve.results import NIFTI_NAME, SEG_NAME  # noqa: E402
from medserve.writers.files import (FileIdentity, partial_path, remove_published, stop_publishing,  # noqa: E402
                                    track_published, writable_folder)
from operators import (BundleInferenceOperator, DicomLoaderOperator, NiftiWriterOperator,  # noqa: E402
                       ResultSummaryOperator, SegWriterOperator, SeriesSelectorOperator, SeriesToVolumeOperator)
from operators.failures import watch_failures  # noqa: E402

_PATH_VARIABLES = {"input": "HOLOSCAN_INPUT_PATH", "output": "HOLOSCAN_OUTPUT_PATH", "model": "HOLOSCAN_MODEL_PATH"}


def resolve_bundle(model_path: Path) -> Path:
    """The bundle folder itself, or the single bundle folder inside a models folder."""
    if not model_path.exists():
        raise BundleError(f"model path {model_path} does not exist; expected a bundle folder (with configs/)")
    if (model_path / "configs").is_dir():
        return model_path
    candidates = [p for p in sorted(model_path.iterdir()) if (p / "configs").is_dir()] if model_path.is_dir() else []
    if len(candidates) == 1:
        return candidates[0]
    found = ", ".join(p.name for p in candidates) or "none"
    raise BundleError(f"model path {model_path}: expected a bundle folder (with configs/) or a folder holding "
                      f"exactly one; bundle folders found: {found}")


class BundleSegApp(Application):
    """DICOM folder -> series -> volume -> bundle inference -> DICOM SEG + NIfTI."""

    def __init__(self, *args, rules: str | None = None, all_matched: bool = False,
                 sort_by_sop_instance_count: bool = False, device: str | None = None, nifti: bool = True,
                 verbosity: int | None = None, **kwargs):
        self.rules = rules
        self.all_matched = all_matched
        self.sort_by_sop_instance_count = sort_by_sop_instance_count
        self.verbosity = verbosity
        self.device = device
        self.nifti = nifti
        self.started = time.perf_counter()
        super().__init__(*args, **kwargs)

    def compose(self):
        context = Application.init_app_context(self.argv)
        configure_logging(self.verbosity)  # the SDK's context set-up installs its own logging config
        input_path, output_path = Path(context.input_path), Path(context.output_path)
        predictor = BundlePredictor.from_dir(resolve_bundle(Path(context.model_path)), self.device)

        loader = DicomLoaderOperator(self, CountCondition(self, 1), input_folder=input_path, exclude=output_path,
                                     name="dicom_loader")
        selector = SeriesSelectorOperator(self, rules=self.rules, all_matched=self.all_matched,
                                          sort_by_sop_instance_count=self.sort_by_sop_instance_count,
                                          name="series_selector")
        to_volume = SeriesToVolumeOperator(self, name="series_to_volume")
        inference = BundleInferenceOperator(self, predictor=predictor, name="bundle_inference")
        seg_writer = SegWriterOperator(self, output_folder=output_path, predictor=predictor, name="seg_writer")
        summary = ResultSummaryOperator(self, labels=predictor.labels, started=self.started, nifti=self.nifti,
                                        name="summary")

        self.add_flow(loader, selector, {("study_index", "study_index")})
        self.add_flow(selector, to_volume, {("selected_series", "selected_series")})
        self.add_flow(to_volume, inference, {("volume", "volume")})
        self.add_flow(inference, seg_writer, {("label_map", "label_map")})
        self.add_flow(to_volume, seg_writer, {("source", "source")})
        self.add_flow(inference, summary, {("label_map", "label_map")})
        self.add_flow(seg_writer, summary, {("seg_path", "seg_path")})
        if self.nifti:
            nifti_writer = NiftiWriterOperator(self, output_folder=output_path, name="nifti_writer")
            self.add_flow(inference, nifti_writer, {("label_map", "label_map")})
            self.add_flow(to_volume, nifti_writer, {("volume", "volume")})
            self.add_flow(nifti_writer, summary, {("nifti_path", "nifti_path")})


_VERBOSITY = {"ERROR": -1, "WARNING": 0, "INFO": 1, "DEBUG": 2}  # -l: configure_logging's verbosity


def _given_path(text: str) -> Path:
    """A path flag's value. An empty one ('-o ""', an unset shell variable) would be the current folder, whose
    seg.dcm and labels.nii.gz the run then removes: refused, as an empty HOLOSCAN_*_PATH is."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path; expected a folder")
    return Path(text)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bundle_seg", description=__doc__.splitlines()[0])
    parser.add_argument("-i", "--input", type=_given_path, help="DICOM folder (default: $HOLOSCAN_INPUT_PATH)")
    parser.add_argument("-o", "--output", type=_given_path, help="output folder (default: $HOLOSCAN_OUTPUT_PATH)")
    parser.add_argument("-m", "--model", type=_given_path, help="bundle folder (default: $HOLOSCAN_MODEL_PATH)")
    parser.add_argument("--rules", help="series selection rules: a JSON file or string (stock selector format)")
    parser.add_argument("--all-matched", action="store_true",
                        help="as the stock selector's all_matched: every series a selection matches, not the first")
    parser.add_argument("--sort-by-sop-instance-count", action="store_true",
                        help="with --all-matched, the matches largest first (so the largest one is segmented)")
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--no-nifti", dest="nifti", action="store_false", help="write the DICOM SEG only")
    parser.add_argument("-l", "--log-level", type=str.upper, choices=sorted(_VERBOSITY),
                        help="DEBUG, INFO, WARNING (default, or $MEDSERVE_LOG_LEVEL) or ERROR")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    verbosity = None if args.log_level is None else _VERBOSITY[args.log_level]
    level = configure_logging(verbosity)
    for name, variable in _PATH_VARIABLES.items():
        value = getattr(args, name)
        if value is not None:
            os.environ[variable] = str(value.resolve())
    if not os.environ.get("HOLOSCAN_OUTPUT_PATH", "").strip():  # a blank one would be the current folder
        print("error: no output path: pass --output or set HOLOSCAN_OUTPUT_PATH", file=sys.stderr)
        return 2
    output = Path(os.environ["HOLOSCAN_OUTPUT_PATH"])
    published = track_published()
    try:
        created = writable_folder(output, stale=(SEG_NAME, NIFTI_NAME))
    except OutputError as error:
        print(f"error: {one_line(str(error))}", file=sys.stderr)
        return 2
    if (problem := _argument_problem(args)) is not None:  # after the clean-up: no earlier result stays beside it
        _discard_run(output, created, published)
        print(f"error: {one_line(problem)}", file=sys.stderr)
        return 2
    # Only now: a Ctrl-C that came during the imports (held, as the signals are blocked) must not clean up while
    # the folders above are still being made.
    watch_stop_signals(functools.partial(_interrupted, output, created, published))
    # The SDK reads the paths from the environment; its own argv parser must not see our flags.
    app = BundleSegApp([sys.executable, __file__, "--log-level", sdk_log_level(level)], rules=args.rules,
                       all_matched=args.all_matched, sort_by_sop_instance_count=args.sort_by_sop_instance_count,
                       device=args.device, nifti=args.nifti, verbosity=verbosity)
    record = watch_failures(app)
    try:
        app.run()
    except Exception as error:  # noqa: BLE001 - input or internal, the run ends with one line (operators/failures)
        record.fail("the application", error)
    missing = sorted({SEG_NAME, *([NIFTI_NAME] if args.nifti else [])} - {path.name for path in record.outputs})
    if record.failure is None and missing:  # a graph whose operators stopped ticking ends without an error
        record.fail("the application", RuntimeError(f"the graph finished without writing {', '.join(missing)}"))
    if record.failure is None:
        return 0
    _discard_run(output, created, published)
    print(f"error: {one_line(record.failure.message())}", file=sys.stderr)
    return record.failure.exit_status


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What makes the arguments unusable before anything runs, or None."""
    if args.sort_by_sop_instance_count and not args.all_matched:
        return ("--sort-by-sop-instance-count orders the matches of --all-matched; pass both (as the stock "
                "selector's sort_by_sop_instance_count applies only with all_matched)")
    for name in ("input", "model"):
        if not os.environ.get(_PATH_VARIABLES[name], "").strip():
            return f"no {name} path: pass --{name} or set {_PATH_VARIABLES[name]}"
    try:
        if not Path(os.environ["HOLOSCAN_INPUT_PATH"]).exists():
            return f"input folder {os.environ['HOLOSCAN_INPUT_PATH']} does not exist"
    except OSError as error:  # a name too long, a parent we may not search
        return (f"input folder {os.environ['HOLOSCAN_INPUT_PATH']}: cannot be read ({error.strerror or error}); "
                "expected a folder of DICOM files we can read")
    try:  # before the SDK's own look at the model path, which raised PermissionError as an internal error
        bundle = resolve_bundle(Path(os.environ["HOLOSCAN_MODEL_PATH"]))
        for folder in (bundle, bundle / "configs"):
            os.listdir(folder)
    except BundleError as error:
        return str(error)
    except OSError as error:
        return (f"model path {error.filename}: cannot be read ({error.strerror or error}); expected a bundle folder "
                "we can read")
    return None


def _discard_run(output: Path, created: list[Path], published: list[tuple[Path, FileIdentity]]) -> None:
    """Leave nothing of a run that did not complete: the results it published, its partial files, and the
    folders it created (deepest first, as long as they are empty). Results of earlier runs were removed when it
    began; another run's that finished into the same folder meanwhile are that run's, and stay."""
    remove_published(published)
    for path in (partial_path(output / SEG_NAME), partial_path(output / NIFTI_NAME)):
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
    for folder in created:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _interrupted(output: Path, created: list[Path], published: list[tuple[Path, FileIdentity]],
                 received: signal.Signals) -> None:
    stop_publishing()  # a writer finishing now must not put its file back after the clean-up
    _discard_run(output, created, published)
    print(f"error: interrupted by {received.name}; this run's outputs were removed", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
