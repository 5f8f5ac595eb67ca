"""Pipeline benchmark (`make bench`): medserve's core vs the stock MONAI Deploy App SDK operators.

In one run, on a generated 512x512x300 CT series (Explicit VR Little Endian) and the same series RLE Lossless:

- load_volume: index + select + volume (ours) vs DICOMDataLoaderOperator -> DICOMSeriesSelectorOperator ->
  DICOMSeriesToVolumeOperator (stock), uncompressed and RLE;
- seg_write: a 4-label mask written as DICOM SEG by `medserve.writers.seg` vs DICOMSegmentationWriterOperator;
- app: `apps/bundle_seg/app.py` vs `bench/stock_app.py` (the same pipeline from stock operators), demo bundle.

Every measured run is a fresh Python subprocess ("worker"): it imports everything, does the untimed set-up,
resets the kernel's peak-RSS mark (/proc/self/clear_refs) and records the RSS as the baseline, runs the case
once and reports wall time and peak RSS above the baseline. The whole-app runs are measured from a wrapper
subprocess (peak RSS of the app process via RUSAGE_CHILDREN, minus the same process's import-only peak).
Reported figures are medians over --runs runs (default 5) for the load and SEG cases and over --app-runs runs
(default 3) for the whole app. Results go to bench/results/pipeline.json.

    python bench/bench_pipeline.py [--runs N] [--app-runs N] [--skip-app] [--profile-only]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
CACHE = BENCH / ".cache"
RESULTS = BENCH / "results" / "pipeline.json"
BUNDLE = REPO / "bundles" / "demo_organ_seg"
sys.path.insert(0, str(REPO))

SHAPE = (300, 512, 512)  # slices, rows, columns
COARSE_SHAPE = (75, 128, 128)  # generated phantom, upsampled x4 along every axis
PIXEL_SPACING = (0.7, 0.7)
SLICE_SPACING = 1.0
SERIES_VERSION = "1"  # bump when the generated series changes
SYNTAXES = ("uncompressed", "rle")
SEG_LABELS = {1: "liver", 2: "spleen", 3: "left kidney", 4: "tumour"}
ALGORITHM = ("bench-seg", "1.0")


# --------------------------------------------------------------------------------------------------------------
# Series generation (cached under bench/.cache/)
# --------------------------------------------------------------------------------------------------------------

def series_dir(syntax: str) -> Path:
    return CACHE / f"ct_{SHAPE[2]}x{SHAPE[1]}x{SHAPE[0]}_{syntax}"


def _series_ready(folder: Path) -> bool:
    marker = folder.with_name(folder.name + ".complete")  # outside the folder: the loaders would see it
    return marker.is_file() and marker.read_text().strip() == SERIES_VERSION


def bench_hu():
    """A 300x512x512 CT-like HU volume, built from a coarse phantom (cheap) upsampled x4, with fresh noise."""
    import numpy as np

    from medserve.demo.phantom import make_phantom

    spacing = (SLICE_SPACING * 4, PIXEL_SPACING[0] * 4, PIXEL_SPACING[1] * 4)
    phantom = make_phantom(shape=COARSE_SHAPE, spacing=spacing, seed=7, noise_hu=0.0)
    hu = phantom.hu
    for axis in range(3):
        hu = np.repeat(hu, 4, axis=axis)
    rng = np.random.default_rng(11)
    for k in range(hu.shape[0]):  # slice by slice: no 600 MB float64 temporary
        hu[k] += rng.standard_normal(hu.shape[1:], dtype=np.float32) * 15.0
    np.maximum(hu, -1024.0, out=hu)
    assert hu.shape == SHAPE, hu.shape
    return hu


def ensure_series(log=print) -> dict[str, Path]:
    from pydicom.uid import ExplicitVRLittleEndian, RLELossless

    from medserve.demo.study import SeriesGeometry, write_ct_series

    folders = {syntax: series_dir(syntax) for syntax in SYNTAXES}
    missing = [s for s, f in folders.items() if not _series_ready(f)]
    if not missing:
        return folders
    hu = bench_hu()
    geometry = SeriesGeometry(origin=(-179.2, -179.2, -150.0), pixel_spacing=PIXEL_SPACING,
                              slice_spacing=SLICE_SPACING)
    syntaxes = {"uncompressed": ExplicitVRLittleEndian, "rle": RLELossless}
    for syntax in missing:
        folder = folders[syntax]
        started = time.perf_counter()
        log(f"generating the {syntax} series under {folder} (cached for later runs) ...")
        shutil.rmtree(folder, ignore_errors=True)
        write_ct_series(hu, folder, geometry, transfer_syntax=syntaxes[syntax],
                        series_description=f"Bench CT 512x512x300 {syntax}")
        folder.with_name(folder.name + ".complete").write_text(SERIES_VERSION)
        log(f"  done in {time.perf_counter() - started:.1f} s")
    return folders


def bench_label_map():
    """A (slice, row, column) uint8 mask with 4 labels: ellipsoid blobs over parts of the 300 slices."""
    import numpy as np

    z, y, x = np.ogrid[:SHAPE[0], :SHAPE[1], :SHAPE[2]]
    label_map = np.zeros(SHAPE, dtype=np.uint8)
    blobs = [  # label, centre (z, y, x), radii (z, y, x) in voxels
        (1, (150, 250, 180), (110, 110, 90)),
        (2, (170, 240, 360), (60, 60, 50)),
        (3, (120, 320, 330), (45, 40, 30)),
        (4, (160, 240, 170), (25, 30, 30)),  # inside label 1: later labels overwrite
    ]
    for label, (cz, cy, cx), (rz, ry, rx) in blobs:
        inside = ((z - cz) / rz) ** 2 + ((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2 <= 1.0
        label_map[inside] = label
    return label_map


# --------------------------------------------------------------------------------------------------------------
# Memory measurement inside a worker
# --------------------------------------------------------------------------------------------------------------

def _rss_kb() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in kB."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                values[key] = int(value.split()[0])
    return values["VmRSS"], values["VmHWM"]


class PeakMeter:
    """Peak RSS above the RSS at start(): resets the kernel's high-water mark, so that set-up done before the
    case (which may already have used more memory) does not hide the case's own peak."""

    def start(self) -> None:
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # reset VmHWM / ru_maxrss to the current RSS (Linux >= 4.0)
            self.reset = True
        except OSError:
            self.reset = False
        self.baseline_kb, _ = _rss_kb()
        if not self.reset:
            self.baseline_kb = max(self.baseline_kb, _rss_kb()[1])

    def peak_mb(self) -> float:
        _, hwm = _rss_kb()
        return max(hwm - self.baseline_kb, 0) / 1024.0


