"""ModelRelay worker: puts one GPU box's inference server behind a ModelRelay relay.

The thin entry point of a checkout (and of ``/setup/worker.pyz``, whose
``__main__.py`` it is); the program itself is :mod:`relay.worker.daemon`. Installed as
a package, the same program is the ``modelrelay-worker`` command (``pip install`` the
wheel the relay serves at ``/setup``, or ``make worker-wheel``); ``python -m
relay.worker`` runs it too. Next to this file it needs ``relay/__init__.py``,
``relay/wire/`` and ``relay/worker/`` (none of them imports Django) and the packages
of ``requirements-worker.txt``.

Run::

    modelrelay-worker --proxy-url https://relay.example.com --join-token mrj_…

or, with the provider's shared secret in the environment rather than on the command
line (where ``ps`` and the shell history would show it)::

    WORKER_SECRET=mrw_… python worker.py --proxy-url https://relay.example.com

Every flag has an environment variable (see ``--help`` and ``docs/WORKER.md``).
"""

from __future__ import annotations

import sys

# Worker and Backoff are importable from here for scripts written against worker.py.
from relay.worker.daemon import Backoff, Worker, main

__all__ = ["Backoff", "Worker", "main"]

if __name__ == "__main__":
    sys.exit(main())
