"""`make demo`: write the demo study, run apps/bundle_seg on it with the demo bundle, check it against truth.

    python -m medserve.demo [--out output/demo]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from medserve.demo.phantom import dice
from medserve.demo.study import write_demo_study
from medserve.writers.nifti import read_label_map

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "apps" / "bundle_seg" / "app.py"
DEMO_BUNDLE = REPO / "bundles" / "demo_organ_seg"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "output" / "demo")
    args = parser.parse_args(argv)
    study = args.out / "study"
    shutil.rmtree(study, ignore_errors=True)
    written, phantom = write_demo_study(study)
    print(f"demo study: {len(written.paths)} CT slices in {study}")
    command = [sys.executable, str(APP), "-i", str(study), "-o", str(args.out), "-m", str(DEMO_BUNDLE)]
    print("$ " + " ".join(str(Path(c).relative_to(REPO)) if c.startswith(str(REPO)) else c for c in command))
    completed = subprocess.run(command)
    if completed.returncode != 0:
        return completed.returncode
    labels = read_label_map(args.out / "labels.nii.gz")
    print(f"Dice against the phantom's truth: {dice(labels, phantom.organ):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
