import sys

from plugins.fleet.cli import main

sys.exit(main())
