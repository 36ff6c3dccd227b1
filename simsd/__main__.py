"""``python -m simsd ...``: the ``simsd`` command line."""
import sys

from simsd.entrypoints.cli import main

sys.exit(main())
