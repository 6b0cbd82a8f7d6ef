import sys

from plugins.http.cli import main

sys.exit(main())
