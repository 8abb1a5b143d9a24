"""Checkers for the exercises: each takes a learner's function and says clearly what is right or wrong.

    from flashattn.course import exercises
    exercises.check_online_softmax(online_softmax)   # prints "PASSED: ..." or raises ExerciseError

One module per group of chapters (``ch00_02``; ``ch03_05``, chapter 03 and the first two exercises of
chapter 05; ``ch04_ladder``, chapter 04's Triton ladder; ``ch05_kernel``, chapter 05's whole kernel and
its launcher; ``ch06_08``, ``ch07`` (chapter 07's Delta kernel and loops), ``ch07_kernels`` (its whole
kernels and launcher), ``ch09``, ``ch10``; ``ch10_kernel``, chapter 10's grouped heads and windows in
the learner's kernels; ``ch11``, ``ch12``, ``ch13``, ``ch14``; ``ch14_loops``, chapter 14's softcap and
mask in the learner's loops), and ``common`` for what they share; every checker, and the kernels that
run a learner's Triton code, are available from here.
"""
from .ch00_02 import (check_block_alphas, check_lse_from_state, check_max_context, check_merge_softmax_states,
                      check_naive_causal_attention, check_online_softmax, check_online_softmax_weighted_sum,
                      EXP_FORMS, check_ptx_prediction, exp_forms, exp_forms_ptx, instruction_counts)
from .ch03_05 import (FORWARD_MISTAKES, check_causal_tiles, check_classify_tiles, check_fwd_inner,
                      check_kv_stage_bounds, check_tiled_attention, fwd_exercise_kernel, run_fwd_inner,
                      tiled_forward_with_mistake)
from .ch05_kernel import check_my_attention_forward, check_my_attn_fwd, launch_my_attn_fwd
from .ch04_ladder import (check_attention_tile_kernel, check_causal_mask_kernel, check_matmul_kernel,
                          check_row_softmax_kernel, check_stream_kv_kernel)
from .ch06_08 import (check_attention_backward, check_my_attention, check_row_lse_kernel, check_rule_test,
                      check_slip_factors, check_softmax_backward)
from .ch07 import check_delta_kernel, check_dkdv_inner, check_dq_inner, dkdv_exercise_kernel, dq_exercise_kernel, run_loop
from .ch07_kernels import check_my_attention_backward, check_my_attn_bwd_dkdv, check_my_attn_bwd_dq
from .ch09 import check_attention_cost, check_choose_config, check_estimate_resources, check_tile_ratio
from .ch10 import check_kv_head_map, check_varlen_programs, check_window_kv_range
from .ch10_kernel import check_gqa_window_backward, check_gqa_window_forward
from .ch11 import check_choose_num_splits, check_merge_splits, run_merge_kernel
from .ch12 import check_ring_producer, check_ring_slot, check_smem_bytes
from .ch13 import check_merge_step, check_zigzag_blocks, check_zigzag_positions
from .ch14 import check_alibi_bias, check_key_padding_mask, check_softcap_piece, run_softcap_piece
from .ch14_loops import check_mask_strides, check_score_loops
from .common import ExerciseError, attempt, expect_close, learner_functions, unwritten

__all__ = [
    "ExerciseError", "attempt", "expect_close", "learner_functions", "unwritten",
    # chapters 00-02
    "check_naive_causal_attention", "check_max_context", "check_online_softmax", "check_block_alphas",
    "check_merge_softmax_states", "check_online_softmax_weighted_sum", "check_ptx_prediction",
    "exp_forms", "EXP_FORMS", "exp_forms_ptx", "instruction_counts", "check_lse_from_state",
    # chapters 03 and 05 (the tiles; the stage bounds and the inner loop)
    "check_classify_tiles", "check_causal_tiles", "check_tiled_attention", "check_kv_stage_bounds", "check_fwd_inner",
    "fwd_exercise_kernel", "run_fwd_inner", "tiled_forward_with_mistake", "FORWARD_MISTAKES",
    # chapter 04's Triton ladder
    "check_causal_mask_kernel", "check_row_softmax_kernel", "check_attention_tile_kernel",
    "check_stream_kv_kernel", "check_matmul_kernel",
    # chapter 05's whole forward kernel and its launcher
    "check_my_attn_fwd", "check_my_attention_forward", "launch_my_attn_fwd",
    # chapters 06-08
    "check_softmax_backward", "check_attention_backward", "check_slip_factors", "check_delta_kernel",
    "check_dq_inner", "check_my_attn_bwd_dq", "check_dkdv_inner", "check_my_attn_bwd_dkdv",
    "dq_exercise_kernel", "dkdv_exercise_kernel", "run_loop", "check_my_attention_backward",
    "check_rule_test", "check_row_lse_kernel", "check_my_attention",
    # chapter 09
    "check_attention_cost", "check_tile_ratio", "check_estimate_resources", "check_choose_config",
    # chapter 10
    "check_kv_head_map", "check_window_kv_range", "check_varlen_programs",
    "check_gqa_window_forward", "check_gqa_window_backward",
    # chapter 11
    "check_choose_num_splits", "check_merge_splits", "run_merge_kernel",
    # chapter 12
    "check_ring_slot", "check_ring_producer", "check_smem_bytes",
    # chapter 13
    "check_merge_step", "check_zigzag_positions", "check_zigzag_blocks",
    # chapter 14
    "check_softcap_piece", "run_softcap_piece", "check_alibi_bias", "check_key_padding_mask",
    "check_score_loops", "check_mask_strides",
]
