"""Tests of relay.core."""
