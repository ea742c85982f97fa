# AOT ID: ['2_backward']
from ctypes import c_void_p, c_long, c_int
import torch
import math
import random
import os
import tempfile
from math import inf, nan
from cmath import nanj
from torch._inductor.hooks import run_intermediate_hooks
from torch._inductor.utils import maybe_profile
from torch._inductor.codegen.memory_planning import _align as align
from torch import device, empty_strided
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.select_algorithm import extern_kernels
import triton
import triton.language as tl
from torch._inductor.runtime.triton_heuristics import start_graph, end_graph
from torch._C import _cuda_getCurrentRawStream as get_raw_stream

aten = torch.ops.aten
inductor_ops = torch.ops.inductor
_quantized = torch.ops._quantized
assert_size_stride = torch._C._dynamo.guards.assert_size_stride
assert_alignment = torch._C._dynamo.guards.assert_alignment
empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
empty_strided_cpu_pinned = torch._C._dynamo.guards._empty_strided_cpu_pinned
empty_strided_cuda = torch._C._dynamo.guards._empty_strided_cuda
empty_strided_xpu = torch._C._dynamo.guards._empty_strided_xpu
empty_strided_mtia = torch._C._dynamo.guards._empty_strided_mtia
reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
alloc_from_pool = torch.ops.inductor._alloc_from_pool
async_compile = AsyncCompile()
empty_strided_p2p = torch._C._distributed_c10d._SymmetricMemory.empty_strided_p2p


