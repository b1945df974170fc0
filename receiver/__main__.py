"""``python -m receiver`` is ``nopoll``."""

import sys

from receiver.cli import main

sys.exit(main())
