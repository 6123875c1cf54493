"""Suite-wide settings."""

from __future__ import annotations

import os

from snapshotd.bench.warm import WARM_ENV

# the harnesses start their rank processes from interpreters started ahead with torch imported (the stories start
# dozens; see snapshotd.bench.warm); a value in the environment wins, 0 starts every process cold
os.environ.setdefault(WARM_ENV, "4")
