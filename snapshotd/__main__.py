"""``python -m snapshotd``: the ``snapshotd`` command."""

import sys

from snapshotd.cli import main

sys.exit(main())
