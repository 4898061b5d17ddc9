"""Tests of relay.server."""
