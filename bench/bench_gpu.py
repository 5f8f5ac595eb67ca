"""GPU check (`make bench-gpu`): the shared core on CUDA against the CPU, in one run; writes bench/results/gpu.json.

Needs no Holoscan: it drives `medserve.pipeline.run_study` and `BundlePredictor`, the functions the app's
operators and the server call. Cases:
- demo: the demo study through `run_study` on each device (Dice against the phantom's truth, SEG read back
  equal to the label map, NIfTI affine), and the label maps of the two devices compared voxel by voxel;
- bench series: the 512x512x300 series of `make bench` through `run_study` with the demo bundle (timings, peak
  GPU memory, CPU/CUDA agreement);
- zoo small: every bundle config under the model zoo, with random weights (seed 0), on a small phantom on each
  device (agreement);
- zoo full size: the same bundles on the 512x512x300 series, CUDA only (cold and hot predict, peak GPU memory);
- app: `apps/bundle_seg/app.py` itself (Holoscan) as a user runs it, on its default device (CUDA when present) and
  with `--device cpu`, on the demo study (Dice, CPU/default agreement) and on the 512x512x300 series (wall time).
Without CUDA the CPU cases run and the CUDA ones say so. Results are written after each case; a case that fails
is recorded with its error and the others still run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import highdicom as hd  # noqa: E402
import nibabel as nib  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench_pipeline  # noqa: E402
from medserve.bundle.predictor import BundlePredictor, write_random_weights  # noqa: E402
from medserve.demo.phantom import dice, make_phantom  # noqa: E402
from medserve.demo.study import write_demo_study  # noqa: E402
from medserve.dicom.index import index_folder  # noqa: E402
from medserve.dicom.select import select_series  # noqa: E402
from medserve.dicom.volume import LoadedSeries, load_series, ras_affine  # noqa: E402
from medserve.pipeline import run_study  # noqa: E402
from medserve.writers.nifti import read_label_map  # noqa: E402

DEMO_BUNDLE = REPO / "bundles" / "demo_organ_seg"
RESULTS = REPO / "bench" / "results" / "gpu.json"
CUDA = torch.cuda.is_available()
DEVICES = ["cpu", "cuda"] if CUDA else ["cpu"]


def synchronize() -> None:
    if CUDA:
        torch.cuda.synchronize()


def peak_gpu_mb() -> int | None:
    return round(torch.cuda.max_memory_allocated() / 2**20) if CUDA else None


def agreement(cpu: np.ndarray, cuda: np.ndarray) -> dict:
    return {"equal_fraction": float((cpu == cuda).mean()), "differing_voxels": int((cpu != cuda).sum())}


def first_series(folder: Path) -> LoadedSeries:
    return load_series(select_series(index_folder(folder))[0].series)


class Check:
    def __init__(self, work: Path, model_zoo: Path) -> None:
        self.work = work
        self.model_zoo = model_zoo
        self.zoo_names = sorted(p.name for p in model_zoo.iterdir() if p.is_dir()) if model_zoo.is_dir() else []

    def environment(self) -> dict:
        return {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": CUDA,
                "gpu": torch.cuda.get_device_name(0) if CUDA else None, "cpus": os.cpu_count(),
                "python": sys.version.split()[0], "highdicom": hd.__version__,
                "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32, "model_zoo": self.zoo_names}

    @functools.cached_property
    def demo_study(self) -> tuple[Path, np.ndarray]:
        """The demo study's folder and the phantom's organ mask (its truth), written once for all cases."""
        study = self.work / "demo_study"
        _, phantom = write_demo_study(study)
        return study, phantom.organ

    @functools.cached_property
    def series(self) -> Path:
        """The 512x512x300 uncompressed series of `make bench` (generated once, cached under bench/.cache)."""
        return bench_pipeline.ensure_series(log=lambda message: None)["uncompressed"]

    def demo(self) -> dict:
        study, truth = self.demo_study
        source = first_series(study)
        results, label_maps = {}, {}
        for device in DEVICES:
            predictor = BundlePredictor.from_dir(DEMO_BUNDLE, device=device)
            started = time.perf_counter()
            result = run_study(study, predictor, self.work / f"demo_{device}")
            wall = time.perf_counter() - started
            synchronize()
            started = time.perf_counter()
            predictor.predict(source.volume)
            synchronize()
            hot = time.perf_counter() - started
            labels = label_maps[device] = read_label_map(result.nifti_path)
            back = hd.seg.segread(result.seg_path).get_volume(combine_segments=True).match_geometry(source.volume)
            results[device] = {
                "run_study_s": round(wall, 3), "hot_predict_s": round(hot, 3), "timings": result.timings,
                "segments": result.segments, "dice_vs_truth": round(dice(labels, truth), 4),
                "seg_read_back_equals_labels": bool(np.array_equal(back.array, labels)),
                "nifti_affine_equals_source": bool(np.allclose(nib.load(result.nifti_path).affine,
                                                               ras_affine(source.volume), atol=1e-4)),
            }
        if CUDA:
            results["cpu_vs_cuda"] = agreement(label_maps["cpu"], label_maps["cuda"])
        return results

    def bench_series(self) -> dict:
        results, label_maps = {}, {}
        for device in DEVICES:
            predictor = BundlePredictor.from_dir(DEMO_BUNDLE, device=device)
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            runs = []
            for run in range(2 if device == "cuda" else 1):  # cold, then hot on the GPU
                started = time.perf_counter()
                result = run_study(self.series, predictor, self.work / f"bench_{device}_{run}")
                runs.append({"wall_s": round(time.perf_counter() - started, 2), "timings": result.timings})
            label_maps[device] = read_label_map(result.nifti_path)
            results[device] = {"runs": runs, "segments": result.segments,
                               "peak_gpu_mb": peak_gpu_mb() if device == "cuda" else None}
        if CUDA:
            results["cpu_vs_cuda"] = agreement(label_maps["cpu"], label_maps["cuda"])
        return results

    def zoo_bundle(self, name: str) -> Path:
        """A copy of the zoo bundle with random weights (seed 0) from its own network_def."""
        target = self.work / "zoo" / name
        if not target.exists():
            shutil.copytree(self.model_zoo / name, target)
            write_random_weights(target)
        return target

    def zoo_small(self) -> dict:
        phantom = make_phantom(shape=(24, 48, 48), spacing=(2.5, 2.0, 2.0), seed=1)
        volume = hd.Volume(array=phantom.hu.astype(np.float32), affine=np.diag([2.5, 2.0, 2.0, 1.0]),
                           coordinate_system="PATIENT")
        results = {}
        for name in self.zoo_names:
            entry, label_maps = {}, {}
            for device in DEVICES:
                predictor = BundlePredictor.from_dir(self.zoo_bundle(name), device=device)
                synchronize()
                started = time.perf_counter()
                label_map = label_maps[device] = predictor.predict(volume)
                synchronize()
                entry[device] = {"predict_s": round(time.perf_counter() - started, 3), "dtype": str(label_map.dtype),
                                 "shape_ok": label_map.shape == volume.array.shape,
                                 "labels_present": int(len(np.unique(label_map)))}
            if CUDA:
                entry["cpu_vs_cuda"] = agreement(label_maps["cpu"], label_maps["cuda"])
            results[name] = entry
        return results

    def zoo_full_size(self) -> dict:
        if not CUDA:
            return {"skipped": "no CUDA device"}
        source = first_series(self.series)
        results = {}
        for name in self.zoo_names:
            predictor = BundlePredictor.from_dir(self.zoo_bundle(name), device="cuda")
            torch.cuda.reset_peak_memory_stats()
            seconds = []
            for _ in range(2):  # cold, hot
                synchronize()
                started = time.perf_counter()
                label_map = predictor.predict(source.volume)
                synchronize()
                seconds.append(round(time.perf_counter() - started, 2))
            results[name] = {"predict_s_cold_hot": seconds, "dtype": str(label_map.dtype),
                             "shape_ok": label_map.shape == source.volume.array.shape, "peak_gpu_mb": peak_gpu_mb()}
            del predictor
            torch.cuda.empty_cache()
        return results

    def app(self) -> dict:
        study, truth = self.demo_study
        results, label_maps = {}, {}
        for name, folder, device in (("demo_default_device", study, None), ("demo_cpu", study, "cpu"),
                                     ("series_default_device", self.series, None)):
            out = self.work / f"app_{name}"
            command = [sys.executable, str(REPO / "apps" / "bundle_seg" / "app.py"), "-i", str(folder), "-o", str(out),
                       "-m", str(DEMO_BUNDLE)] + (["--device", device] if device else [])
            started = time.perf_counter()
            completed = subprocess.run(command, capture_output=True, text=True, timeout=900)
            entry = {"rc": completed.returncode, "wall_s": round(time.perf_counter() - started, 2),
                     "summary": completed.stdout.strip().splitlines()[-1:],
                     "stderr_tail": completed.stderr.strip().splitlines()[-3:] if completed.returncode else []}
            if completed.returncode == 0 and folder == study:
                label_maps[name] = read_label_map(out / "labels.nii.gz")
                entry["dice_vs_truth"] = round(dice(label_maps[name], truth), 4)
            results[name] = entry
        if len(label_maps) == 2:
            results["default_vs_cpu"] = agreement(label_maps["demo_cpu"], label_maps["demo_default_device"])
        return results


def run_case(results: dict, name: str, case: Callable[[], dict], output: Path) -> None:
    """Run one case; a failure is recorded (with its traceback) and the other cases still run."""
    started = time.perf_counter()
    try:
        results[name] = case()
    except Exception:
        results[name] = {"error": traceback.format_exc()[-3000:]}
    results[name]["case_s"] = round(time.perf_counter() - started, 2)
    print(f"{name}: {json.dumps(results[name])}", flush=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-zoo", type=Path, default=REPO.parent / "shared" / "model-zoo",
                        help="folder of model-zoo bundle folders (default: ../shared/model-zoo)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="medserve-bench-gpu-") as work:
        check = Check(Path(work), args.model_zoo)
        for name, case in (("environment", check.environment), ("demo", check.demo),
                           ("bench_series_demo_bundle", check.bench_series), ("zoo_small", check.zoo_small),
                           ("zoo_full_size_cuda", check.zoo_full_size), ("app", check.app)):
            run_case(results, name, case, args.output)
    failed = [name for name, result in results.items() if "error" in result]
    print(f"wrote {args.output}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
