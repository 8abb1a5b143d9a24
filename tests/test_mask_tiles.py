"""An attn_mask summarised per tile (flashattn.kernels.masks): the summary against plain PyTorch
and brute force, and the kernels that walk it: they skip the tiles it hides (keys there may be
NaN), read no mask in the tiles it keeps whole, and stay within the rule against float64 on odd
sizes, in every dtype, forward and backward, with masks broadcast through stride-0 dims and rows
that see no key.
"""
import itertools
import random
from functools import partial

import flashattn  # first: it picks the interpreter before triton is imported
import pytest
import torch

from flashattn.gpu import configs, launcher
from flashattn.kernels import masks, traversal
from flashattn.kernels.mods import ScoreMods
from flashattn.kernels.tiles import MASK_BOOL, MASK_FLOAT, MASK_KEYS
from flashattn.ops.attention import SUPPORTED_DTYPES as DTYPES
from flashattn.ops.modifiers import check_mask
from flashattn.testing.reference import naive_attention, window_mask
from flashattn.testing.rule import compare_with_reference
from test_modifiers import shifted_window_mask  # the pairs seen bottom-right, by brute force

DEVICE = flashattn.DEVICE
EMPTY, PARTIAL, FULL = masks.EMPTY, masks.PARTIAL, masks.FULL


def make_qkv(n_q, n_kv, head_dim=24, dtype=torch.float32, batch=2, heads_q=2, heads_kv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads_q, n_q), (batch, heads_kv, n_kv), (batch, heads_kv, n_kv))
    return [torch.randn(*s, head_dim, generator=g).to(DEVICE, dtype) for s in shapes]


def assert_rule(checks):
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


# -- The summary ----------------------------------------------------------------------------------

def classes_by_torch(mask, n_q, n_kv, block_q, block_kv):
    """mask_classes in plain PyTorch: each tile of the mask (its dims of size 1 kept) by its
    elements: FULL if all are True (float: 0), EMPTY if all are False (float: -inf), else PARTIAL."""
    batch, heads, rows, cols = mask.shape
    out = torch.empty(batch, heads, traversal.cdiv(rows, block_q), traversal.cdiv(cols, block_kv), dtype=torch.int8)
    for b, h, r, c in itertools.product(*map(range, out.shape)):
        tile = mask[b, h, r * block_q:(r + 1) * block_q, c * block_kv:(c + 1) * block_kv]
        kept = tile if tile.dtype == torch.bool else tile != float("-inf")
        unchanged = tile if tile.dtype == torch.bool else tile == 0
        out[b, h, r, c] = FULL if unchanged.all() else PARTIAL if kept.any() else EMPTY
    return out


def random_mask(shape, dtype, g):
    """A mask of tiles of every class: rows and columns blocked so that whole tiles agree."""
    kind = torch.randint(0, 3, (shape[0], shape[1], (shape[2] + 7) // 8, (shape[3] + 7) // 8), generator=g)
    kind.view(-1)[:3] = torch.tensor([0, 1, 2])[:kind.numel()]  # one block of each kind at least
    kind = kind.repeat_interleave(8, 2).repeat_interleave(8, 3)[..., :shape[2], :shape[3]]
    noise = torch.rand(shape, generator=g) > 0.5
    keep = torch.where(kind == 2, True, torch.where(kind == 0, False, noise))
    if dtype == torch.bool:
        return keep
    bias = torch.where(kind == 1, torch.randn(shape, generator=g), 0.0)
    return torch.where(keep, bias, float("-inf")).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 1, 1, 45), (1, 3, 37, 45), (2, 1, 37, 1), (2, 2, 37, 45)],
                         ids=["key-padding", "heads", "query-mask", "full"])
