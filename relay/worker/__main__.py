"""``python -m relay.worker``: the worker program, as ``worker.py`` and ``modelrelay-worker``."""

from __future__ import annotations

import sys

from relay.worker.daemon import main

if __name__ == "__main__":
    sys.exit(main())
