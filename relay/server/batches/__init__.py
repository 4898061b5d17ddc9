"""Batches (SPEC §16): the OpenAI Files and Batches APIs and Anthropic's Message
Batches, run on idle capacity.

``api`` (the HTTP routes, served by the fast path), ``upload`` (reading a multipart
upload), ``files`` (uploads in the database, bounded per owner), ``lines`` (checking
a batch's input), ``checker`` (the process those checks run in), ``shapes`` (the
objects and result lines in each API's format), ``store`` (the routes' database
work), ``claims`` (the engine's database work: claiming lines, writing results,
ending batches), ``engine`` (running the lines as ``flex`` requests of their keys)
and ``db`` (the threads the database work runs in).

Files, batches and line states live in the database (the ``batches`` app): a server
killed mid-batch resumes where it was, and several processes share the work through
claims that expire. May import the runtime, the store, the fast path's request
helpers and cluster mode; only the runtime (which starts the engine) and the fast
path (which routes the paths here) import it.
"""
