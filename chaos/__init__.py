"""ModelRelay under staged faults, and a fuzzer (``make chaos``); see docs/RELIABILITY.md."""
