"""Process groups from torchrun's environment: NCCL on GPUs, gloo on CPUs, always with a timeout.

``with distributed_context() as ctx:`` reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (set by
``torchrun``, single node or multi-node with the usual rendezvous flags) and GROUP_RANK (torchrun's node rank,
``ctx.node_rank``; ``ctx.host`` names the host, for the records), picks the backend and the device
(``cuda:LOCAL_RANK`` when CUDA is available, else CPU), initializes the default group with a timeout, and
destroys it on exit. A rank that fails or never arrives makes the others' collectives raise after the
timeout instead of hanging the job; the exception names the rank and the timeout. Asking for CUDA without it
is a ValueError, and an address that cannot be listened on (a port in use) a ``ConnectionError`` naming it.

Under ``torchrun --max-restarts N`` (N > 0) with its default shared store (``TORCHELASTIC_USE_AGENT_STORE=True``),
rank 0 warns on stderr: the launcher keeps one TCPStore across restarts and the workers use it unprefixed, so a
restarted group can read the dead attempt's addresses (measured here on gloo, torch 2.13: 4 restarts of 6 failed
to connect or hung in connectFullMesh; pytorch/pytorch#135712). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the
launcher's environment gives each attempt a fresh store on rank 0 (8 of 8 restarts ran).

On NCCL a timed-out collective is caught by the group's watchdog thread, which then waits four times
``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (15 s by default: a minute) for the ranks' debug dumps before it ends the
process: ``init_distributed`` sets it to ``NCCL_DUMP_WAIT_MS`` unless the environment does, so a job whose rank died
ends seconds after the timeout (the stack of the failed collective is still logged).

Without torchrun's variables it runs as a single process (world size 1), so the same script runs alone.

``comm_group(sms)``: a group over the same ranks whose NCCL kernels occupy at most ``sms`` SMs, for collectives
that run beside compute (``torch_impl.distributed.ddp``'s ``comm_sms``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
_timeout_s = {"default": DEFAULT_TIMEOUT_S}  # the default group's, for the groups made beside it
_comm_groups: dict[tuple[int, int], dist.ProcessGroup] = {}


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    node_rank: int = 0  # torchrun's GROUP_RANK: which node (launcher) of a multi-node job this rank runs on
    host: str = field(default_factory=socket.gethostname)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def placement(self) -> dict[str, str | int]:
        """Where this rank runs, for the records (``rank_placement``)."""
        return rank_placement(self.node_rank, self.local_rank, self.host)


def rank_placement(node_rank: int = 0, local_rank: int = 0, host: str | None = None) -> dict[str, str | int]:
    """Where a rank runs, for the records: its host (this one's by default), its node's rank and its local rank; the
    defaults describe a single process."""
    return {"host": host or socket.gethostname(), "node_rank": node_rank, "local_rank": local_rank}


def free_port() -> int:
    """A TCP port free on this host now: MASTER_PORT (torchrun's --master_port) of a one-machine group."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (TORCHELASTIC_RESTART_COUNT; 0 without torchrun)."""
    count = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    if count < 0:
        raise ValueError(f"TORCHELASTIC_RESTART_COUNT={count} is not a count")
    return count


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


NCCL_DUMP_WAIT_MS = 1000  # TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC unless set: the watchdog ends the process 4x this
# after it catches a timed-out collective (torch's default 15 s, a minute in all)


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                     device: str | None = None) -> DistributedContext:
    """Initialize the default process group from torchrun's environment (see the module docstring).

    ``backend``: "nccl" or "gloo" (default: nccl if CUDA is available, else gloo). ``device``: "cpu" forces
    the CPU (and gloo). ``timeout_s`` bounds every collective, so a missing rank ends the job with an error.
    """
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    if device is not None and device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available; accepted here: cpu")
    use_cuda = torch.cuda.is_available() and device != "cpu"
    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend {backend!r}; accepted: nccl, gloo")
    if backend == "nccl" and not use_cuda:
        raise ValueError("backend nccl needs CUDA devices; use gloo on CPUs")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0")
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        if rank == 0 and _env_int("TORCHELASTIC_MAX_RESTARTS", 0) > 0 \
                and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            print("warning: torchrun --max-restarts with its shared TCPStore: a restarted group may read the previous "
                  "attempt's addresses (pytorch#135712); launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
                  file=sys.stderr, flush=True)
        _timeout_s["default"] = timeout_s
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        if backend == "nccl":  # read by the group's watchdog when the group is made
            os.environ.setdefault("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", str(NCCL_DUMP_WAIT_MS))
        try:
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        except dist.DistNetworkError as err:  # e.g. the port is taken: name it and say what to do
            address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            raise ConnectionError(f"cannot start the process group at {address} (MASTER_ADDR:MASTER_PORT): "
                                  f"{str(err).split('message: ')[-1].strip()}; pick a free port with MASTER_PORT "
                                  "or torchrun --master-port") from None
    return DistributedContext(rank, world_size, local_rank, dev, backend, _env_int("GROUP_RANK", 0))


# The dtypes NCCL averages inside the collective (ReduceOp.AVG, as FSDP2 does for them): no division pass. fp16 (its
# sum could overflow first) and gloo (no AVG) are divided by the caller. Not PREMUL_SUM(1/N): torch 2.11 hands NCCL
# a bf16 factor that reads as zero for powers of two (pytorch/pytorch#190745).
NCCL_AVERAGED = (torch.float32, torch.bfloat16)

# The flat collectives: torch 2.13 renames them (and warns on the old names); torch 2.11 only has the old ones.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_timeout_s() -> float:
    """The default group's timeout in seconds (``init_distributed``'s ``timeout_s``), for waits outside collectives."""
    return _timeout_s["default"]


def nccl_averages(nccl: bool, dtype: torch.dtype) -> bool:
    """Whether a mean over the ranks of a ``dtype`` tensor is NCCL's ``ReduceOp.AVG`` (``nccl``: the group's backend
    is NCCL), else a sum and a division by the caller."""
    return nccl and dtype in NCCL_AVERAGED


def comm_group(sms: int, process_group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """A process group over the ranks of ``process_group`` (None: the default group) whose NCCL kernels run on at
    most ``sms`` thread blocks, so at most ``sms`` SMs (NCCL's ``maxCTAs``; by default NCCL takes 24 of an H100's
    132 for an all-reduce over NVLink). Made once per (group, sms) on every rank alike, with the default group's
    timeout; a non-NCCL group is returned as it is (gloo runs on the host: no SMs to leave free). Reference: the
    NCCL documentation, ``ncclConfig_t`` (maxCTAs)."""
    if sms < 1:
        raise ValueError(f"sms={sms}: an NCCL communicator needs at least 1 thread block")
    if dist.get_backend(process_group) != "nccl":
        return process_group
    key = (id(process_group), sms)
    if key not in _comm_groups:
        timeout = datetime.timedelta(seconds=_timeout_s["default"])
        options = dist.ProcessGroupNCCL.Options()
        options.config.max_ctas = sms
        options._timeout = timeout  # the same as new_group's, or torch warns that one overrides the other
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        _comm_groups[key] = dist.new_group(ranks, timeout=timeout, backend="nccl", pg_options=options)
    return _comm_groups[key]


@contextlib.contextmanager
def distributed_context(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                        device: str | None = None) -> Iterator[DistributedContext]:
    """``init_distributed`` for the duration of a ``with`` block; the group is destroyed on the way out."""
    ctx = init_distributed(backend, timeout_s, device)
    try:
        yield ctx
    finally:
        _comm_groups.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