# --------------------------------------------------------------------------------------------------------------
# Worker cases (each runs in its own fresh subprocess)
# --------------------------------------------------------------------------------------------------------------

def _import_all() -> None:
    """Everything any case uses, imported before the baseline so that import cost is not counted."""
    import highdicom  # noqa: F401
    import numpy  # noqa: F401
    import pydicom  # noqa: F401
    import pydicom.pixels  # noqa: F401
    from monai.deploy.core import Fragment  # noqa: F401
    from monai.deploy.operators.dicom_data_loader_operator import DICOMDataLoaderOperator  # noqa: F401
    from monai.deploy.operators.dicom_seg_writer_operator import DICOMSegmentationWriterOperator  # noqa: F401
    from monai.deploy.operators.dicom_series_selector_operator import DICOMSeriesSelectorOperator  # noqa: F401
    from monai.deploy.operators.dicom_series_to_volume_operator import DICOMSeriesToVolumeOperator  # noqa: F401

    import medserve.pipeline  # noqa: F401
    from medserve.dicom import index, select, volume  # noqa: F401
    from medserve.writers import seg  # noqa: F401
    # The RLE decoder plugins register lazily: decode one tiny RLE frame so both sides start warm.
    _warm_rle_decoder()


def _warm_rle_decoder() -> None:
    import numpy as np
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, RLELossless

    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.Rows = ds.Columns = 8
    ds.SamplesPerPixel, ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 1, 16, 16, 15, 0
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.PixelData = np.arange(64, dtype=np.uint16).tobytes()
    ds.compress(RLELossless)
    _ = ds.pixel_array


def ours_load(folder: Path):
    from medserve.dicom.index import index_folder
    from medserve.dicom.select import select_series
    from medserve.dicom.volume import series_to_volume

    index = index_folder(folder)
    selected = select_series(index)
    return series_to_volume(selected[0].series)


def stock_fragment():
    from monai.deploy.core import Fragment
    return Fragment()


