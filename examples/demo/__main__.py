"""``python -m examples.demo``: run the walk-through; exit 0 when every check passed."""

from examples.demo.script import main

raise SystemExit(main())
