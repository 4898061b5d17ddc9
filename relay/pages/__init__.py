"""The people-facing pages: ``dashboard`` (live view of workers and traffic), ``wizard``
(connect a new GPU box step by step), ``recipes`` (what the wizard tells people to
type) and ``bundle`` (the worker as one ``worker.pyz`` file).

May import: :mod:`relay.server`, :mod:`relay.core`, :mod:`relay.wire` and Django;
never :mod:`relay.worker` (``bundle`` reads the worker's files, it does not import them).
"""
