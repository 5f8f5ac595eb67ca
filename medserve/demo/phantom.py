"""CT-like phantoms with a known organ: the demo study, the demo bundle's training data and test truth.

A phantom is an elliptic body (fat and muscle layers, a bone ring) in air, with an organ-like ellipsoid placed
off-centre towards the patient's left, so that a left-right or head-feet flip of a result shows up as a poor
overlap with the truth. Values are Hounsfield units with noise, as a scanner would give.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

AIR_HU, FAT_HU, MUSCLE_HU, ORGAN_HU, BONE_HU = -1000.0, -90.0, 45.0, 140.0, 700.0


@dataclass(frozen=True)
class Phantom:
    """`hu` and `organ` are indexed (slice, row, column); `spacing` is (slice, row, column) in mm."""

    hu: np.ndarray
    organ: np.ndarray
    spacing: tuple[float, float, float]


def dice(prediction: np.ndarray, truth: np.ndarray) -> float:
    """Dice overlap of the non-zero voxels of two label maps."""
    prediction, truth = prediction > 0, truth > 0
    return float(2.0 * np.logical_and(prediction, truth).sum() / max(prediction.sum() + truth.sum(), 1))


def make_phantom(shape: tuple[int, int, int] = (48, 96, 96), spacing: tuple[float, float, float] = (3.0, 3.0, 3.0),
                 seed: int = 0, noise_hu: float = 15.0, bone: bool = True) -> Phantom:
    """A random phantom: body and organ sizes, positions and noise are drawn from `seed`.

    Without `bone`, the organ is the only structure above muscle density (thin bright rings widen under any
    resampling, which geometry tests comparing against a threshold must avoid)."""
    rng = np.random.default_rng(seed)
    slices, rows, columns = shape
    z, y, x = np.meshgrid(*(np.arange(n) * s for n, s in zip(shape, spacing)), indexing="ij")
    centre = np.array([slices * spacing[0], rows * spacing[1], columns * spacing[2]]) / 2
    z, y, x = z - centre[0], y - centre[1], x - centre[2]

    half_width = columns * spacing[2] * rng.uniform(0.36, 0.46)
    half_depth = rows * spacing[1] * rng.uniform(0.28, 0.38)
    body = (x / half_width) ** 2 + (y / half_depth) ** 2
    hu = np.full(shape, AIR_HU, dtype=np.float32)
    hu[body <= 1.0] = FAT_HU
    hu[body <= 0.8] = MUSCLE_HU
    if bone:
        hu[(body > 0.6) & (body <= 0.68)] = BONE_HU

    # Column index grows towards the patient's left in an axial image, so +x is left.
    organ_centre = np.array([
        rng.uniform(-0.15, 0.15) * slices * spacing[0],
        rng.uniform(-0.2, 0.2) * half_depth,
        rng.uniform(0.25, 0.45) * half_width,
    ])
    radii = np.array([rng.uniform(0.22, 0.32) * slices * spacing[0],
                      rng.uniform(0.25, 0.4) * half_depth,
                      rng.uniform(0.18, 0.28) * half_width])
    organ = (((z - organ_centre[0]) / radii[0]) ** 2 + ((y - organ_centre[1]) / radii[1]) ** 2
             + ((x - organ_centre[2]) / radii[2]) ** 2) <= 1.0
    organ &= body <= 0.6
    hu[organ] = ORGAN_HU + rng.normal(0.0, 5.0)
    hu += rng.normal(0.0, noise_hu, size=shape).astype(np.float32)
    # Scanners store nothing below -1024 HU (stored value 0 with the usual rescale intercept).
    np.maximum(hu, -1024.0, out=hu)
    return Phantom(hu=hu, organ=organ.astype(np.uint8), spacing=spacing)
