import sys

from truespec.entrypoints.cli import main

sys.exit(main())
