"""``python -m onepass`` is the ``onepass`` command."""

import sys

from .cli import main

sys.exit(main())