# kernel path: /tmp/inductor_cat_slices_g2c53keh/e7/ce7rgr7tcjd2vjlb4su6exrmddzlarqpkysyxzlvkiv7aehddetm.py
# Topologically Sorted Source Nodes: [view_19, linear_2, silu, mul_13, linear_3, mul_14, convert_element_type_26, reciprocal, mul_15, mul_16, sub_2, mul_17, add_8, mul_18, convert_element_type_28], Original ATen: [aten.view, aten._unsafe_view, aten.silu, aten.mul, aten.silu_backward]
# Source node to ATen node mapping:
#   add_8 => add_8
#   convert_element_type_26 => convert_element_type_26
#   convert_element_type_28 => convert_element_type_28
#   linear_2 => view_13
#   linear_3 => view_15
#   mul_13 => mul_13
#   mul_14 => mul_14
#   mul_15 => mul_15
#   mul_16 => mul_16
#   mul_17 => mul_17
#   mul_18 => mul_18
#   reciprocal => reciprocal
#   silu => add_5, convert_element_type_12, convert_element_type_13, div, exp, neg
#   sub_2 => sub_2
#   view_19 => view_19
# Graph fragment:
#   %mm_6 : Tensor "bf16[8192, 6400][6400, 1]cuda:0" = PlaceHolder[target=mm_6]
#   %mm_2 : Tensor "bf16[8192, 6400][6400, 1]cuda:0" = PlaceHolder[target=mm_2]
#   %mm_3 : Tensor "bf16[8192, 6400][6400, 1]cuda:0" = PlaceHolder[target=mm_3]
#   %view_19 : Tensor "bf16[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_6, [4, 2048, 6400]), kwargs = {})
#   %view_13 : Tensor "bf16[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_2, [4, 2048, 6400]), kwargs = {})
#   %convert_element_type_12 : Tensor "f32[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=3] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%view_13, torch.float32), kwargs = {})
#   %neg : Tensor "f32[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.neg.default](args = (%convert_element_type_12,), kwargs = {})
#   %exp : Tensor "f32[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.exp.default](args = (%neg,), kwargs = {})
#   %add_5 : Tensor "f32[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.add.Tensor](args = (%exp, 1), kwargs = {})
#   %div : Tensor "f32[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.div.Tensor](args = (%convert_element_type_12, %add_5), kwargs = {})
#   %convert_element_type_13 : Tensor "bf16[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%div, torch.bfloat16), kwargs = {})
#   %mul_13 : Tensor "bf16[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%view_19, %convert_element_type_13), kwargs = {})
#   %view_15 : Tensor "bf16[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_3, [4, 2048, 6400]), kwargs = {})
#   %mul_14 : Tensor "bf16[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%view_19, %view_15), kwargs = {})
#   %convert_element_type_26 : Tensor "f32[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mul_14, torch.float32), kwargs = {})
#   %reciprocal : Tensor "f32[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reciprocal.default](args = (%add_5,), kwargs = {})
#   %mul_15 : Tensor "f32[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.mul.Tensor](args = (%reciprocal, 1), kwargs = {})
#   %mul_16 : Tensor "f32[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type_26, %mul_15), kwargs = {})
#   %sub_2 : Tensor "f32[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sub.Tensor](args = (1, %mul_15), kwargs = {})
#   %mul_17 : Tensor "f32[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type_12, %sub_2), kwargs = {})
#   %add_8 : Tensor "f32[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mul_17, 1), kwargs = {})
#   %mul_18 : Tensor "f32[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul_16, %add_8), kwargs = {})
#   %convert_element_type_28 : Tensor "bf16[4, 2048, 6400][13107200, 6400, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mul_18, torch.bfloat16), kwargs = {})
#   return %mul_13,%convert_element_type_28
triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_0 = async_compile.triton('triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_0', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 67108864}, 
    filename=__file__,
    triton_meta={'signature': {'in_out_ptr0': '*bf16', 'in_ptr0': '*bf16', 'in_ptr1': '*bf16', 'out_ptr0': '*bf16', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_0', 'mutated_arg_names': ['in_out_ptr0'], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 3, 'num_store': 2, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 734003200}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_0(in_out_ptr0, in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 52428800
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = tl.full([XBLOCK], True, tl.int1)[:]
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (x0), None).to(tl.float32)
    tmp1 = tl.load(in_ptr1 + (x0), None).to(tl.float32)
    tmp10 = tl.load(in_out_ptr0 + (x0), None).to(tl.float32)
    tmp2 = tmp1.to(tl.float32)
    tmp3 = -tmp2
    tmp4 = libdevice.exp(tmp3)
    tmp5 = tl.full([1], 1.0, tl.float32)
    tmp6 = tmp4 + tmp5
    tmp7 = (tmp2 / tmp6)
    tmp8 = tmp7.to(tl.float32)
    tmp9 = tmp0 * tmp8
    tmp11 = tmp0 * tmp10
    tmp12 = tmp11.to(tl.float32)
    tmp13 = tl.full([1], 1, tl.int32)
    tmp14 = (tmp13 / tmp6)
    tmp15 = tmp14 * tmp5
    tmp16 = tmp12 * tmp15
    tmp17 = tmp5 - tmp15
    tmp18 = tmp2 * tmp17
    tmp19 = tmp18 + tmp5
    tmp20 = tmp16 * tmp19
    tmp21 = tmp20.to(tl.float32)
    tl.store(out_ptr0 + (x0), tmp9, None)
    tl.store(in_out_ptr0 + (x0), tmp21, None)
''', device_str='cuda')


# kernel path: /tmp/inductor_cat_slices_g2c53keh/7x/c7xwspnzvcprrty3zxm7cah22t4ais6vce224fkv47v5ea54kiry.py
# Topologically Sorted Source Nodes: [view_21, view_23, add_9, convert_element_type_33, to_4, mul_19, linear_1, x, wide_1, rms_norm_1, mul_21, sum_1, div_1, mul_22, sub_3, mul_23, convert_element_type_35, add_10], Original ATen: [aten.view, aten.add, aten._to_copy, aten._fused_rms_norm_backward, aten._unsafe_view, aten._fused_rms_norm]
# Source node to ATen node mapping:
#   add_10 => add_10
#   add_9 => add_9
#   convert_element_type_33 => convert_element_type_33
#   convert_element_type_35 => convert_element_type_35
#   div_1 => div_1
#   linear_1 => view_11
#   mul_19 => mul_19
#   mul_21 => mul_21
#   mul_22 => mul_22
#   mul_23 => mul_23
#   rms_norm_1 => mul_10
#   sub_3 => sub_3
#   sum_1 => sum_1
#   to_4 => convert_element_type_8
#   view_21 => view_21
#   view_23 => view_23
#   wide_1 => convert_element_type_7
#   x => add_3
# Graph fragment:
#   %primals_1 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0" = PlaceHolder[target=primals_1]
#   %mm_1 : Tensor "bf16[8192, 1600][1600, 1]cuda:0" = PlaceHolder[target=mm_1]
#   %rsqrt_1 : Tensor "f32[4, 2048, 1][2048, 1, 1]cuda:0" = PlaceHolder[target=rsqrt_1]
#   %mm_8 : Tensor "bf16[8192, 1600][1600, 1]cuda:0" = PlaceHolder[target=mm_8]
#   %mm_10 : Tensor "bf16[8192, 1600][1600, 1]cuda:0" = PlaceHolder[target=mm_10]
#   %primals_9 : Tensor "bf16[1600][1]cuda:0" = PlaceHolder[target=primals_9]
#   %tangents_1 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0" = PlaceHolder[target=tangents_1]
#   %sum_1 : Tensor "f32[4, 2048, 1][2048, 1, 8192]cuda:0" = PlaceHolder[target=sum_1]
#   %view_21 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_8, [4, 2048, 1600]), kwargs = {})
#   %view_23 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_10, [4, 2048, 1600]), kwargs = {})
#   %add_9 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%view_21, %view_23), kwargs = {})
#   %convert_element_type_33 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%add_9, torch.float32), kwargs = {})
#   %convert_element_type_8 : Tensor "f32[1600][1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%primals_9, torch.float32), kwargs = {})
#   %mul_19 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type_33, %convert_element_type_8), kwargs = {})
#   %view_11 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_1, [4, 2048, 1600]), kwargs = {})
#   %add_3 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%primals_1, %view_11), kwargs = {})
#   %convert_element_type_7 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%add_3, torch.float32), kwargs = {})
#   %mul_10 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=3] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type_7, %rsqrt_1), kwargs = {})
#   %mul_21 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul_10, %mul_19), kwargs = {})
#   %sum_1 : Tensor "f32[4, 2048, 1][2048, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sum.dim_IntList](args = (%mul_21, [2], True), kwargs = {})
#   %div_1 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.div.Tensor](args = (%mul_10, 1600), kwargs = {})
#   %mul_22 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%div_1, %sum_1), kwargs = {})
#   %sub_3 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sub.Tensor](args = (%mul_19, %mul_22), kwargs = {})
#   %mul_23 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%sub_3, %rsqrt_1), kwargs = {})
#   %convert_element_type_35 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mul_23, torch.bfloat16), kwargs = {})
#   %add_10 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.add.Tensor](args = (%tangents_1, %convert_element_type_35), kwargs = {})
#   return %sum_1,%add_10
triton_red_fused__fused_rms_norm__fused_rms_norm_backward__to_copy__unsafe_view_add_view_1 = async_compile.triton('triton_red_fused__fused_rms_norm__fused_rms_norm_backward__to_copy__unsafe_view_add_view_1', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.reduction(
    size_hints={'x': 8192, 'r0_': 2048},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*bf16', 'in_ptr2': '*fp32', 'in_ptr3': '*bf16', 'in_ptr4': '*bf16', 'in_ptr5': '*bf16', 'in_ptr6': '*bf16', 'out_ptr1': '*bf16', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr', 'R0_BLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]], (7,): [['tt.divisibility', 16]], (8,): [['tt.divisibility', 16]], (9,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_red_fused__fused_rms_norm__fused_rms_norm_backward__to_copy__unsafe_view_add_view_1', 'mutated_arg_names': [], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 12, 'num_store': 1, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 32768, 'r0_': 183504000}}
)
@triton.jit
def triton_red_fused__fused_rms_norm__fused_rms_norm_backward__to_copy__unsafe_view_add_view_1(in_ptr0, in_ptr1, in_ptr2, in_ptr3, in_ptr4, in_ptr5, in_ptr6, out_ptr1, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):
    xnumel = 8192
    r0_numel = 1600
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = tl.full([XBLOCK], True, tl.int1)[:, None]
    r0_base = tl.arange(0, R0_BLOCK)[None, :]
    rbase = r0_base
    x0 = xindex
    tmp4 = tl.load(in_ptr2 + (x0), None, eviction_policy='evict_last')
    _tmp15 = tl.full([XBLOCK, R0_BLOCK], 0, tl.float32)
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = r0_index < r0_numel
        roffset = r0_offset
        rindex = r0_index
        r0_1 = r0_index
        tmp0 = tl.load(in_ptr0 + (r0_1 + 1600*x0), r0_mask, eviction_policy='evict_last', other=0.0).to(tl.float32)
        tmp1 = tl.load(in_ptr1 + (r0_1 + 1600*x0), r0_mask, eviction_policy='evict_last', other=0.0).to(tl.float32)
        tmp6 = tl.load(in_ptr3 + (r0_1 + 1600*x0), r0_mask, eviction_policy='evict_last', other=0.0).to(tl.float32)
        tmp7 = tl.load(in_ptr4 + (r0_1 + 1600*x0), r0_mask, eviction_policy='evict_last', other=0.0).to(tl.float32)
        tmp10 = tl.load(in_ptr5 + (r0_1), r0_mask, eviction_policy='evict_last', other=0.0).to(tl.float32)
        tmp2 = tmp0 + tmp1
        tmp3 = tmp2.to(tl.float32)
        tmp5 = tmp3 * tmp4
        tmp8 = tmp6 + tmp7
        tmp9 = tmp8.to(tl.float32)
        tmp11 = tmp10.to(tl.float32)
        tmp12 = tmp9 * tmp11
        tmp13 = tmp5 * tmp12
        tmp14 = tl.broadcast_to(tmp13, [XBLOCK, R0_BLOCK])
        tmp16 = _tmp15 + tmp14
        _tmp15 = tl.where(r0_mask, tmp16, _tmp15)
    tmp15 = tl.sum(_tmp15, 1)[:, None]
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = r0_index < r0_numel
        roffset = r0_offset
        rindex = r0_index
        r0_1 = r0_index
        tmp17 = tl.load(in_ptr6 + (r0_1 + 1600*x0), r0_mask, eviction_policy='evict_first', other=0.0).to(tl.float32)
        tmp18 = tl.load(in_ptr3 + (r0_1 + 1600*x0), r0_mask, eviction_policy='evict_first', other=0.0).to(tl.float32)
        tmp19 = tl.load(in_ptr4 + (r0_1 + 1600*x0), r0_mask, eviction_policy='evict_first', other=0.0).to(tl.float32)
        tmp22 = tl.load(in_ptr5 + (r0_1), r0_mask, eviction_policy='evict_last', other=0.0).to(tl.float32)
        tmp25 = tl.load(in_ptr0 + (r0_1 + 1600*x0), r0_mask, eviction_policy='evict_first', other=0.0).to(tl.float32)
        tmp26 = tl.load(in_ptr1 + (r0_1 + 1600*x0), r0_mask, eviction_policy='evict_first', other=0.0).to(tl.float32)
        tmp20 = tmp18 + tmp19
        tmp21 = tmp20.to(tl.float32)
        tmp23 = tmp22.to(tl.float32)
        tmp24 = tmp21 * tmp23
        tmp27 = tmp25 + tmp26
        tmp28 = tmp27.to(tl.float32)
        tmp29 = tmp28 * tmp4
        tmp30 = tl.full([1, 1], 0.000625, tl.float32)
        tmp31 = tmp29 * tmp30
        tmp32 = tmp31 * tmp15
        tmp33 = tmp24 - tmp32
        tmp34 = tmp33 * tmp4
        tmp35 = tmp34.to(tl.float32)
        tmp36 = tmp17 + tmp35
        tl.store(out_ptr1 + (r0_1 + 1600*x0), tmp36, r0_mask)
''', device_str='cuda')


