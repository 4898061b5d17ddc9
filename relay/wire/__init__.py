"""The wire format the server and the worker share.

``protocol`` (the typed worker <-> server messages), ``errors`` (the one error tree
and its HTTP envelopes), ``sse`` (the error events the relay writes into streams),
``headers`` (which headers cross the relay), ``http1`` (HTTP/1.1 responses read with
llhttp, by the worker from its backend and by the server from another process),
``logrecord`` (the log line formats, ``LOG_FORMAT``) and ``telemetry`` (whether
``OTEL_*`` turns tracing on, and the SDK's set-up, imported only then). Shipped to GPU
boxes with the worker.

May import: the standard library, ``msgspec`` and ``httptools`` (and OpenTelemetry, by
name, when tracing is on); nothing else of ours (``relay`` for its version only) and
never Django.
"""