def stock_load(folder: Path):
    from monai.deploy.operators.dicom_data_loader_operator import DICOMDataLoaderOperator
    from monai.deploy.operators.dicom_series_selector_operator import DICOMSeriesSelectorOperator
    from monai.deploy.operators.dicom_series_to_volume_operator import DICOMSeriesToVolumeOperator

    fragment = stock_fragment()
    studies = DICOMDataLoaderOperator(fragment, name="loader").load_data_to_studies(Path(folder))
    selection = DICOMSeriesSelectorOperator(fragment, name="selector").filter(None, studies)
    image = DICOMSeriesToVolumeOperator(fragment, name="to_volume").convert_to_image(selection)
    return image, selection


def worker_load(impl: str, syntax: str) -> dict:
    folder = series_dir(syntax)
    meter = PeakMeter()
    meter.start()
    started = time.perf_counter()
    if impl == "ours":
        result = ours_load(folder)
        shape, dtype = result.array.shape, str(result.array.dtype)
    else:
        result, _ = stock_load(folder)
        shape, dtype = result.asnumpy().shape, str(result.asnumpy().dtype)
    wall = time.perf_counter() - started
    return {"wall_s": wall, "peak_mb": meter.peak_mb(), "baseline_mb": meter.baseline_kb / 1024,
            "shape": list(shape), "dtype": dtype}


def _stock_segment_descriptions():
    from monai.deploy.operators.dicom_seg_writer_operator import SegmentDescription

    from medserve.writers.seg import segment_concept

    descriptions = []
    for number in sorted(SEG_LABELS):
        category, kind = segment_concept(SEG_LABELS[number])  # the same coded concepts on both sides
        descriptions.append(SegmentDescription(segment_label=SEG_LABELS[number], segmented_property_category=category,
                                               segmented_property_type=kind, algorithm_name=ALGORITHM[0],
                                               algorithm_version=ALGORITHM[1]))
    return descriptions


def warm_highdicom() -> None:
    """highdicom loads its standard tables on first use (about 1.7 s here); a hot writer has paid that, so both
    sides pay it before the timed region."""
    import highdicom as hd
    import numpy as np
    from pydicom.data import get_testdata_file
    from pydicom import dcmread

    source = dcmread(get_testdata_file("CT_small.dcm"))
    mask = np.zeros((1, source.Rows, source.Columns), dtype=np.uint8)
    mask[0, :4, :4] = 1
    description = hd.seg.SegmentDescription(
        segment_number=1, segment_label="warm-up", segmented_property_category=hd.sr.CodedConcept(
            "85756007", "SCT", "Tissue"), segmented_property_type=hd.sr.CodedConcept("85756007", "SCT", "Tissue"),
        algorithm_type=hd.seg.SegmentAlgorithmTypeValues.MANUAL)
    hd.seg.Segmentation(source_images=[source], pixel_array=mask, segmentation_type="BINARY",
                        segment_descriptions=[description], series_instance_uid=hd.UID(), series_number=1,
                        sop_instance_uid=hd.UID(), instance_number=1, manufacturer="warm-up",
                        manufacturer_model_name="warm-up", software_versions="0", device_serial_number="0")


