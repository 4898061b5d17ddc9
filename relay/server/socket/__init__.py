"""The worker WebSocket endpoint (SPEC §4): ``consumer`` (``/v1/worker/connect``) and
``rejecting`` (every other WebSocket path)."""
