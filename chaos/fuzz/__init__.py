"""Hostile peers for the fuzz scenario: mutated worker frames, malformed HTTP requests."""
