#!/usr/bin/env python
"""Create a seeded HF checkpoint from a model config: see `plugins/train/make_checkpoint.py` (also
`mqa-make-checkpoint` and `python -m plugins.train.make_checkpoint`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plugins.train.make_checkpoint import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
