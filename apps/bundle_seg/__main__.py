import sys

from medserve.stopping import block_stop_signals

block_stop_signals()  # before app imports torch, Holoscan and the SDK, which start threads (see medserve.stopping)

from app import main  # noqa: E402

sys.exit(main())
