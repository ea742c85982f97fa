"""Data parallelism by hand on ``torch.distributed``: the DDP family, ZeRO-1, ZeRO-2 and FSDP.

Model code never imports this package; these wrappers are applied to a model from outside (``interface``: what
the trainer needs of every data-parallel mode).
"""

from torch_impl.distributed.ddp import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP
from torch_impl.distributed.fsdp import FSDP
from torch_impl.distributed.interface import DataParallelWrapper, SingleProcess, TorchDDP
from torch_impl.distributed.process_group import DistributedContext, distributed_context, init_distributed
from torch_impl.distributed.zero import ShardedOptimizer
from torch_impl.distributed.zero2 import ZeRO2

__all__ = ["DDPBucketed", "DDPIndividualParameters", "DataParallelWrapper", "DistributedContext", "FSDP", "FlatDDP",
           "NaiveDDP", "ShardedOptimizer", "SingleProcess", "TorchDDP", "ZeRO2", "distributed_context",
           "init_distributed"]
