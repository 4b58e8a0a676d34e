"""``python -m amanda.cli``: the ``amanda`` command."""

import sys

from amanda.cli import main

sys.exit(main())
