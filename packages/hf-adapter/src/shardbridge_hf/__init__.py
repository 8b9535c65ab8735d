"""Adapter package (see the README beside src/)."""
