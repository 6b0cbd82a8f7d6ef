#!/usr/bin/env python
"""Benchmark prefix caching on the completions server: see `plugins/bench/prefix.py` (also
`python -m plugins.bench.prefix`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plugins.bench.prefix import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
