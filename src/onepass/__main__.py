"""``python -m onepass`` is the ``onepass`` command."""

import sys

from onepass.cli import main

sys.exit(main())
