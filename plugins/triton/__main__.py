import sys

from plugins.triton.cli import main

sys.exit(main())
