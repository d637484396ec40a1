"""``python -m batchline``: the same as the ``batchline`` command."""

import sys

from batchline.cli import main

sys.exit(main())
