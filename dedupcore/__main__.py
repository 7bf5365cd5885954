"""``python -m dedupcore``: the same as the ``dedupcore`` command."""

import sys

from dedupcore.cli import main

sys.exit(main())
