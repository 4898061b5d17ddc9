"""Tests of relay.wire."""