# kernel path: /tmp/inductor_cat_slices_g2c53keh/gn/cgnjkkwnz5763tfxy6fjhus7kxbfo7662oauolnyhagrwk2h23ls.py
# Topologically Sorted Source Nodes: [permute_26, permute_27, arg_1, neg, x_even, x_odd, arg, mul, mul_1, sub, mul_2, mul_3, add, stack, rotated, permute_28, view_29, view_30, view_31, cat_5], Original ATen: [aten.transpose, aten.unsqueeze, aten.neg, aten.slice, aten.mul, aten.sub, aten.add, aten.stack, aten.view, aten.cat]
# Source node to ATen node mapping:
#   add => add_11, add_12
#   arg => unsqueeze
#   arg_1 => unsqueeze_1
#   cat_5 => cat_5
#   mul => mul_25, mul_29
#   mul_1 => mul_26, mul_30
#   mul_2 => mul_27, mul_31
#   mul_3 => mul_28, mul_32
#   neg => neg_2
#   permute_26 => permute_26
#   permute_27 => permute_27
#   permute_28 => permute_28
#   rotated => view_27, view_28
#   stack => cat_3, cat_4, unsqueeze_10, unsqueeze_11, unsqueeze_8, unsqueeze_9
#   sub => sub_4, sub_5
#   view_29 => view_29
#   view_30 => view_30
#   view_31 => view_31
#   x_even => slice_11, slice_9
#   x_odd => slice_10, slice_12
# Graph fragment:
#   %getitem_12 : Tensor "bf16[4, 25, 2048, 64][3276800, 64, 1600, 1]cuda:0" = PlaceHolder[target=getitem_12]
#   %primals_6 : Tensor "bf16[2048, 32][32, 1]cuda:0" = PlaceHolder[target=primals_6]
#   %primals_7 : Tensor "bf16[2048, 32][32, 1]cuda:0" = PlaceHolder[target=primals_7]
#   %getitem_13 : Tensor "bf16[4, 25, 2048, 64][3276800, 64, 1600, 1]cuda:0" = PlaceHolder[target=getitem_13]
#   %getitem_14 : Tensor "bf16[4, 25, 2048, 64][3276800, 64, 1600, 1]cuda:0" = PlaceHolder[target=getitem_14]
#   %permute_26 : Tensor "bf16[4, 2048, 25, 64][3276800, 1600, 64, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%getitem_14, [0, 2, 1, 3]), kwargs = {})
#   %permute_27 : Tensor "bf16[4, 2048, 25, 64][3276800, 1600, 64, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.permute.default](args = (%getitem_13, [0, 2, 1, 3]), kwargs = {})
#   %unsqueeze_1 : Tensor "bf16[2048, 1, 32][32, 32, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%primals_7, 1), kwargs = {})
#   %neg_2 : Tensor "bf16[2048, 1, 32][32, 32, 1]cuda:0"[num_users=4] = call_function[target=torch.ops.aten.neg.default](args = (%unsqueeze_1,), kwargs = {})
#   %slice_9 : Tensor "bf16[4, 2048, 25, 32][3276800, 1600, 64, 2]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.slice.Tensor](args = (%permute_27, 3, 0, 9223372036854775807, 2), kwargs = {})
#   %slice_10 : Tensor "bf16[4, 2048, 25, 32][3276800, 1600, 64, 2]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.slice.Tensor](args = (%permute_27, 3, 1, 9223372036854775807, 2), kwargs = {})
#   %unsqueeze : Tensor "bf16[2048, 1, 32][32, 32, 1]cuda:0"[num_users=4] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%primals_6, 1), kwargs = {})
#   %mul_25 : Tensor "bf16[4, 2048, 25, 32][1638400, 800, 32, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%slice_9, %unsqueeze), kwargs = {})
#   %mul_26 : Tensor "bf16[4, 2048, 25, 32][1638400, 800, 32, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%slice_10, %neg_2), kwargs = {})
#   %sub_4 : Tensor "bf16[4, 2048, 25, 32][1638400, 800, 32, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sub.Tensor](args = (%mul_25, %mul_26), kwargs = {})
#   %mul_27 : Tensor "bf16[4, 2048, 25, 32][1638400, 800, 32, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%slice_9, %neg_2), kwargs = {})
#   %mul_28 : Tensor "bf16[4, 2048, 25, 32][1638400, 800, 32, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%slice_10, %unsqueeze), kwargs = {})
#   %add_11 : Tensor "bf16[4, 2048, 25, 32][1638400, 800, 32, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mul_27, %mul_28), kwargs = {})
#   %unsqueeze_8 : Tensor "bf16[4, 2048, 25, 32, 1][1638400, 800, 32, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%sub_4, 4), kwargs = {})
#   %unsqueeze_9 : Tensor "bf16[4, 2048, 25, 32, 1][1638400, 800, 32, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%add_11, 4), kwargs = {})
#   %cat_3 : Tensor "bf16[4, 2048, 25, 32, 2][3276800, 1600, 64, 2, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.cat.default](args = ([%unsqueeze_8, %unsqueeze_9], -1), kwargs = {})
#   %view_27 : Tensor "bf16[4, 2048, 25, 64][3276800, 1600, 64, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%cat_3, [4, 2048, 25, 64]), kwargs = {})
#   %permute_28 : Tensor "bf16[4, 2048, 25, 64][3276800, 1600, 64, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.permute.default](args = (%getitem_12, [0, 2, 1, 3]), kwargs = {})
#   %slice_11 : Tensor "bf16[4, 2048, 25, 32][3276800, 1600, 64, 2]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.slice.Tensor](args = (%permute_28, 3, 0, 9223372036854775807, 2), kwargs = {})
#   %slice_12 : Tensor "bf16[4, 2048, 25, 32][3276800, 1600, 64, 2]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.slice.Tensor](args = (%permute_28, 3, 1, 9223372036854775807, 2), kwargs = {})
#   %mul_29 : Tensor "bf16[4, 2048, 25, 32][1638400, 800, 32, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%slice_11, %unsqueeze), kwargs = {})
#   %mul_30 : Tensor "bf16[4, 2048, 25, 32][1638400, 800, 32, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%slice_12, %neg_2), kwargs = {})
#   %sub_5 : Tensor "bf16[4, 2048, 25, 32][1638400, 800, 32, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sub.Tensor](args = (%mul_29, %mul_30), kwargs = {})
#   %mul_31 : Tensor "bf16[4, 2048, 25, 32][1638400, 800, 32, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%slice_11, %neg_2), kwargs = {})
#   %mul_32 : Tensor "bf16[4, 2048, 25, 32][1638400, 800, 32, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%slice_12, %unsqueeze), kwargs = {})
#   %add_12 : Tensor "bf16[4, 2048, 25, 32][1638400, 800, 32, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mul_31, %mul_32), kwargs = {})
#   %unsqueeze_10 : Tensor "bf16[4, 2048, 25, 32, 1][1638400, 800, 32, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%sub_5, 4), kwargs = {})
#   %unsqueeze_11 : Tensor "bf16[4, 2048, 25, 32, 1][1638400, 800, 32, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%add_12, 4), kwargs = {})
#   %cat_4 : Tensor "bf16[4, 2048, 25, 32, 2][3276800, 1600, 64, 2, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.cat.default](args = ([%unsqueeze_10, %unsqueeze_11], -1), kwargs = {})
#   %view_28 : Tensor "bf16[4, 2048, 25, 64][3276800, 1600, 64, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%cat_4, [4, 2048, 25, 64]), kwargs = {})
#   %view_29 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%permute_26, [4, 2048, 1600]), kwargs = {})
#   %view_30 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%view_27, [4, 2048, 1600]), kwargs = {})
#   %view_31 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%view_28, [4, 2048, 1600]), kwargs = {})
#   %cat_5 : Tensor "bf16[4, 2048, 4800][9830400, 4800, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.cat.default](args = ([%view_31, %view_30, %view_29], 2), kwargs = {})
#   return %cat_5
triton_poi_fused_add_cat_mul_neg_slice_stack_sub_transpose_unsqueeze_view_2 = async_compile.triton('triton_poi_fused_add_cat_mul_neg_slice_stack_sub_transpose_unsqueeze_view_2', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 67108864}, 
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*bf16', 'in_ptr2': '*bf16', 'in_ptr3': '*bf16', 'in_ptr4': '*bf16', 'out_ptr0': '*bf16', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused_add_cat_mul_neg_slice_stack_sub_transpose_unsqueeze_view_2', 'mutated_arg_names': [], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 17, 'num_store': 1, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 236191744}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused_add_cat_mul_neg_slice_stack_sub_transpose_unsqueeze_view_2(in_ptr0, in_ptr1, in_ptr2, in_ptr3, in_ptr4, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 39321600
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = tl.full([XBLOCK], True, tl.int1)[:]
    x0 = (xindex % 4800)
    x3 = xindex // 4800
    x1 = ((xindex // 4800) % 2048)
    x4 = xindex
    tmp0 = x0
    tmp1 = tl.full([1], 0, tl.int64)
    tmp2 = tmp0 >= tmp1
    tmp3 = tl.full([1], 1600, tl.int64)
    tmp4 = tmp0 < tmp3
    tmp5 = ((((x0) % 64)) % 2)
    tmp6 = tl.full([1], 0, tl.int64)
    tmp7 = tmp5 >= tmp6
    tmp8 = tl.full([1], 1, tl.int64)
    tmp9 = tmp5 < tmp8
    tmp10 = tmp9 & tmp4
    tmp11 = tl.load(in_ptr0 + (2*(triton_helpers.div_floor_integer(((x0) % 64),  2)) + 64*((((x0) // 64) % 25)) + 1600*x3), tmp10, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp12 = tl.load(in_ptr1 + (32*x1 + (triton_helpers.div_floor_integer(((x0) % 64),  2))), tmp10, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp13 = tmp11 * tmp12
    tmp14 = tl.load(in_ptr0 + (1 + 2*(triton_helpers.div_floor_integer(((x0) % 64),  2)) + 64*((((x0) // 64) % 25)) + 1600*x3), tmp10, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp15 = tl.load(in_ptr2 + (32*x1 + (triton_helpers.div_floor_integer(((x0) % 64),  2))), tmp10, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp16 = -tmp15
    tmp17 = tmp14 * tmp16
    tmp18 = tmp13 - tmp17
    tmp19 = tl.full(tmp18.shape, 0.0, tmp18.dtype)
    tmp20 = tl.where(tmp10, tmp18, tmp19)
    tmp21 = tmp5 >= tmp8
    tmp22 = tl.full([1], 2, tl.int64)
    tmp23 = tmp5 < tmp22
    tmp24 = tmp21 & tmp4
    tmp25 = tl.load(in_ptr0 + (2*(triton_helpers.div_floor_integer(((x0) % 64),  2)) + 64*((((x0) // 64) % 25)) + 1600*x3), tmp24, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp26 = tl.load(in_ptr2 + (32*x1 + (triton_helpers.div_floor_integer(((x0) % 64),  2))), tmp24, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp27 = -tmp26
    tmp28 = tmp25 * tmp27
    tmp29 = tl.load(in_ptr0 + (1 + 2*(triton_helpers.div_floor_integer(((x0) % 64),  2)) + 64*((((x0) // 64) % 25)) + 1600*x3), tmp24, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp30 = tl.load(in_ptr1 + (32*x1 + (triton_helpers.div_floor_integer(((x0) % 64),  2))), tmp24, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp31 = tmp29 * tmp30
    tmp32 = tmp28 + tmp31
    tmp33 = tl.full(tmp32.shape, 0.0, tmp32.dtype)
    tmp34 = tl.where(tmp24, tmp32, tmp33)
    tmp35 = tl.where(tmp9, tmp20, tmp34)
    tmp36 = tl.full(tmp35.shape, 0.0, tmp35.dtype)
    tmp37 = tl.where(tmp4, tmp35, tmp36)
    tmp38 = tmp0 >= tmp3
    tmp39 = tl.full([1], 3200, tl.int64)
    tmp40 = tmp0 < tmp39
    tmp41 = tmp38 & tmp40
    tmp42 = (((((-1600) + x0) % 64)) % 2)
    tmp43 = tl.full([1], 0, tl.int64)
    tmp44 = tmp42 >= tmp43
    tmp45 = tl.full([1], 1, tl.int64)
    tmp46 = tmp42 < tmp45
    tmp47 = tmp46 & tmp41
    tmp48 = tl.load(in_ptr3 + (2*(((((((-1600) + x0) % 64)) // 2) % 32)) + 64*(((((-1600) + x0) // 64) % 25)) + 1600*x3), tmp47, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp49 = tl.load(in_ptr1 + (32*x1 + (((((((-1600) + x0) % 64)) // 2) % 32))), tmp47, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp50 = tmp48 * tmp49
    tmp51 = tl.load(in_ptr3 + (1 + 2*(((((((-1600) + x0) % 64)) // 2) % 32)) + 64*(((((-1600) + x0) // 64) % 25)) + 1600*x3), tmp47, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp52 = tl.load(in_ptr2 + (32*x1 + (((((((-1600) + x0) % 64)) // 2) % 32))), tmp47, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp53 = -tmp52
    tmp54 = tmp51 * tmp53
    tmp55 = tmp50 - tmp54
    tmp56 = tl.full(tmp55.shape, 0.0, tmp55.dtype)
    tmp57 = tl.where(tmp47, tmp55, tmp56)
    tmp58 = tmp42 >= tmp45
    tmp59 = tl.full([1], 2, tl.int64)
    tmp60 = tmp42 < tmp59
    tmp61 = tmp58 & tmp41
    tmp62 = tl.load(in_ptr3 + (2*(((((((-1600) + x0) % 64)) // 2) % 32)) + 64*(((((-1600) + x0) // 64) % 25)) + 1600*x3), tmp61, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp63 = tl.load(in_ptr2 + (32*x1 + (((((((-1600) + x0) % 64)) // 2) % 32))), tmp61, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp64 = -tmp63
    tmp65 = tmp62 * tmp64
    tmp66 = tl.load(in_ptr3 + (1 + 2*(((((((-1600) + x0) % 64)) // 2) % 32)) + 64*(((((-1600) + x0) // 64) % 25)) + 1600*x3), tmp61, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp67 = tl.load(in_ptr1 + (32*x1 + (((((((-1600) + x0) % 64)) // 2) % 32))), tmp61, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp68 = tmp66 * tmp67
    tmp69 = tmp65 + tmp68
    tmp70 = tl.full(tmp69.shape, 0.0, tmp69.dtype)
    tmp71 = tl.where(tmp61, tmp69, tmp70)
    tmp72 = tl.where(tmp46, tmp57, tmp71)
    tmp73 = tl.full(tmp72.shape, 0.0, tmp72.dtype)
    tmp74 = tl.where(tmp41, tmp72, tmp73)
    tmp75 = tmp0 >= tmp39
    tmp76 = tl.full([1], 4800, tl.int64)
    tmp77 = tmp0 < tmp76
    tmp78 = tl.load(in_ptr4 + (1600*x3 + ((-3200) + x0)), tmp75, eviction_policy='evict_last', other=0.0).to(tl.float32)
    tmp79 = tl.where(tmp41, tmp74, tmp78)
    tmp80 = tl.where(tmp4, tmp37, tmp79)
    tl.store(out_ptr0 + (x4), tmp80, None)
''', device_str='cuda')


# kernel path: /tmp/inductor_cat_slices_g2c53keh/is/cis7hkw73wj4mtifth6juscmac6feewnb2vkpyc64aafpuiwh22g.py
# Topologically Sorted Source Nodes: [view_21, view_23, add_9, convert_element_type_33, linear_1, x, wide_1, rms_norm_1, mul_24, sum_2, view_33, convert_element_type_44, to_1, mul_33, wide, rms_norm, mul_35, sum_3, div_2, mul_36, sub_6, mul_37, mul_38, sum_4, convert_element_type_46, add_13], Original ATen: [aten.view, aten.add, aten._to_copy, aten._unsafe_view, aten._fused_rms_norm, aten._fused_rms_norm_backward]
# Source node to ATen node mapping:
#   add_13 => add_13
#   add_9 => add_9
#   convert_element_type_33 => convert_element_type_33
#   convert_element_type_44 => convert_element_type_44
#   convert_element_type_46 => convert_element_type_46
#   div_2 => div_2
#   linear_1 => view_11
#   mul_24 => mul_24
#   mul_33 => mul_33
#   mul_35 => mul_35
#   mul_36 => mul_36
#   mul_37 => mul_37
#   mul_38 => mul_38
#   rms_norm => mul
#   rms_norm_1 => mul_10
#   sub_6 => sub_6
#   sum_2 => sum_2
#   sum_3 => sum_3
#   sum_4 => sum_4
#   to_1 => convert_element_type_1
#   view_21 => view_21
#   view_23 => view_23
#   view_33 => view_33
#   wide => convert_element_type
#   wide_1 => convert_element_type_7
#   x => add_3
# Graph fragment:
#   %primals_1 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0" = PlaceHolder[target=primals_1]
#   %rsqrt : Tensor "f32[4, 2048, 1][2048, 1, 1]cuda:0" = PlaceHolder[target=rsqrt]
#   %mm_14 : Tensor "bf16[8192, 1600][1600, 1]cuda:0" = PlaceHolder[target=mm_14]
#   %primals_2 : Tensor "bf16[1600][1]cuda:0" = PlaceHolder[target=primals_2]
#   %add_10 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0" = PlaceHolder[target=add_10]
#   %sum_3 : Tensor "f32[4, 2048, 1][2048, 1, 8192]cuda:0" = PlaceHolder[target=sum_3]
#   %mm_8 : Tensor "bf16[8192, 1600][1600, 1]cuda:0" = PlaceHolder[target=mm_8]
#   %mm_10 : Tensor "bf16[8192, 1600][1600, 1]cuda:0" = PlaceHolder[target=mm_10]
#   %mm_1 : Tensor "bf16[8192, 1600][1600, 1]cuda:0" = PlaceHolder[target=mm_1]
#   %rsqrt_1 : Tensor "f32[4, 2048, 1][2048, 1, 1]cuda:0" = PlaceHolder[target=rsqrt_1]
#   %view_21 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_8, [4, 2048, 1600]), kwargs = {})
#   %view_23 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_10, [4, 2048, 1600]), kwargs = {})
#   %add_9 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%view_21, %view_23), kwargs = {})
#   %convert_element_type_33 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%add_9, torch.float32), kwargs = {})
#   %view_11 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_1, [4, 2048, 1600]), kwargs = {})
#   %add_3 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%primals_1, %view_11), kwargs = {})
#   %convert_element_type_7 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%add_3, torch.float32), kwargs = {})
#   %mul_10 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=3] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type_7, %rsqrt_1), kwargs = {})
#   %mul_24 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type_33, %mul_10), kwargs = {})
#   %sum_2 : Tensor "f32[1600][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sum.dim_IntList](args = (%mul_24, [0, 1]), kwargs = {})
#   %view_33 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_14, [4, 2048, 1600]), kwargs = {})
#   %convert_element_type_44 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%view_33, torch.float32), kwargs = {})
#   %convert_element_type_1 : Tensor "f32[1600][1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%primals_2, torch.float32), kwargs = {})
#   %mul_33 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type_44, %convert_element_type_1), kwargs = {})
#   %convert_element_type : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%primals_1, torch.float32), kwargs = {})
#   %mul : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=3] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type, %rsqrt), kwargs = {})
#   %mul_35 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul, %mul_33), kwargs = {})
#   %sum_3 : Tensor "f32[4, 2048, 1][2048, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sum.dim_IntList](args = (%mul_35, [2], True), kwargs = {})
#   %div_2 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.div.Tensor](args = (%mul, 1600), kwargs = {})
#   %mul_36 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%div_2, %sum_3), kwargs = {})
#   %sub_6 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sub.Tensor](args = (%mul_33, %mul_36), kwargs = {})
#   %mul_37 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%sub_6, %rsqrt), kwargs = {})
#   %mul_38 : Tensor "f32[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type_44, %mul), kwargs = {})
#   %sum_4 : Tensor "f32[1600][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sum.dim_IntList](args = (%mul_38, [0, 1]), kwargs = {})
#   %convert_element_type_46 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mul_37, torch.bfloat16), kwargs = {})
#   %add_13 : Tensor "bf16[4, 2048, 1600][3276800, 1600, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%add_10, %convert_element_type_46), kwargs = {})
#   return %sum_3,%add_13
triton_per_fused__fused_rms_norm__fused_rms_norm_backward__to_copy__unsafe_view_add_view_3 = async_compile.triton('triton_per_fused__fused_rms_norm__fused_rms_norm_backward__to_copy__unsafe_view_add_view_3', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.persistent_reduction(
    size_hints={'x': 8192, 'r0_': 2048},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*fp32', 'in_ptr2': '*bf16', 'in_ptr3': '*bf16', 'in_ptr4': '*bf16', 'in_ptr5': '*bf16', 'in_ptr6': '*bf16', 'in_ptr7': '*bf16', 'in_ptr8': '*fp32', 'out_ptr1': '*bf16', 'ws_ptr': '*fp32', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr', 'RSPLIT_SIZE': 'constexpr', 'NUM_STAGES': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]], (7,): [['tt.divisibility', 16]], (8,): [['tt.divisibility', 16]], (9,): [['tt.divisibility', 16]], (10,): [['tt.divisibility', 16]], (11,): [['tt.divisibility', 16]], (12,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'MixOrderReductionGrid', 'autotune_hints': set(), 'kernel_name': 'triton_per_fused__fused_rms_norm__fused_rms_norm_backward__to_copy__unsafe_view_add_view_3', 'mutated_arg_names': [], 'optimize_mem': True, 'no_x_dim': None, 'atomic_add_found': False, 'num_load': 9, 'num_store': 0, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'RSPLIT_SIZE': 16}
)
@triton.jit
def triton_per_fused__fused_rms_norm__fused_rms_norm_backward__to_copy__unsafe_view_add_view_3(in_ptr0, in_ptr1, in_ptr2, in_ptr3, in_ptr4, in_ptr5, in_ptr6, in_ptr7, in_ptr8, out_ptr1, ws_ptr, xnumel, r0_numel, XBLOCK : tl.constexpr, RSPLIT_SIZE : tl.constexpr, NUM_STAGES : tl.constexpr):
    xnumel = 8192
    r0_numel = 1600
    R0_BLOCK: tl.constexpr = 2048
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * RSPLIT_SIZE
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = tl.full([XBLOCK], True, tl.int1)[:, None]
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    r0_offset = 0
    r0_mask = r0_index < r0_numel
    roffset = r0_offset
    rindex = r0_index
    r0_1 = r0_index
    accum0 = tl.full([R0_BLOCK], 0, tl.float32)[None, :]
    accum1 = tl.full([R0_BLOCK], 0, tl.float32)[None, :]
    split_size = min(RSPLIT_SIZE, xnumel - xoffset)
    for _ in tl.range(0, split_size, XBLOCK, num_stages=NUM_STAGES):
        x0 = xindex
        xindex += XBLOCK
        tmp0 = tl.load(in_ptr0 + (r0_1 + 1600*x0), r0_mask, other=0.0).to(tl.float32)
        tmp2 = tl.load(in_ptr1 + (x0), None, eviction_policy='evict_last')
        tmp4 = tl.load(in_ptr2 + (r0_1 + 1600*x0), r0_mask, other=0.0).to(tl.float32)
        tmp6 = tl.load(in_ptr3 + (r0_1), r0_mask, eviction_policy='evict_last', other=0.0).to(tl.float32)
        tmp14 = tl.load(in_ptr4 + (r0_1 + 1600*x0), r0_mask, other=0.0).to(tl.float32)
        tmp22 = tl.load(in_ptr5 + (r0_1 + 1600*x0), r0_mask, other=0.0).to(tl.float32)
        tmp23 = tl.load(in_ptr6 + (r0_1 + 1600*x0), r0_mask, other=0.0).to(tl.float32)
        tmp26 = tl.load(in_ptr7 + (r0_1 + 1600*x0), r0_mask, other=0.0).to(tl.float32)
        tmp29 = tl.load(in_ptr8 + (x0), None, eviction_policy='evict_last')
        tmp1 = tmp0.to(tl.float32)
        tmp3 = tmp1 * tmp2
        tmp5 = tmp4.to(tl.float32)
        tmp7 = tmp6.to(tl.float32)
        tmp8 = tmp5 * tmp7
        tmp9 = tmp3 * tmp8
        tmp10 = tl.broadcast_to(tmp9, [XBLOCK, R0_BLOCK])
        tmp12 = tl.where(r0_mask, tmp10, 0)
        tmp13 = tl.sum(tmp12, 1)[:, None].to(tl.float32)
        tmp15 = tl.full([1, 1], 0.000625, tl.float32)
        tmp16 = tmp3 * tmp15
        tmp17 = tmp16 * tmp13
        tmp18 = tmp8 - tmp17
        tmp19 = tmp18 * tmp2
        tmp20 = tmp19.to(tl.float32)
        tmp21 = tmp14 + tmp20
        tmp24 = tmp22 + tmp23
        tmp25 = tmp24.to(tl.float32)
        tmp27 = tmp0 + tmp26
        tmp28 = tmp27.to(tl.float32)
        tmp30 = tmp28 * tmp29
        tmp31 = tmp25 * tmp30
        tmp32 = tmp5 * tmp3
        tl.store(out_ptr1 + (r0_1 + 1600*x0), tmp21, r0_mask)
        tmp33 = tl.sum(tmp31, 0)
        tmp34 = accum0 + tmp33
        accum0 = tmp34
        tmp35 = tl.sum(tmp32, 0)
        tmp36 = accum1 + tmp35
        accum1 = tmp36
    tl.store(ws_ptr + (tl.program_id(0) + 0 * tl.num_programs(0)) * r0_numel + r0_index, accum0, r0_mask)
    tl.store(ws_ptr + (tl.program_id(0) + 1 * tl.num_programs(0)) * r0_numel + r0_index, accum1, r0_mask)
''', device_str='cuda')


# kernel path: /tmp/inductor_cat_slices_g2c53keh/5b/c5bracwq5j5oik3yjujfys6hboxkv7gaj4szehfixcxcz6tmt2w4.py
# Topologically Sorted Source Nodes: [convert_element_type_34], Original ATen: [aten._to_copy]
# Source node to ATen node mapping:
#   convert_element_type_34 => convert_element_type_34
# Graph fragment:
#   %sum_2 : Tensor "f32[1600][1]cuda:0" = PlaceHolder[target=sum_2]
#   %convert_element_type_34 : Tensor "bf16[1600][1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%sum_2, torch.bfloat16), kwargs = {})
#   return %convert_element_type_34
triton_poi_fused__to_copy_4 = async_compile.triton('triton_poi_fused__to_copy_4', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 2048}, 
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*fp32', 'out_ptr0': '*bf16', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused__to_copy_4', 'mutated_arg_names': [], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 1, 'num_store': 1, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 12800}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused__to_copy_4(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 1600
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (x0), xmask)
    tmp1 = tmp0.to(tl.float32)
    tl.store(out_ptr0 + (x0), tmp1, xmask)
''', device_str='cuda')


async_compile.wait(globals())
del async_compile

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def recursively_apply_fns(self, fns):
        new_callables = []
        for fn, c in zip(fns, self.partitions):
            new_callables.append(fn(c))
        self.partitions = new_callables

    def call(self, args):
        primals_1, primals_2, primals_6, primals_7, primals_8, primals_9, primals_10, primals_11, primals_12, rsqrt, view, permute_1, permute_2, permute_3, getitem_3, getitem_4, getitem_9, getitem_10, mm_1, rsqrt_1, view_12, mm_2, mm_3, view_16, permute_31, tangents_1 = args
        args.clear()
        assert_size_stride(primals_1, (4, 2048, 1600), (3276800, 1600, 1))
        assert_size_stride(primals_2, (1600, ), (1, ))
        assert_size_stride(primals_6, (2048, 32), (32, 1))
        assert_size_stride(primals_7, (2048, 32), (32, 1))
        assert_size_stride(primals_8, (1600, 1600), (1600, 1))
        assert_size_stride(primals_9, (1600, ), (1, ))
        assert_size_stride(primals_10, (6400, 1600), (1600, 1))
        assert_size_stride(primals_11, (6400, 1600), (1600, 1))
        assert_size_stride(primals_12, (1600, 6400), (6400, 1))
        assert_size_stride(rsqrt, (4, 2048, 1), (2048, 1, 1))
        assert_size_stride(view, (8192, 1600), (1600, 1))
        assert_size_stride(permute_1, (4, 25, 2048, 64), (3276800, 64, 1600, 1))
        assert_size_stride(permute_2, (4, 25, 2048, 64), (3276800, 64, 1600, 1))
        assert_size_stride(permute_3, (4, 25, 2048, 64), (9830400, 64, 4800, 1))
        assert_size_stride(getitem_3, (4, 25, 2048, 64), (3276800, 64, 1600, 1))
        assert_size_stride(getitem_4, (4, 25, 2048, 1), (51200, 2048, 1, 1))
        assert_size_stride(getitem_9, (), ())
        assert_size_stride(getitem_10, (), ())
        assert_size_stride(mm_1, (8192, 1600), (1600, 1))
        assert_size_stride(rsqrt_1, (4, 2048, 1), (2048, 1, 1))
        assert_size_stride(view_12, (8192, 1600), (1600, 1))
        assert_size_stride(mm_2, (8192, 6400), (6400, 1))
        assert_size_stride(mm_3, (8192, 6400), (6400, 1))
        assert_size_stride(view_16, (8192, 6400), (6400, 1))
        assert_size_stride(permute_31, (4800, 1600), (1600, 1))
        assert_size_stride(tangents_1, (4, 2048, 1600), (3276800, 1600, 1))
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            buf0 = empty_strided_cuda((1600, 6400), (6400, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [view_18, permute_9, mm_5], Original ATen: [aten.view, aten.t, aten.mm]
            extern_kernels.mm(reinterpret_tensor(tangents_1, (1600, 8192), (1, 1600), 0), view_16, out=buf0)
            del view_16
            buf1 = empty_strided_cuda((8192, 6400), (6400, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [view_18, linear_4, permute_11, mm_6], Original ATen: [aten.view, aten.t, aten.mm]
            extern_kernels.mm(reinterpret_tensor(tangents_1, (8192, 1600), (1600, 1), 0), primals_12, out=buf1)
            del primals_12
            buf2 = empty_strided_cuda((4, 2048, 6400), (13107200, 6400, 1), torch.bfloat16)
            buf5 = reinterpret_tensor(mm_3, (4, 2048, 6400), (13107200, 6400, 1), 0); del mm_3  # reuse
            # Topologically Sorted Source Nodes: [view_19, linear_2, silu, mul_13, linear_3, mul_14, convert_element_type_26, reciprocal, mul_15, mul_16, sub_2, mul_17, add_8, mul_18, convert_element_type_28], Original ATen: [aten.view, aten._unsafe_view, aten.silu, aten.mul, aten.silu_backward]
            stream0 = get_raw_stream(0)
            triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_0.run(buf5, buf1, mm_2, buf2, 52428800, stream=stream0)
            del buf1
            del mm_2
            buf3 = empty_strided_cuda((6400, 1600), (1600, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [view_19, linear_2, silu, mul_13, view_20, permute_13, mm_7], Original ATen: [aten.view, aten._unsafe_view, aten.silu, aten.mul, aten.t, aten.mm]
            extern_kernels.mm(reinterpret_tensor(buf2, (6400, 8192), (1, 6400), 0), view_12, out=buf3)
            buf4 = empty_strided_cuda((8192, 1600), (1600, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [view_19, linear_2, silu, mul_13, view_20, linear_3, permute_15, mm_8], Original ATen: [aten.view, aten._unsafe_view, aten.silu, aten.mul, aten.t, aten.mm]
            extern_kernels.mm(reinterpret_tensor(buf2, (8192, 6400), (6400, 1), 0), primals_11, out=buf4)
            del buf2
            del primals_11
            buf6 = empty_strided_cuda((6400, 1600), (1600, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [view_19, linear_2, silu, linear_3, mul_14, convert_element_type_26, reciprocal, mul_15, mul_16, sub_2, mul_17, add_8, mul_18, convert_element_type_28, view_22, permute_17, mm_9], Original ATen: [aten.view, aten._unsafe_view, aten.silu, aten.mul, aten.silu_backward, aten.t, aten.mm]
            extern_kernels.mm(reinterpret_tensor(buf5, (6400, 8192), (1, 6400), 0), view_12, out=buf6)
            del view_12
            buf7 = empty_strided_cuda((8192, 1600), (1600, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [view_19, linear_2, silu, linear_3, mul_14, convert_element_type_26, reciprocal, mul_15, mul_16, sub_2, mul_17, add_8, mul_18, convert_element_type_28, view_22, permute_19, mm_10], Original ATen: [aten.view, aten._unsafe_view, aten.silu, aten.mul, aten.silu_backward, aten.t, aten.mm]
            extern_kernels.mm(reinterpret_tensor(buf5, (8192, 6400), (6400, 1), 0), primals_10, out=buf7)
            del buf5
            del primals_10
            buf12 = empty_strided_cuda((4, 2048, 1600), (3276800, 1600, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [view_21, view_23, add_9, convert_element_type_33, to_4, mul_19, linear_1, x, wide_1, rms_norm_1, mul_21, sum_1, div_1, mul_22, sub_3, mul_23, convert_element_type_35, add_10], Original ATen: [aten.view, aten.add, aten._to_copy, aten._fused_rms_norm_backward, aten._unsafe_view, aten._fused_rms_norm]
            stream0 = get_raw_stream(0)
            triton_red_fused__fused_rms_norm__fused_rms_norm_backward__to_copy__unsafe_view_add_view_1.run(primals_1, mm_1, rsqrt_1, buf4, buf7, primals_9, tangents_1, buf12, 8192, 1600, stream=stream0)
            del primals_9
            del tangents_1
            buf14 = empty_strided_cuda((8192, 1600), (1600, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [view_24, linear_1, permute_23, mm_12], Original ATen: [aten.view, aten.t, aten.mm]
            extern_kernels.mm(reinterpret_tensor(buf12, (8192, 1600), (1600, 1), 0), primals_8, out=buf14)
            del primals_8
            # Topologically Sorted Source Nodes: [view_25, view_26, permute_25, _scaled_dot_product_cudnn_attention_backward], Original ATen: [aten.view, aten.transpose, aten._scaled_dot_product_cudnn_attention_backward]
            buf15 = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default(reinterpret_tensor(buf14, (4, 25, 2048, 64), (3276800, 64, 1600, 1), 0), permute_1, permute_2, permute_3, getitem_3, getitem_4, getitem_9, getitem_10, None, None, None, 2048, 2048, 0.0, True)
            del buf14
            del getitem_10
            del getitem_4
            del getitem_9
            del permute_1
            del permute_2
            del permute_3
            buf16 = buf15[0]
            assert_size_stride(buf16, (4, 25, 2048, 64), (3276800, 64, 1600, 1), 'torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default')
            assert_alignment(buf16, 16, 'torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default')
            buf17 = buf15[1]
            assert_size_stride(buf17, (4, 25, 2048, 64), (3276800, 64, 1600, 1), 'torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default')
            assert_alignment(buf17, 16, 'torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default')
            buf18 = buf15[2]
            assert_size_stride(buf18, (4, 25, 2048, 64), (3276800, 64, 1600, 1), 'torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default')
            assert_alignment(buf18, 16, 'torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default')
            del buf15
            buf19 = empty_strided_cuda((4, 2048, 4800), (9830400, 4800, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [permute_26, permute_27, arg_1, neg, x_even, x_odd, arg, mul, mul_1, sub, mul_2, mul_3, add, stack, rotated, permute_28, view_29, view_30, view_31, cat_5], Original ATen: [aten.transpose, aten.unsqueeze, aten.neg, aten.slice, aten.mul, aten.sub, aten.add, aten.stack, aten.view, aten.cat]
            stream0 = get_raw_stream(0)
            triton_poi_fused_add_cat_mul_neg_slice_stack_sub_transpose_unsqueeze_view_2.run(buf16, primals_6, primals_7, buf17, buf18, buf19, 39321600, stream=stream0)
            del buf16
            del primals_6
            del primals_7
            buf21 = reinterpret_tensor(buf18, (8192, 1600), (1600, 1), 0); del buf18  # reuse
            # Topologically Sorted Source Nodes: [view_32, mm_14], Original ATen: [aten.view, aten.mm]
            extern_kernels.mm(reinterpret_tensor(buf19, (8192, 4800), (4800, 1), 0), permute_31, out=buf21)
            del permute_31
            buf26 = reinterpret_tensor(buf17, (4, 2048, 1600), (3276800, 1600, 1), 0); del buf17  # reuse
            # Call mix order reduction kernel
            # Topologically Sorted Source Nodes: [view_21, view_23, add_9, convert_element_type_33, linear_1, x, wide_1, rms_norm_1, mul_24, sum_2, view_33, convert_element_type_44, to_1, mul_33, wide, rms_norm, mul_35, sum_3, div_2, mul_36, sub_6, mul_37, mul_38, sum_4, convert_element_type_46, add_13], Original ATen: [aten.view, aten.add, aten._to_copy, aten._unsafe_view, aten._fused_rms_norm, aten._fused_rms_norm_backward]
            workspace_0 = empty_strided_cuda((1638400, ), (1, ), torch.float32)
            stream0 = get_raw_stream(0)
            triton_per_fused__fused_rms_norm__fused_rms_norm_backward__to_copy__unsafe_view_add_view_3.run(primals_1, rsqrt, buf21, primals_2, buf12, buf4, buf7, mm_1, rsqrt_1, buf26, workspace_0, 8192, 1600, stream=stream0)
            buf10 = workspace_0[0 * 512 * 1600 : (0 + 1) * 512 * 1600].view(512, 1600).sum(dim=0)
            buf24 = workspace_0[1 * 512 * 1600 : (1 + 1) * 512 * 1600].view(512, 1600).sum(dim=0)
            del workspace_0
            del buf21
            del buf4
            del buf7
            del mm_1
            del primals_1
            del primals_2
            del rsqrt
            del rsqrt_1
            buf11 = empty_strided_cuda((1600, ), (1, ), torch.bfloat16)
            # Topologically Sorted Source Nodes: [convert_element_type_34], Original ATen: [aten._to_copy]
            stream0 = get_raw_stream(0)
            triton_poi_fused__to_copy_4.run(buf10, buf11, 1600, stream=stream0)
            del buf10
            buf13 = empty_strided_cuda((1600, 1600), (1600, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [view_24, permute_21, transpose_3, reshape, linear_1, mm_11], Original ATen: [aten.view, aten.t, aten.transpose, aten.mm]
            extern_kernels.mm(reinterpret_tensor(buf12, (1600, 8192), (1, 1600), 0), reinterpret_tensor(getitem_3, (8192, 1600), (1600, 1), 0), out=buf13)
            del buf12
            del getitem_3
            buf20 = empty_strided_cuda((4800, 1600), (1600, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [view_32, permute_29, mm_13], Original ATen: [aten.view, aten.t, aten.mm]
            extern_kernels.mm(reinterpret_tensor(buf19, (4800, 8192), (1, 4800), 0), view, out=buf20)
            del buf19
            del view
            buf25 = empty_strided_cuda((1600, ), (1, ), torch.bfloat16)
            # Topologically Sorted Source Nodes: [convert_element_type_45], Original ATen: [aten._to_copy]
            stream0 = get_raw_stream(0)
            triton_poi_fused__to_copy_4.run(buf24, buf25, 1600, stream=stream0)
            del buf24
        return (buf26, buf25, reinterpret_tensor(buf20, (1600, 1600), (1600, 1), 0), reinterpret_tensor(buf20, (1600, 1600), (1600, 1), 2560000), reinterpret_tensor(buf20, (1600, 1600), (1600, 1), 5120000), None, None, buf13, buf11, buf6, buf3, buf0, )

runner = Runner(partitions=[])
call = runner.call
recursively_apply_fns = runner.recursively_apply_fns


def get_args():
    from torch._dynamo.testing import rand_strided
    primals_1 = rand_strided((4, 2048, 1600), (3276800, 1600, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_2 = rand_strided((1600, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    primals_6 = rand_strided((2048, 32), (32, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_7 = rand_strided((2048, 32), (32, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_8 = rand_strided((1600, 1600), (1600, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_9 = rand_strided((1600, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    primals_10 = rand_strided((6400, 1600), (1600, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_11 = rand_strided((6400, 1600), (1600, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_12 = rand_strided((1600, 6400), (6400, 1), device='cuda:0', dtype=torch.bfloat16)
    rsqrt = rand_strided((4, 2048, 1), (2048, 1, 1), device='cuda:0', dtype=torch.float32)
    view = rand_strided((8192, 1600), (1600, 1), device='cuda:0', dtype=torch.bfloat16)
    permute_1 = rand_strided((4, 25, 2048, 64), (3276800, 64, 1600, 1), device='cuda:0', dtype=torch.bfloat16)
    permute_2 = rand_strided((4, 25, 2048, 64), (3276800, 64, 1600, 1), device='cuda:0', dtype=torch.bfloat16)
    permute_3 = rand_strided((4, 25, 2048, 64), (9830400, 64, 4800, 1), device='cuda:0', dtype=torch.bfloat16)
    getitem_3 = rand_strided((4, 25, 2048, 64), (3276800, 64, 1600, 1), device='cuda:0', dtype=torch.bfloat16)
    getitem_4 = rand_strided((4, 25, 2048, 1), (51200, 2048, 1, 1), device='cuda:0', dtype=torch.float32)
    getitem_9 = rand_strided((), (), device='cuda:0', dtype=torch.int64)
    getitem_10 = rand_strided((), (), device='cuda:0', dtype=torch.int64)
    mm_1 = rand_strided((8192, 1600), (1600, 1), device='cuda:0', dtype=torch.bfloat16)
    rsqrt_1 = rand_strided((4, 2048, 1), (2048, 1, 1), device='cuda:0', dtype=torch.float32)
    view_12 = rand_strided((8192, 1600), (1600, 1), device='cuda:0', dtype=torch.bfloat16)
    mm_2 = rand_strided((8192, 6400), (6400, 1), device='cuda:0', dtype=torch.bfloat16)
    mm_3 = rand_strided((8192, 6400), (6400, 1), device='cuda:0', dtype=torch.bfloat16)
    view_16 = rand_strided((8192, 6400), (6400, 1), device='cuda:0', dtype=torch.bfloat16)
    permute_31 = rand_strided((4800, 1600), (1600, 1), device='cuda:0', dtype=torch.bfloat16)
    tangents_1 = rand_strided((4, 2048, 1600), (3276800, 1600, 1), device='cuda:0', dtype=torch.bfloat16)
    return [primals_1, primals_2, primals_6, primals_7, primals_8, primals_9, primals_10, primals_11, primals_12, rsqrt, view, permute_1, permute_2, permute_3, getitem_3, getitem_4, getitem_9, getitem_10, mm_1, rsqrt_1, view_12, mm_2, mm_3, view_16, permute_31, tangents_1]


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat)


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    args = get_args()
    compiled_module_main('None', lambda times, repeat: benchmark_compiled_module(args, times=times, repeat=repeat))
