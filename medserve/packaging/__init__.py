"""MONAI Application Package (MAP) tooling: build, push, inspect and run MAPs with or without a Docker engine.

The image layout, manifests, environment and entrypoint follow what holoscan-cli 4.2 (`monai-deploy package`)
produces, so a MAP built here runs wherever an official one does, and the other way round.
"""
