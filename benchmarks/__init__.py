"""taskdedup benchmarks: ``make bench`` (``python -m benchmarks``)."""