def worker_seg(impl: str, syntax: str) -> dict:
    import numpy as np

    folder = series_dir(syntax)
    out_dir = Path(tempfile.mkdtemp(prefix=f"bench-seg-{impl}-"))
    warm_highdicom()
    try:
        if impl == "ours":
            from medserve.dicom.index import index_folder
            from medserve.dicom.select import select_series
            from medserve.dicom.volume import load_series
            from medserve.writers.seg import Algorithm, build_seg, write_seg

            source = load_series(select_series(index_folder(folder))[0].series)  # as the pipeline has it
            label_map = bench_label_map()
            gc.collect()
            meter = PeakMeter()
            meter.start()
            started = time.perf_counter()
            seg = build_seg(label_map, source.source_datasets, SEG_LABELS, Algorithm(*ALGORITHM))
            path = write_seg(seg, out_dir / "seg.dcm")
            wall = time.perf_counter() - started
        else:
            from monai.deploy.operators.dicom_seg_writer_operator import DICOMSegmentationWriterOperator

            image, selection = stock_load(folder)  # sorts the series' instances as the stock pipeline does
            del image
            selection[0].selected_series[0].image = None  # the writer needs the series, not the volume
            label_map = bench_label_map()
            writer = DICOMSegmentationWriterOperator(stock_fragment(),
                                                     segment_descriptions=_stock_segment_descriptions(),
                                                     output_folder=out_dir, name="seg_writer")
            gc.collect()
            meter = PeakMeter()
            meter.start()
            started = time.perf_counter()
            writer.process_images(label_map, selection, out_dir)
            wall = time.perf_counter() - started
            path = next(out_dir.glob("*.dcm"))
        size_mb = path.stat().st_size / 2**20
        present = int(np.count_nonzero(np.unique(label_map)))
        return {"wall_s": wall, "peak_mb": meter.peak_mb(), "baseline_mb": meter.baseline_kb / 1024,
                "file_mb": size_mb, "segments": present}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def worker_check(syntax: str) -> dict:
    """Once, outside timing: our volume and the stock one hold the same values (and report the geometry)."""
    import numpy as np

    ours = ours_load(series_dir(syntax))
    stock, _ = stock_load(series_dir(syntax))
    a, b = ours.array, np.asarray(stock.asnumpy(), dtype=np.float32)
    result = {"ours_shape": list(a.shape), "stock_shape": list(b.shape), "stock_dtype": str(stock.asnumpy().dtype)}
    if a.shape == b.shape:
        result["max_abs_diff"] = float(np.max(np.abs(a - b)))
        result["equal"] = bool(np.array_equal(a, b))
        if not result["equal"]:
            result["equal_if_slices_reversed"] = bool(np.array_equal(a, b[::-1]))
    else:
        result["equal"] = False
    stock_affine = np.asarray(stock.metadata().get("affine"), dtype=float)
    # Stock affine is RAS over (column, row, slice) indices (NIfTI style); ours is LPS over (slice, row, column).
    ras_from_lps = np.diag([-1.0, -1.0, 1.0, 1.0])
    ours_as_stock = ras_from_lps @ ours.affine[:, [2, 1, 0, 3]]
    result["affine_equal"] = bool(np.allclose(ours_as_stock, stock_affine, atol=1e-4))
    if not result["affine_equal"]:
        result["ours_affine_ras_xyz"] = ours_as_stock.round(4).tolist()
        result["stock_affine"] = stock_affine.round(4).tolist()
    return result


def worker_profile(syntax: str) -> dict:
    """cProfile of one of our load runs, grouped into stages: header parsing, pixel read/decode, rescale,
    geometry and checks, selection, other."""
    import cProfile
    import pstats

    folder = series_dir(syntax)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    from medserve.dicom.index import index_folder
    from medserve.dicom.select import select_series
    from medserve.dicom.volume import series_to_volume

    t0 = time.perf_counter()
    index = index_folder(folder)
    t1 = time.perf_counter()
    selected = select_series(index)
    t2 = time.perf_counter()
    series_to_volume(selected[0].series)
    t3 = time.perf_counter()
    profiler.disable()
    total = time.perf_counter() - started
    stats = pstats.Stats(profiler)

    def cumulative(module_part: str, function: str) -> float:
        return sum(value[3] for (file, _, name), value in stats.stats.items()
                   if module_part in file and name == function)

    def tottime(predicate) -> float:
        return sum(value[2] for key, value in stats.stats.items() if predicate(key))

    stages = {
        "index_folder (total)": t1 - t0,
        "  read_header: pydicom.dcmread(stop_before_pixels)": cumulative("medserve/dicom/index", "read_header"),
        "select_series": t2 - t1,
        "series_to_volume (total)": t3 - t2,
        "  _check_geometry_attributes": cumulative("medserve/dicom/volume", "_check_geometry_attributes"),
        "  _slice_order (highdicom get_volume_positions)": cumulative("medserve/dicom/volume", "_slice_order"),
        "  hd.Volume(...) + affine": cumulative("highdicom/volume", "__init__"),
    }
    # Pixels are read by worker threads, which cProfile does not see: their time is what remains.
    accounted = sum(stages[k] for k in ("  _check_geometry_attributes",
                                        "  _slice_order (highdicom get_volume_positions)",
                                        "  hd.Volume(...) + affine"))
    stages["  read_slices (threads: read/decode, first touch of the array, rescale)"] = max(t3 - t2 - accounted, 0)
    top = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:15]
    top_rows = [{"function": f"{Path(file).name}:{line}({name})", "calls": value[1], "tottime_s": round(value[2], 4),
                 "cumtime_s": round(value[3], 4)} for (file, line, name), value in top]
    # Where header parsing goes inside pydicom
    return {"total_s": total, "stages": {k: round(v, 4) for k, v in stages.items()}, "top_tottime": top_rows}


