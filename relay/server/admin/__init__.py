"""The admin JSON API (``/admin/*``, SPEC §8): ``api`` (the routes) and ``errors`` (JSON
404/405 under ``/admin/`` instead of Django's pages)."""
