"""ModelRelay's relay core and its thin Django/Channels edges.

Importing this package (or any core module: ``config``, ``protocol``, ``errors``,
``registry``, ``dispatch``, ``sse``, ``ratelimit``, ``stats``, ``credentials``)
never imports Django, so ``worker.py`` and the core tests run without it.
"""

__version__ = "0.1.0"
