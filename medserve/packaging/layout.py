"""The MAP layout holoscan-cli 4.2 writes (holoscan_cli/common/constants.py, DefaultValues); kept identical."""

from __future__ import annotations

API_VERSION = "1.0.0"
APP_DIR = "/opt/holoscan/app"
LIB_DIR = "/opt/holoscan/lib"
MODELS_DIR = "/opt/holoscan/models/"
DOCS_DIR = "/opt/holoscan/docs"
WORK_DIR = "/var/holoscan/"
INPUT_DIR = "input/"  # relative to WORK_DIR, as in the official app.json
OUTPUT_DIR = "output/"
FULL_INPUT_PATH = "/var/holoscan/input"
FULL_OUTPUT_PATH = "/var/holoscan/output"
LOGS_DIR = "/var/holoscan/logs"
CONFIG_PATH = "/var/holoscan/app.yaml"
APP_MANIFEST_PATH = "/etc/holoscan/app.json"
PKG_MANIFEST_PATH = "/etc/holoscan/pkg.json"
TOOLS_PATH = "/var/holoscan/tools"
EXPORT_ROOT = "/var/run/holoscan/export"
TIMEOUT = 0
# Not part of the official layout: where medserve puts the Python environment (the official image uses
# `pip install --user` into the holoscan user's home, which ties the image to one UID).
VENV_DIR = "/opt/holoscan/venv"
PYTHON_EXECUTABLE = "python3"
DEFAULT_BASE_IMAGE = "localhost/medserve-base:bookworm"
