"""Train the demo bundle's network on generated phantoms and record its Dice on fresh ones.

`make train-demo` (python -m medserve.demo.train [--bundle DIR]) rewrites `models/model.pt` and the
`eval_metrics` of `configs/metadata.json`. Training data are phantoms with seeds 1000+; the evaluation uses
seeds 5000+, which neither training nor the demo study (seed 2026) use.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from monai.losses import DiceCELoss
from rich.progress import Progress

from medserve.bundle.predictor import BundlePredictor
from medserve.demo.phantom import Phantom, dice, make_phantom
from medserve.demo.study import SeriesGeometry

DEMO_BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "demo_organ_seg"
TRAIN_SEEDS = range(1000, 1064)
EVAL_SEEDS = range(5000, 5010)


def phantom_volume(phantom: Phantom):
    import highdicom as hd

    geometry = SeriesGeometry(pixel_spacing=phantom.spacing[1:], slice_spacing=phantom.spacing[0])
    return hd.Volume(array=phantom.hu, affine=geometry.affine(), coordinate_system="PATIENT")


def training_pair(predictor: BundlePredictor, phantom: Phantom) -> tuple[torch.Tensor, torch.Tensor]:
    """Image through the bundle's own preprocessing; the truth through the same resampling (nearest)."""
    volume = phantom_volume(phantom)
    image = predictor.preprocess(volume).as_tensor()
    truth = predictor.preprocess(volume.with_array(phantom.organ.astype(np.float32) * 500.0 - 200.0))
    return image, (truth.as_tensor() > 0.5).float()


def evaluate(predictor: BundlePredictor, seeds=EVAL_SEEDS) -> float:
    scores = [dice(predictor.predict(phantom_volume(p)), p.organ) for p in (make_phantom(seed=s) for s in seeds)]
    return float(np.mean(scores))


def train(bundle: Path, iterations: int, seed: int = 0) -> float:
    torch.manual_seed(seed)
    weights = bundle / "models" / "model.pt"
    if not weights.exists():
        from monai.bundle import ConfigParser

        parser = ConfigParser()
        parser.read_config(str(bundle / "configs" / "inference.json"))
        torch.save(parser.get_parsed_content("network_def").state_dict(), weights)
    predictor = BundlePredictor.from_dir(bundle, device="cpu")
    pairs = [training_pair(predictor, make_phantom(seed=s)) for s in TRAIN_SEEDS]
    network = predictor.network.train()
    loss_function = DiceCELoss(to_onehot_y=True, softmax=True)
    optimiser = torch.optim.Adam(network.parameters(), lr=3e-3)
    generator = np.random.default_rng(seed)
    with Progress() as progress:
        task = progress.add_task("training", total=iterations)
        for _ in range(iterations):
            batch = generator.choice(len(pairs), size=2, replace=False)
            images = torch.stack([pairs[i][0] for i in batch])
            truths = torch.stack([pairs[i][1] for i in batch])
            optimiser.zero_grad()
            loss = loss_function(network(images), truths)
            loss.backward()
            optimiser.step()
            progress.update(task, advance=1, description=f"training (loss {loss.item():.3f})")
    network.eval()
    torch.save(network.state_dict(), weights)
    mean_dice = evaluate(BundlePredictor.from_dir(bundle, device="cpu"))
    metadata_path = bundle / "configs" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["eval_metrics"] = {"mean_dice": round(mean_dice, 4)}
    metadata_path.write_text(json.dumps(metadata, indent=4) + "\n")
    return mean_dice


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=DEMO_BUNDLE)
    parser.add_argument("--iterations", type=int, default=400)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    mean_dice = train(args.bundle, args.iterations)
    print(f"mean Dice on {len(EVAL_SEEDS)} fresh phantoms: {mean_dice:.4f} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
