import sys
from pathlib import Path

from medserve.home import ensure_writable_home
from medserve.stopping import block_stop_signals

block_stop_signals()  # before app imports torch, Holoscan and the SDK, which start threads (see medserve.stopping)
ensure_writable_home()  # a MAP may run under any UID (see medserve.home)

# `python apps/bundle_seg` puts this folder on sys.path; `python -m apps.bundle_seg` the working directory only.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from app import main  # noqa: E402

sys.exit(main())
