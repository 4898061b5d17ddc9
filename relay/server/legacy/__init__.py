"""The older broker's nodes and clients (SPEC §12): ``nodes`` (the ``/ws`` node socket)
and ``oldapi`` (``POST /api/chat``)."""
