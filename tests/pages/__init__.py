"""Tests of relay.pages."""
