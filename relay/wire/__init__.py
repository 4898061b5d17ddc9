"""The wire format the server and the worker share.

``protocol`` (the typed worker <-> server messages), ``errors`` (the one error tree
and its HTTP envelopes), ``sse`` (the error events the relay writes into streams),
``headers`` (which headers cross the relay) and ``logrecord`` (the log line formats,
``LOG_FORMAT``). Shipped to GPU boxes with the worker.

May import: the standard library and ``msgspec``; nothing else of ours (``relay`` for
its version only) and never Django.
"""
