"""Old name of ``torch_impl.activation_checkpointing`` (activation checkpointing, i.e. recomputation), kept as a
re-export for one release: import from ``torch_impl.activation_checkpointing`` instead. Not to be confused with
``torch_impl.checkpoint`` (saving and loading training state).
"""

from torch_impl.activation_checkpointing import *  # noqa: F401,F403
from torch_impl.activation_checkpointing import (  # noqa: F401  (explicit, for readers and type checkers)
    CheckpointedSegment,
    __all__,
    apply_activation_checkpointing,
)
