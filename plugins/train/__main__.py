import sys

from plugins.train.cli import main

sys.exit(main())
