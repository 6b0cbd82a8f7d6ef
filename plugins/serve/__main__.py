import sys

from plugins.serve.cli import main

sys.exit(main())