def run_worker(argv: list[str]) -> int:
    kind, impl, syntax = argv
    _import_all()
    if kind == "load":
        result = worker_load(impl, syntax)
    elif kind == "seg":
        result = worker_seg(impl, syntax)
    elif kind == "check":
        result = worker_check(syntax)
    elif kind == "profile":
        result = worker_profile(syntax)
    else:
        raise SystemExit(f"unknown worker kind {kind}")
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------------------------------------------
# App case: a wrapper process runs the app as its child and reports the child's wall time and peak RSS
# --------------------------------------------------------------------------------------------------------------

def run_wrapped(argv: list[str]) -> int:
    """`--wrap CMD...`: run CMD, report its wall time and peak RSS (RUSAGE_CHILDREN: this wrapper's only child)."""
    started = time.perf_counter()
    completed = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - started
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print("RESULT " + json.dumps({"wall_s": wall, "peak_mb": peak_kb / 1024, "rc": completed.returncode,
                                  "tail": completed.stdout[-3000:]}), flush=True)
    return 0


def app_command(impl: str, input_dir: Path, out_dir: Path, import_only: bool = False) -> list[str]:
    if impl == "ours":
        if import_only:
            # The app's imports, as app.py does them, then exit: the baseline of the app process.
            code = ("import sys; sys.path.insert(0, %r); sys.path.insert(0, %r); import runpy, apps.bundle_seg.app"
                    % (str(REPO), str(REPO / "apps" / "bundle_seg")))
            return [sys.executable, "-c", code]
        return [sys.executable, str(REPO / "apps" / "bundle_seg" / "app.py"), "-i", str(input_dir), "-o", str(out_dir),
                "-m", str(BUNDLE), "--no-nifti"]  # the stock pipeline writes the SEG only
    command = [sys.executable, str(BENCH / "stock_app.py"), "-i", str(input_dir), "-o", str(out_dir), "-m", str(BUNDLE)]
    return command + (["--import-only"] if import_only else [])


# --------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _preexec() -> None:
    try:  # Holoscan wants a 32 MB stack; `make bench` sets it, a direct run may not have.
        soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
        want = 32 * 2**20
        if soft != resource.RLIM_INFINITY and soft < want and (hard == resource.RLIM_INFINITY or hard >= want):
            resource.setrlimit(resource.RLIMIT_STACK, (want, hard))
    except (ValueError, OSError):
        pass


def spawn(args: list[str], timeout: float = 900) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), *args]
    completed = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                               timeout=timeout, preexec_fn=_preexec)
    for line in completed.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"worker {args} failed (rc {completed.returncode}):\n{completed.stdout[-2000:]}\n"
                       f"{completed.stderr[-4000:]}")


def median_of(runs: list[dict], key: str) -> float:
    return float(statistics.median(run[key] for run in runs))


def measure_pair(name: str, ours_args, stock_args, runs: int, log) -> dict:
    ours, stock = [], []
    for i in range(runs):  # interleaved, so that machine-load drifts hit both sides alike
        ours.append(ours_args())
        stock.append(stock_args())
        log(f"  {name} run {i + 1}/{runs}: ours {ours[-1]['wall_s']:.3f} s / {ours[-1]['peak_mb']:.0f} MB, "
            f"stock {stock[-1]['wall_s']:.3f} s / {stock[-1]['peak_mb']:.0f} MB")
    return {"ours": ours, "stock": stock}


def case_of(pair: dict, volume_mb: float) -> dict:
    ours_s, stock_s = median_of(pair["ours"], "wall_s"), median_of(pair["stock"], "wall_s")
    return {
        "ours_s": round(ours_s, 4),
        "stock_s": round(stock_s, 4),
        "speedup": round(stock_s / ours_s, 3) if ours_s > 0 else None,
        "ours_peak_mb": round(median_of(pair["ours"], "peak_mb"), 1),
        "stock_peak_mb": round(median_of(pair["stock"], "peak_mb"), 1),
        "volume_mb": round(volume_mb, 1),
        "runs": len(pair["ours"]),
        "ours_runs_s": [round(r["wall_s"], 4) for r in pair["ours"]],
        "stock_runs_s": [round(r["wall_s"], 4) for r in pair["stock"]],
    }


