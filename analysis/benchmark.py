"""Old name of ``analysis.harness`` (the benchmark harness), kept for one release: import ``analysis.harness``."""

from analysis.harness import *  # noqa: F401,F403
