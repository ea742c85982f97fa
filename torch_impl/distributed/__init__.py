"""Data parallelism by hand on ``torch.distributed``: the DDP family, ZeRO-1 and FSDP.

Model code never imports this package; these wrappers are applied to a model from outside.
"""

from torch_impl.distributed.process_group import DistributedContext, distributed_context, init_distributed

__all__ = ["DistributedContext", "distributed_context", "init_distributed"]
