"""The course's pictures, by chapter: tile maps, online-softmax traces, error heatmaps, memory and
TFLOPS curves, the ring of context parallelism, and animations of one program walking its tiles
(``animation``).

Each function draws into a matplotlib Axes (a new figure if none is given) and returns it, so the
notebooks and ``tools/make_figures.py`` draw the same pictures from the same code. One module per
group of chapters; every picture is available from here (``plotting.tile_map(...)``).
"""
from . import alt
from .animation import as_html, dkdv_walk, dq_walk, forward_walk
from .ch00_02 import capacity_ladder, exp_range, matrix_panels, memory_curve, partial_outputs, softmax_trace
from .ch03_05 import (TILE_COLORS, TILE_NAMES, error_heatmap, error_heatmaps, gantt, int_table, launch_strips,
                      tile_kinds_map, tile_map, visibility_map, work_fraction_curve)
from .ch06_08 import backward_ownership, backward_tile_maps, rule_ratios
from .ch09 import config_bars, ladder_bars, roofline, tflops_curves
from .ch10 import (measured_bars, padded_blocks, tiles_against_n, varlen_programs, window_tile_kinds,
                   window_tile_map, window_times)
from .ch11 import decode_bandwidth, place_programs, sm_map, tile_rows
from .ch12 import backward_schedule, pipeline_schedule, pipeline_timeline, provider_bars
from .ch13 import computed_blocks, memory_per_gpu, overlap_timeline, rank_tile_bars, ring_holdings, ring_schedule
from .ch14 import mask_tile_classes, pair_tile_classes, score_tile, score_tiles

__all__ = [
    "matrix_panels", "capacity_ladder", "memory_curve", "softmax_trace", "partial_outputs", "exp_range",
    "TILE_COLORS", "TILE_NAMES", "tile_map", "tile_kinds_map", "visibility_map", "work_fraction_curve",
    "launch_strips", "gantt", "int_table", "error_heatmap", "error_heatmaps",
    "backward_ownership", "backward_tile_maps", "rule_ratios",
    "roofline", "tflops_curves", "ladder_bars", "config_bars",
    "window_tile_kinds", "window_tile_map", "tiles_against_n", "varlen_programs", "padded_blocks",
    "measured_bars", "window_times",
    "place_programs", "sm_map", "tile_rows", "decode_bandwidth",
    "provider_bars", "pipeline_schedule", "pipeline_timeline", "backward_schedule",
    "ring_holdings", "ring_schedule", "computed_blocks", "rank_tile_bars", "overlap_timeline", "memory_per_gpu",
    "score_tile", "score_tiles", "mask_tile_classes", "pair_tile_classes",
    "forward_walk", "dkdv_walk", "dq_walk", "as_html",
]

alt.register()  # in a notebook, every figure shown gets alternative text (plotting.alt)
