"""The chaos soak (issue 11): taskdedup on Celery under worker kills, store and broker faults.

``python -m chaos [--seconds N] [--short]`` (or ``make chaos``) runs it and prints the
invariants with counts; see chaos/run.py for what happens and chaos/check.py for the checks.
"""
