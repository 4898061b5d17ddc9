"""Tests of relay.worker."""
