"""Suite-wide settings."""

from __future__ import annotations

import os

from snapshotd.bench.warm import WARM_ENV

# the harnesses fork their rank processes from a server that imported torch once (the stories start dozens; see
# snapshotd.bench.warm); a value in the environment wins, 0 starts every process cold
os.environ.setdefault(WARM_ENV, "1")
