"""The store contract (taskdedup.testing.contract) on the memory store, on Redis and on a SQLite
store written on the record seam: the ``h`` fixture in conftest.py gives each scenario its
harness and checks afterwards that every record it wrote expires (G9)."""

from taskdedup.testing.contract import *  # noqa: F403
