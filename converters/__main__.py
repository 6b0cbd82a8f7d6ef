import sys

from converters.cli import main

sys.exit(main())
