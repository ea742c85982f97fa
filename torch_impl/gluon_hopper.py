"""The Gluon Hopper calls whose names moved between Triton 3.6 (the GPU image) and 3.7-3.9 (this repo's CPU hosts),
under one name each, for every Gluon kernel here (``attention.flash_gluon``, ``swiglu_gluon``, ``qkv_rope_gluon``)."""

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # TMA's global -> shared copy
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global  # shared -> global
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # the warps' barrier: 3.6's name, then 3.9's