def test_mask_classes_are_plain_pytorchs(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    mask = random_mask(shape, dtype, g)
    if dtype != torch.bool:
        mask[..., :3, :2] = float("nan")  # NaN counts as kept, so that the kernels read it
    for block_q, block_kv in ((16, 16), (32, 16), (16, 32), (8, 8)):
        got = masks.mask_classes(mask.to(DEVICE), 37, 45, block_q, block_kv)
        assert torch.equal(got.cpu(), classes_by_torch(mask, 37, 45, block_q, block_kv)), (block_q, block_kv)
    assert (got == EMPTY).any() and (got == FULL).any() and (got == PARTIAL).any()


def test_mask_classes_read_broadcast_views_in_place():
    """A mask expanded with stride 0 (and one made non-contiguous) is summarised as its copy is."""
    g = torch.Generator().manual_seed(5)
    base = random_mask((2, 1, 1, 45), torch.bool, g)
    expanded = base.to(DEVICE).expand(2, 2, 37, 45)
    assert expanded.stride()[1:3] == (0, 0)
    got = masks.mask_classes(expanded, 37, 45, 16, 16)
    assert torch.equal(got.cpu(), classes_by_torch(base.expand(2, 2, 37, 45).contiguous(), 37, 45, 16, 16))
    strided = random_mask((2, 1, 37, 90), torch.float32, g)[..., ::2]
    got = masks.mask_classes(strided.to(DEVICE), 37, 45, 16, 16)
    assert torch.equal(got.cpu(), classes_by_torch(strided.contiguous(), 37, 45, 16, 16))


def test_pooled_classes_are_those_of_the_larger_tiles():
    g = torch.Generator().manual_seed(6)
    for shape in ((2, 1, 37, 45), (1, 1, 1, 77), (1, 2, 90, 1)):
        mask = random_mask(shape, torch.bool, g).to(DEVICE)
        fine = masks.mask_classes(mask, shape[2], shape[3], 16, 16)
        for rows, cols in ((1, 2), (2, 1), (2, 4), (4, 2)):
            coarse = masks.mask_classes(mask, shape[2], shape[3], 16 * rows, 16 * cols)
            assert torch.equal(masks.pooled(fine, rows, cols), coarse), (shape, rows, cols)


@pytest.mark.parametrize("dkdv", [False, True], ids=["fwd-dq", "dkdv"])
def test_structure_classes_against_brute_force(dkdv):
    """A FULL tile has every pair visible and no row a kernel would load unmasked past the end
    (keys in the forward and dQ kernels, queries in dK/dV); an EMPTY tile has no visible pair of
    a query and a key that exist; every other tile is PARTIAL."""
    rnd = random.Random(0)
    seen_kinds = set()
    for _ in range(150):
        n_q, n_kv = rnd.randint(1, 80), rnd.randint(1, 80)
        block_q, block_kv = rnd.choice([16, 32]), rnd.choice([16, 32])
        causal = rnd.random() < 0.3
        window = rnd.choice([(-1, -1), (-1, -1), (5, 0), (0, 0), (16, 3), (-1, 2), (7, -1)])
        bottom_right = rnd.random() < 0.4 and (causal or window != (-1, -1))
        k_causal, k_window, left, right = traversal.window_masking(causal, window, n_q + n_kv, bottom_right)
        if bottom_right:
            left, right = traversal.aligned_bounds(left, right, n_q, n_kv)
        got = masks.structure_classes(n_q, n_kv, block_q, block_kv, k_causal, k_window, left, right, dkdv,
                                      DEVICE).cpu()
        seen = (shifted_window_mask if bottom_right else window_mask)(n_q, n_kv, window, causal)
        for qb, kb in itertools.product(*map(range, got.shape)):
            q0, k0 = qb * block_q, kb * block_kv
            tile = seen[q0:q0 + block_q, k0:k0 + block_kv]
            whole = (q0 + block_q <= n_q) if dkdv else (k0 + block_kv <= n_kv)
            want = FULL if tile.all() and whole else PARTIAL if tile.any() else EMPTY
            assert got[qb, kb] == want, (n_q, n_kv, block_q, block_kv, causal, window, bottom_right, qb, kb)
            seen_kinds.add(want)
    assert seen_kinds == {EMPTY, PARTIAL, FULL}


def test_tile_lists_hold_full_then_partial_tiles():
    classes = torch.tensor([[FULL, EMPTY, PARTIAL, FULL], [EMPTY, EMPTY, EMPTY, EMPTY]], dtype=torch.int8)
    classes = classes.reshape(1, 1, 2, 4)
    structure = torch.tensor([[FULL, FULL, FULL, PARTIAL], [FULL] * 4], dtype=torch.int8)
    lists = masks.tile_lists(classes, structure, dkdv=False)
    assert lists.dtype == torch.int32 and lists.shape == (1, 1, 2, 6)
    assert lists[0, 0, 0, :2].tolist() == [1, 2] and lists[0, 0, 0, 2:5].tolist() == [0, 2, 3]
    assert lists[0, 0, 1, :2].tolist() == [0, 0]
    lists = masks.tile_lists(classes, structure, dkdv=True)  # one row per key tile
    assert lists.shape == (1, 1, 4, 4)
    assert [row[:2].tolist() for row in lists[0, 0]] == [[1, 0], [0, 0], [0, 1], [0, 1]]
    assert lists[0, 0, 2, 2] == 0 and lists[0, 0, 3, 2] == 0


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32], ids=str)
def test_the_tile_picture_draws_what_the_lists_hold(dtype, is_causal, monkeypatch):
    """Chapter 14's picture of a mask's tiles (plotting.mask_tile_classes) counts each tile's class
    from its pairs and fails where the lists disagree with that count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from flashattn import plotting

    mask = random_mask((1, 1, 37, 45), dtype, torch.Generator().manual_seed(3))[0, 0]
    kinds = plotting.pair_tile_classes(mask, 8, 8, is_causal)
    assert set(kinds.flatten().tolist()) == {EMPTY, PARTIAL, FULL}  # a picture of every class
    ax = plotting.mask_tile_classes(mask, 8, 8, is_causal)
    assert f"{int((kinds != EMPTY).sum())} of {kinds.size} tiles loaded" in ax.get_title()
    plt.close("all")
    right = masks.tile_lists

    def one_full_tile_less(classes, structure, dkdv):
        lists = right(classes, structure, dkdv).clone()
        row = int((lists[..., 0] > 0).nonzero()[0, -1])
        lists[0, 0, row, 0] -= 1
        lists[0, 0, row, 1] += 1
        return lists
    monkeypatch.setattr(masks, "tile_lists", one_full_tile_less)
    with pytest.raises(AssertionError):
        plotting.mask_tile_classes(mask, 8, 8, is_causal)
    plt.close("all")


def test_a_key_padding_mask_is_read_as_a_row_of_keys():
    """A mask with one row for every query gets MASK_KEYS: the kernels read it once per key of a
    tile; a mask with a row per query does not."""
    q, k, _ = make_qkv(37, 45)
    tiles = {"fwd": dict(BLOCK_Q=32, BLOCK_KV=16), "bwd_dkdv": dict(BLOCK_Q=16, BLOCK_KV=32)}
    for mask, kind in ((key_lengths_mask([45, 20], 45), MASK_BOOL + MASK_KEYS),
                       (torch.zeros(2, 1, 1, 45), MASK_FLOAT + MASK_KEYS), (torch.ones(2, 1, 37, 45) > 0, None)):
        mods = ScoreMods(attn_mask=check_mask(mask.to(DEVICE), q, k))
        args = mods.mask_lists(37, 45, tiles, False, False, 82, 82)
        assert all(a.get("MASK_KIND") == kind for a in args.values()), (mask.shape, mask.dtype)
        assert mods.kernel_args(37, 45, False)["MASK_KIND"] == (MASK_BOOL if mask.dtype == torch.bool else MASK_FLOAT)


def test_only_a_bool_key_padding_mask_reaches_the_fused_gluon_backward(monkeypatch):
    """With ``hopper.FUSED_KEY_MASKS``, ``dispatch.gluon_call`` hands the fused Gluon backward
    (``key_masks``) a bool mask with one row of keys per batch, or one for all of them, expanded by
    the caller or not; a float mask, a row per head or per query, and every mask for the Gluon
    forward keep the Triton kernels, as does every mask without it."""
    from flashattn import hopper
    from flashattn.ops import dispatch
    from flashattn.ops.modifiers import score_mods

    monkeypatch.setattr(hopper, "FUSED_KEY_MASKS", False)
    mods = score_mods(*make_qkv(37, 45, head_dim=64)[:2], torch.ones(45, dtype=torch.bool, device=DEVICE), 0.0,
                      True, "top_left", 0.0, None, 2, 2)
    assert dispatch.gluon_call(*make_qkv(37, 45, head_dim=64), True, (-1, -1), None, mods, key_masks=True) is None
    monkeypatch.setattr(hopper, "FUSED_KEY_MASKS", True)

    q, k, v = make_qkv(37, 45, head_dim=64)
    g = torch.Generator().manual_seed(0)
    for shape, dtype, taken in (((2, 1, 1, 45), torch.bool, True), ((1, 1, 1, 45), torch.bool, True),
                                ((45,), torch.bool, True), ((2, 2, 37, 45), "expanded", True),
                                ((2, 1, 1, 45), torch.float32, False), ((2, 2, 1, 45), torch.bool, False),
                                ((2, 1, 37, 45), torch.bool, False)):
        if dtype == "expanded":
            mask = (torch.rand(2, 1, 1, 45, generator=g) > 0.3).expand(shape)
        else:
            mask = (torch.rand(shape, generator=g) > 0.3).to(dtype)
        mods = score_mods(q, k, mask.to(DEVICE), 0.0, True, "top_left", 0.0, None, 2, 2)
        assert dispatch.gluon_call(q, k, v, True, (-1, -1), None, mods) is None, shape
        call = dispatch.gluon_call(q, k, v, True, (-1, -1), None, mods, key_masks=True)
        assert (call is not None) == taken, (shape, dtype)
        if taken:
            assert call["key_mask"].dtype == torch.bool and call["key_mask"].shape[1:3] == (1, 1)
            want = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))[:, :1, :1]
            assert torch.equal(call["key_mask"].expand(want.shape[0], 1, 1, 45).cpu(), want.expand(-1, 1, 1, 45))


# -- The kernels walking it -----------------------------------------------------------------------

def key_lengths_mask(lengths, n_kv):
    """A key-padding mask (B, 1, 1, N_kv) keeping the first lengths[b] keys of sequence b."""
    return (torch.arange(n_kv)[None, :] < torch.tensor(lengths)[:, None]).reshape(len(lengths), 1, 1, n_kv)


def tiles_of(dtype, head_dim):
    """The tiles ``{kernel: (BLOCK_Q, BLOCK_KV)}`` a masked call runs with here (the interpreter's,
    or the GPU's defaults)."""
    constexprs = dict(configs.head_dims(head_dim, head_dim),
                      DOT_PRECISION=configs.dot_precision(dtype, configs.block_d(head_dim)))
    return {name: (c["BLOCK_Q"], c["BLOCK_KV"]) for name in ("fwd", "bwd_dkdv", "bwd_dq")
            for c in [launcher.fixed_config(name, dtype, constexprs)]}


@pytest.mark.parametrize("case", ["plain", "window", "bottom-right", "gqa-float"])
def test_tiles_past_the_last_kept_key_are_never_loaded(case):
    """Keys in whole tiles past a sequence's last kept key are NaN: had a kernel loaded them, NaN
    would reach the output or the gradients. (A sequence with no kept key at all: zeros.)"""
    widest = max(kv for _, kv in tiles_of(torch.float32, 24).values())  # every kernel's key tiles
    n_q, n_kv = 37, 2 * widest + 37
    lengths = [n_kv, widest - 3, 0]
    q, k, v = make_qkv(n_q, n_kv, batch=3, heads_q=4 if "gqa" in case else 2)
    mask = key_lengths_mask(lengths, n_kv).to(DEVICE)
    kwargs = {"window": dict(window_size=(40, 7)),
              "bottom-right": dict(window_size=(n_kv, 0), causal_alignment="bottom_right")}.get(case, {})
    if "float" in case:
        mask = torch.zeros(mask.shape, device=DEVICE).masked_fill(~mask, float("-inf"))
    for b, n in enumerate(lengths):
        unseen = -(-n // widest) * widest
        k[b, :, unseen:] = float("nan")
        v[b, :, unseen:] = float("nan")
    assert torch.isnan(k[1]).any() and torch.isnan(k[2]).all()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flashattn.attention(*leaves, attn_mask=mask, enable_gqa="gqa" in case, return_lse=True, **kwargs)
    clean = [torch.nan_to_num(t) for t in (q, k, v)]
    want, want_lse = naive_attention(*clean, attn_mask=mask, enable_gqa="gqa" in case, **kwargs)
    torch.testing.assert_close(out, want.to(out.dtype), atol=2e-6, rtol=2e-6)
    assert (out[2] == 0).all() and (lse[2] == float("-inf")).all()
    dq, dk, dv = torch.autograd.grad(out.sum(), leaves)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert (dk[1, :, widest:] == 0).all() and (dv[1, :, widest:] == 0).all() and (dk[2] == 0).all()


def lying_lists(monkeypatch, summarised):
    """Make every launch summarise ``summarised`` instead of the mask its kernels read."""
    real = ScoreMods.mask_lists

    def lists(self, *args):
        assert self.attn_mask.shape == summarised.shape
        read, self.attn_mask = self.attn_mask, summarised
        try:
            return real(self, *args)
        finally:
            self.attn_mask = read
    monkeypatch.setattr(ScoreMods, "mask_lists", lists)


def tiled_masks(tiles, g):
    """``(summarised, read)`` for the kernels' ``tiles`` (:func:`tiles_of`): a mask whose blocks, as
    large as the largest tiles, are FULL, EMPTY or PARTIAL, with rows that see no key; and a mask
    equal to it in its PARTIAL blocks and in every tile a kernel masks for its positions (the
    ragged ends), and different in its FULL and EMPTY blocks."""
    rows, cols = max(q for q, _ in tiles.values()), max(kv for _, kv in tiles.values())
    n_q, n_kv = 2 * rows + 13, 3 * cols + 5
    kinds = torch.tensor([[FULL, EMPTY, PARTIAL], [EMPTY, EMPTY, EMPTY]])
    kind = kinds.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    kind = torch.nn.functional.pad(kind, (0, n_kv - kind.shape[1], 0, n_q - kind.shape[0]), value=PARTIAL)
    noise = torch.rand(2, 1, n_q, n_kv, generator=g) > 0.4
    summarised = torch.where(kind == FULL, True, torch.where(kind == EMPTY, False, noise))
    read = torch.where(kind == PARTIAL, summarised, ~summarised)
    ends = torch.zeros(n_q, n_kv, dtype=torch.bool)
    ends[:, min(n_kv // kv * kv for name, (_, kv) in tiles.items() if name != "bwd_dkdv"):] = True
    ends[n_q // tiles["bwd_dkdv"][0] * tiles["bwd_dkdv"][0]:, :] = True
    read = torch.where(ends, summarised, read)
    summarised[:, :, rows:2 * rows, 3 * cols:] = False  # the second block of rows sees no key
    read[:, :, rows:2 * rows, 3 * cols:] = False
    return summarised.to(DEVICE), read.to(DEVICE)


def test_kernels_skip_empty_tiles_and_read_no_mask_in_full_ones(monkeypatch):
    """The tile lists are made from one mask while the kernels read another, which differs from it
    only in tiles the lists call FULL or EMPTY: the outputs and gradients are those of the first,
    bit for bit, so no kernel read the mask in a FULL tile nor visited an EMPTY one. Made from the
    mask they read, they differ: the test can fail."""
    tiles = tiles_of(torch.float32, 24)
    summarised, read = tiled_masks(tiles, torch.Generator().manual_seed(7))
    q, k, v = make_qkv(*summarised.shape[2:])
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(DEVICE)

    def run(mask):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flashattn.attention(*leaves, attn_mask=mask, return_lse=True)
        return (out, lse, *torch.autograd.grad(out, leaves, do))

    want = run(summarised)
    honest = run(read)
    assert not any(torch.equal(a, b) for a, b in zip(want, honest))
    lying_lists(monkeypatch, summarised)
    got = run(read)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
    rows = max(q for q, _ in tiles.values())
    assert (want[1][:, :, rows:2 * rows] == float("-inf")).all()


def mask_case(name, n_q, n_kv, batch, heads, dtype):
    g = torch.Generator().manual_seed(len(name))
    if name == "key-lengths":  # right padding, a sequence with no key
        return key_lengths_mask([n_kv, n_kv // 2, 0][:batch], n_kv)
    if name == "left-padding":  # what a batched generation holds: the first keys hidden
        return ~key_lengths_mask([0, 13, n_kv - 1][:batch], n_kv)
    if name == "documents":  # block-diagonal: packed documents, causal within each
        doc = torch.arange(n_kv) * 3 // n_kv
        i = torch.arange(n_q)[:, None] * n_kv // n_q
        return ((doc[i] == doc[None, :]) & (torch.arange(n_kv)[None, :] <= i)).reshape(1, 1, n_q, n_kv)
    if name == "float-tiles":  # -inf blocks, zero blocks and a bias, one per head
        return random_mask((1, heads, n_q, n_kv), dtype, g)
    if name == "expanded":  # a (B, 1, 1, N) mask expanded with stride 0 by the caller
        return (torch.rand(batch, 1, 1, n_kv, generator=g) > 0.3).expand(batch, heads, n_q, n_kv)
    raise AssertionError(name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["key-lengths", "left-padding", "documents", "float-tiles", "expanded"])
def test_listed_kernels_against_reference(name, dtype):
    n_q, n_kv = 45, 69
    q, k, v = make_qkv(n_q, n_kv, dtype=dtype, batch=3)
    mask = mask_case(name, n_q, n_kv, 3, 2, dtype if dtype != torch.bfloat16 else torch.float32).to(DEVICE)
    impl = partial(flashattn.attention, attn_mask=mask)
    assert_rule(compare_with_reference(q, k, v, impl=impl, reference=partial(naive_attention, attn_mask=mask)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_listed_kernels_with_window_bottom_right_gqa_softcap_dropout(dtype):
    n_q, n_kv = 37, 70
    q, k, v = make_qkv(n_q, n_kv, dtype=dtype, heads_q=4)
    mask = mask_case("documents", n_q, n_kv, 2, 4, dtype).to(DEVICE)
    kwargs = dict(attn_mask=mask, window_size=(30, 2), causal_alignment="bottom_right", softcap=5.0,
                  enable_gqa=True)
    assert_rule(compare_with_reference(q, k, v, impl=partial(flashattn.attention, **kwargs),
                                       reference=partial(naive_attention, **kwargs)))
    from flashattn.kernels.mods import dropout_mask
    from flashattn.ops.modifiers import draw_seed
    torch.manual_seed(3)
    keep = dropout_mask((2, 4, n_q, n_kv), 0.2, draw_seed(), DEVICE)
    torch.manual_seed(3)
    assert_rule(compare_with_reference(q, k, v, impl=partial(flashattn.attention, dropout_p=0.2, **kwargs),
                                       reference=partial(naive_attention, dropout_p=0.2, dropout_keep=keep,
                                                         **kwargs)))


@pytest.mark.gpu
def test_a_masked_call_waits_on_no_host_and_replays_in_a_cuda_graph():
    """The summary is made on the device: a masked call makes no host sync, and a CUDA graph that
    captured it follows the mask's new contents when replayed."""
    q, k, v = make_qkv(300, 520, 64, torch.bfloat16)
    mask = key_lengths_mask([520, 200], 520).to(DEVICE)
    flashattn.attention(q, k, v, attn_mask=mask)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flashattn.attention(q, k, v, attn_mask=mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flashattn.attention(q, k, v, attn_mask=mask)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashattn.attention(q, k, v, attn_mask=mask)
    mask.copy_(key_lengths_mask([100, 520], 520).to(DEVICE))
    graph.replay()
    torch.testing.assert_close(out, flashattn.attention(q, k, v, attn_mask=mask), atol=0, rtol=0)