def bench_app(runs: int, log) -> dict:
    input_dir = series_dir("uncompressed")
    root = Path(tempfile.mkdtemp(prefix="bench-app-"))
    results: dict[str, list[dict]] = {"ours": [], "stock": []}
    baselines: dict[str, float] = {}
    try:
        for impl in ("ours", "stock"):
            base = spawn(["--wrap", *app_command(impl, input_dir, root / "x", import_only=True)])
            if base["rc"] != 0:
                raise RuntimeError(f"{impl} app import-only run failed:\n{base['tail']}")
            baselines[impl] = base["peak_mb"]
        for i in range(runs):
            for impl in ("ours", "stock"):
                out_dir = root / f"{impl}-{i}"
                run = spawn(["--wrap", *app_command(impl, input_dir, out_dir)])
                if run["rc"] != 0:
                    raise RuntimeError(f"{impl} app failed (rc {run['rc']}):\n{run['tail']}")
                segs = list(out_dir.rglob("*.dcm"))
                if not segs:
                    raise RuntimeError(f"{impl} app wrote no DICOM SEG under {out_dir}:\n{run['tail']}")
                run["total_peak_mb"] = run["peak_mb"]
                run["peak_mb"] = max(run["peak_mb"] - baselines[impl], 0.0)
                results[impl].append(run)
            log(f"  app run {i + 1}/{runs}: ours {results['ours'][-1]['wall_s']:.2f} s / "
                f"{results['ours'][-1]['total_peak_mb']:.0f} MB total, stock {results['stock'][-1]['wall_s']:.2f} s / "
                f"{results['stock'][-1]['total_peak_mb']:.0f} MB total")
        if runs:
            results["check"] = _compare_app_outputs(root / "ours-0", root / "stock-0")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["baselines"] = baselines
    return results


def _compare_app_outputs(ours_dir: Path, stock_dir: Path) -> dict:
    """Both apps' SEGs, read back with highdicom: voxels per segment (the two should be close)."""
    import highdicom as hd
    import numpy as np

    summary = {}
    for impl, folder in (("ours", ours_dir), ("stock", stock_dir)):
        path = next(folder.rglob("*.dcm"))
        seg = hd.seg.segread(path)
        frames = seg.pixel_array
        summary[impl] = {"frames": int(frames.shape[0]), "voxels": int(np.count_nonzero(frames)),
                         "segments": len(seg.SegmentSequence)}
    return summary


