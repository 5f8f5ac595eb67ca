"""MONAI bundles: layout checks (`layout`, no torch needed) and the hot, reusable predictor (`predictor`)."""
