"""The demo bundle's documented quality: the Dice recorded in its metadata holds on the fresh phantoms it names."""

from __future__ import annotations

import json

import pytest

from medserve.bundle.predictor import BundlePredictor
from medserve.demo.train import DEMO_BUNDLE, EVAL_SEEDS, evaluate


def test_the_documented_dice_on_fresh_phantoms_is_what_the_bundle_gives_and_at_least_0_9():
    documented = json.loads((DEMO_BUNDLE / "configs" / "metadata.json").read_text())["eval_metrics"]["mean_dice"]
    measured = evaluate(BundlePredictor.from_dir(DEMO_BUNDLE, device="cpu"), EVAL_SEEDS)
    assert measured >= 0.9
    assert measured == pytest.approx(documented, abs=0.005)
