import sys

from plugins.bench.cli import main

sys.exit(main())