def print_table(results: dict, extras: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=170)
    table = Table(title=f"medserve vs stock App SDK operators: {SHAPE[2]}x{SHAPE[1]}x{SHAPE[0]} CT, "
                        f"medians of {extras['runs']} fresh-process runs ({extras['app_runs']} for the whole app)")
    for column in ("case", "ours s", "stock s", "speedup", "ours peak MB", "stock peak MB", "volume MB",
                   "ours peak / volume", "target"):
        table.add_column(column, justify="left" if column in ("case", "target") else "right")
    rows = [("load+select+volume, uncompressed", results["load_volume"]["uncompressed"], ">=3x, peak <=1.25x vol"),
            ("load+select+volume, RLE", results["load_volume"]["rle"], ">=2.5x, peak <=1.25x vol"),
            ("SEG write (4 labels)", results.get("seg_write"), ">=1.3x"),
            ("whole app (demo bundle)", results.get("app"), "")]
    for name, case, target in rows:
        if not case:
            table.add_row(name, "-", "-", "-", "-", "-", "-", "-", target)
            continue
        ratio = case["ours_peak_mb"] / case["volume_mb"] if case["volume_mb"] else float("nan")
        table.add_row(name, f"{case['ours_s']:.3f}", f"{case['stock_s']:.3f}", f"{case['speedup']:.2f}x",
                      f"{case['ours_peak_mb']:.0f}", f"{case['stock_peak_mb']:.0f}", f"{case['volume_mb']:.0f}",
                      f"{ratio:.2f}", target)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return run_worker(argv[1:])
    if argv[:1] == ["--wrap"]:
        return run_wrapped(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5,
                        help="fresh-process runs per load and SEG case (median; default 5)")
    parser.add_argument("--app-runs", type=int, default=3, help="runs of each whole app (median; default 3)")
    parser.add_argument("--skip-app", action="store_true", help="leave out the whole-app case")
    parser.add_argument("--prepare-only", action="store_true", help="generate the cached series and stop")
    parser.add_argument("--profile-only", action="store_true", help="only profile our load path")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, flush=True)

    started = time.perf_counter()
    ensure_series(log)
    if args.prepare_only:
        return 0
    profiles = {syntax: spawn(["--worker", "profile", "-", syntax]) for syntax in SYNTAXES}
    if args.profile_only:
        print(json.dumps(profiles, indent=2))
        return 0
    volume_mb = 4 * SHAPE[0] * SHAPE[1] * SHAPE[2] / 2**20  # float32 volume

    checks = {}
    for syntax in SYNTAXES:
        checks[syntax] = spawn(["--worker", "check", "-", syntax])
        log(f"volume check ({syntax}): {checks[syntax]}")
        if not checks[syntax].get("equal"):
            log(f"WARNING: ours and stock volumes differ on the {syntax} series")

    raw: dict[str, dict] = {}
    load_volume = {}
    for syntax in SYNTAXES:
        log(f"load+select+volume, {syntax}:")
        pair = measure_pair(f"load/{syntax}", lambda: spawn(["--worker", "load", "ours", syntax]),
                            lambda: spawn(["--worker", "load", "stock", syntax]), args.runs, log)
        raw[f"load_{syntax}"] = pair
        load_volume[syntax] = case_of(pair, volume_mb)
    log("SEG write (uncompressed source):")
    pair = measure_pair("seg", lambda: spawn(["--worker", "seg", "ours", "uncompressed"]),
                        lambda: spawn(["--worker", "seg", "stock", "uncompressed"]), args.runs, log)
    raw["seg"] = pair
    seg_write = case_of(pair, volume_mb)
    seg_write["label_map_mb"] = round(SHAPE[0] * SHAPE[1] * SHAPE[2] / 2**20, 1)  # the uint8 mask
    seg_write["ours_file_mb"] = round(median_of(pair["ours"], "file_mb"), 2)
    seg_write["stock_file_mb"] = round(median_of(pair["stock"], "file_mb"), 2)

    results = {"load_volume": load_volume, "seg_write": seg_write}
    if not args.skip_app:
        log("whole app (uncompressed series, demo bundle):")
        app_runs = bench_app(args.app_runs, log)
        app = case_of(app_runs, volume_mb)
        app["ours_total_peak_mb"] = round(median_of(app_runs["ours"], "total_peak_mb"), 1)
        app["stock_total_peak_mb"] = round(median_of(app_runs["stock"], "total_peak_mb"), 1)
        app["import_baseline_mb"] = {k: round(v, 1) for k, v in app_runs["baselines"].items()}
        app["outputs"] = app_runs.get("check")
        app["note"] = ("wall time of the whole process (imports, graph, load, inference, writers); peak MB is the "
                       "process peak RSS minus the peak of a run that only imports the app's modules")
        results["app"] = app
    else:
        results["app"] = None

    results["meta"] = {
        "series": {"shape_slices_rows_columns": list(SHAPE), "pixel_spacing": list(PIXEL_SPACING),
                   "slice_spacing": SLICE_SPACING, "folders": {s: str(series_dir(s).relative_to(REPO))
                                                               for s in SYNTAXES}},
        "runs": args.runs, "app_runs": 0 if args.skip_app else args.app_runs, "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "volume_check": checks,
        "our_load_profile": {s: profiles[s]["stages"] for s in SYNTAXES},
        "peak_method": "per fresh process: VmHWM after resetting it via /proc/self/clear_refs, minus RSS at reset",
        "total_bench_s": round(time.perf_counter() - started, 1),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results, {"runs": args.runs, "app_runs": 0 if args.skip_app else args.app_runs})
    log("where our load path spends its time (one cProfile'd run):")
    for syntax in SYNTAXES:
        log(f"  {syntax}: total {profiles[syntax]['total_s']:.3f} s")
        for stage, seconds in profiles[syntax]["stages"].items():
            log(f"    {stage:<72} {seconds:8.3f} s")
    log(f"wrote {args.output.relative_to(REPO) if args.output.is_relative_to(REPO) else args.output} "
        f"in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
