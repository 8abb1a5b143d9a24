"""decode as a KV-cache step (``k_new``, ``v_new``, rotary embedding), as ``flash_attn_with_kvcache``:
the new keys and values land in the cache in place, at the positions after ``cache_seqlens``, and
attention then runs over the longer cache; rotary embedding turns q and the new keys by their
positions. Checked against float64 references written out here: the append by plain indexing, the
rotation from its formula, and attention by ``decode_reference``."""
import math

import pytest
import torch

import flashattn
from flashattn.testing.reference import decode_reference
from flashattn.testing.rule import judge

DEVICE = flashattn.DEVICE


def within_rule(out, ref, low, dtype):
    checks = judge(dict(out=out), dict(out=ref), dict(out=low), dtype)
    return all(c.ok for c in checks) or print(*checks)


def rope_tables(max_positions, rotary_dim, base=10000.0):
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)


def rope_reference(x, positions, cos, sin, interleaved):
    """Rotary embedding, one pair of features at a time, in float64."""
    x = x.double().clone()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for n in range(x.shape[2]):
            c, s = cos[positions[b][n]].double(), sin[positions[b][n]].double()
            for i in range(half):
                a, z = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                xa, xz = x[b, :, n, a].clone(), x[b, :, n, z].clone()
                x[b, :, n, a] = xa * c[i] - xz * s[i]
                x[b, :, n, z] = xa * s[i] + xz * c[i]
    return x


def setup(dtype, before, n_q=2, n_max=40, heads=4, kv_heads=2, head_dim=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = len(before)
    k_cache = torch.randn(batch, kv_heads, n_max, head_dim, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(batch, kv_heads, n_max, head_dim, generator=g).to(DEVICE, dtype)
    q = torch.randn(batch, heads, n_q, head_dim, generator=g).to(DEVICE, dtype)
    k_new = torch.randn(batch, kv_heads, n_q, head_dim, generator=g).to(DEVICE, dtype)
    v_new = torch.randn(batch, kv_heads, n_q, head_dim, generator=g).to(DEVICE, dtype)
    return q, k_cache, v_cache, k_new, v_new, torch.tensor(before, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_appending_writes_the_cache_in_place_and_attends_over_it(dtype):
    before = [0, 7, 21, 38]
    q, k_cache, v_cache, k_new, v_new, lengths = setup(dtype, before)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(before):
        expected_k[b, :, n:n + 2] = k_new[b]
        expected_v[b, :, n:n + 2] = v_new[b]
    k_ptr = k_cache.data_ptr()
    with torch.no_grad():
        out = flashattn.decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new)
    assert k_cache.data_ptr() == k_ptr and torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    after = lengths + 2
    ref = decode_reference(q.double(), expected_k.double(), expected_v.double(), after)[0]
    low = decode_reference(q, expected_k, expected_v, after)[0]
    assert within_rule(out, ref, low, dtype)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [24, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rotary_turns_q_and_the_new_keys_at_their_positions(dtype, rotary_dim, interleaved):
    before = [3, 0, 30]
    q, k_cache, v_cache, k_new, v_new, lengths = setup(dtype, before, heads=2, kv_heads=1)
    cos, sin = rope_tables(64, rotary_dim)
    positions = [[n, n + 1] for n in before]
    q_rot = rope_reference(q, positions, cos, sin, interleaved)
    k_rot = rope_reference(k_new, positions, cos, sin, interleaved)
    k_cache64, v_cache64 = k_cache.double().clone(), v_cache.double().clone()
    for b, n in enumerate(before):
        k_cache64[b, :, n:n + 2] = k_rot[b]
        v_cache64[b, :, n:n + 2] = v_new[b].double()
    with torch.no_grad():
        out = flashattn.decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, rotary_cos=cos,
                               rotary_sin=sin, rotary_interleaved=interleaved)
    tol = {torch.float16: 2e-3, torch.float32: 1e-6}[dtype]
    assert torch.allclose(k_cache.double(), k_cache64, atol=tol, rtol=0)  # the cache keeps the rotated keys
    ref = decode_reference(q_rot, k_cache64, v_cache64, lengths + 2)[0]
    low = decode_reference(q_rot.to(dtype), k_cache64.to(dtype), v_cache64.to(dtype), lengths + 2)[0]
    assert within_rule(out, ref, low, dtype)


def test_rotary_without_appending_places_q_at_the_end_of_the_cache():
    """Without k_new the cache holds the new tokens already (cache_seqlens counts them): q's
    positions are the last N_q of each length."""
    q, k_cache, v_cache, _, _, _ = setup(torch.float32, [0, 0])
    lengths = torch.tensor([5, 40], dtype=torch.int32)
    cos, sin = rope_tables(64, 24)
    q_rot = rope_reference(q, [[3, 4], [38, 39]], cos, sin, False)
    with torch.no_grad():
        out = flashattn.decode(q, k_cache, v_cache, lengths, rotary_cos=cos, rotary_sin=sin)
    ref = decode_reference(q_rot, k_cache.double(), v_cache.double(), lengths)[0]
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=0)


def test_a_rotated_dot_product_depends_only_on_the_distance():
    """RoPE's point: q at position m against k at position n scores as a function of m - n."""
    cos, sin = rope_tables(64, 8)
    from flashattn.ops import kv_cache
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 1, 1, 8, generator=g).to(DEVICE) for _ in range(2))

    def at(x, position):
        return kv_cache.rotate(x, torch.tensor([[position]], device=DEVICE), cos, sin, False)

    score = [(at(q, m) * at(k, m - 5)).sum().item() for m in (5, 20, 40)]
    same_place = (at(q, 17) * at(k, 17)).sum().item()
    assert max(score) - min(score) < 1e-5 and abs(same_place - (q * k).sum().item()) < 1e-5


def test_a_step_that_appends_matches_two_calls_that_do_it_by_hand():
    q, k_cache, v_cache, k_new, v_new, lengths = setup(torch.float32, [4, 9])
    by_hand_k, by_hand_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate([4, 9]):
        by_hand_k[b, :, n:n + 2], by_hand_v[b, :, n:n + 2] = k_new[b], v_new[b]
    with torch.no_grad():
        out = flashattn.decode(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, return_lse=True)
        expected = flashattn.decode(q, by_hand_k, by_hand_v, lengths + 2, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(out, expected))


def test_max_seqlen_appends_without_reading_lengths_on_the_host(monkeypatch):
    q, k_cache, v_cache, k_new, v_new, lengths = setup(torch.float32, [4, 9])
    expected_cache = k_cache.clone()
    with torch.no_grad():
        expected = flashattn.decode(q, expected_cache, v_cache.clone(), lengths, k_new=k_new, v_new=v_new)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a length was read on the host"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a length was read on the host"))
    with torch.no_grad():
        out = flashattn.decode(q, k_cache, v_cache, lengths.to(DEVICE), max_seqlen=11, k_new=k_new, v_new=v_new)
    assert torch.equal(out, expected) and torch.equal(k_cache, expected_cache)


@pytest.mark.parametrize("change, error, words", [
    (dict(v_new=None), ValueError, "k_new was given without v_new"),
    (dict(k_new="x"), TypeError, "k_new must be a torch.Tensor"),
    (dict(k_new=torch.zeros(2, 2, 3, 24)), ValueError, r"k_new has shape \(2, 2, 3, 24\); expected \(B, H_kv, N_q, D\)"),
    (dict(v_new=torch.zeros(2, 2, 2, 24, dtype=torch.float64)), TypeError, "v_new has dtype torch.float64"),
    (dict(rotary_cos=torch.zeros(8, 4), rotary_sin=torch.zeros(8, 4)), ValueError,
     "rotary_cos has 8 positions but the cache reaches 11 tokens"),
    (dict(lengths=torch.tensor([4, 39], dtype=torch.int32)), ValueError, r"cache_seqlens\[1\] is 39; with k_new .* 0 to N_max - N_q = 38"),
    (dict(rotary_cos=torch.zeros(8, 4)), ValueError, "rotary_cos and rotary_sin go together"),
    (dict(rotary_cos=torch.zeros(8, 13), rotary_sin=torch.zeros(8, 13)), ValueError, "rotary_dim = 26 must be from 2 to the head dim 24"),
    (dict(rotary_cos=torch.zeros(8, 4), rotary_sin=torch.zeros(8, 5)), ValueError, "must be equal"),
    (dict(rotary_cos=torch.zeros(8, 4), rotary_sin=torch.zeros(8, 4), rotary_interleaved=1), TypeError, "rotary_interleaved must be a bool"),
])
def test_bad_cache_steps_are_named(change, error, words):
    q, k_cache, v_cache, k_new, v_new, lengths = setup(torch.float32, [4, 9])
    args = dict(k_new=k_new, v_new=v_new)
    change = dict(change)
    lengths = change.pop("lengths", lengths)
    # the parameters' tensors were made at collection, on the CPU: on the inputs' device here
    args.update({name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in change.items()})
    with pytest.raises(error, match=words), torch.no_grad():
        flashattn.decode(q, k_cache, v_cache, lengths, **args)


@pytest.mark.gpu
def test_gpu_a_step_that_appends_and_rotates_replays_in_a_cuda_graph():
    """A serving step captured once: each replay rotates its own q and new keys, writes them at its
    own lengths, and matches an uncaptured step on a copy of the cache."""
    dtype, n_max = torch.bfloat16, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache = (torch.randn(4, 2, n_max, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    static = {name: torch.randn(shape, device="cuda", generator=g).to(dtype)
              for name, shape in (("q", (4, 8, 1, 64)), ("k", (4, 2, 1, 64)), ("v", (4, 2, 1, 64)))}
    cos, sin = (t.cuda() for t in rope_tables(n_max, 64))
    lens = torch.tensor([0, 100, 2000, 7], dtype=torch.int32, device="cuda")

    def step(k_c, v_c, lengths, **bound):
        return flashattn.decode(static["q"], k_c, v_c, lengths, k_new=static["k"], v_new=static["v"],
                                rotary_cos=cos, rotary_sin=sin, **bound)

    with torch.inference_mode():
        step(k_cache.clone(), v_cache.clone(), lens, max_seqlen=n_max)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step(k_cache, v_cache, lens, max_seqlen=n_max)
        for lengths in ([5, 2047, 0, 1000], [1, 2, 3, 4]):
            for t in static.values():
                t.copy_(torch.randn(t.shape, device="cuda", generator=g).to(dtype))
            lens.copy_(torch.tensor(lengths, dtype=torch.int32))
            k_copy, v_copy = k_cache.clone(), v_cache.clone()
            graph.replay()
            want = step(k_copy, v_copy, lens.cpu())
            torch.testing.assert_close(static_out, want)
            torch.testing.assert_close(k_cache, k_copy, rtol=0, atol=0)


# -- softcap and sliding windows in decode ----------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("softcap, window", [(5.0, -1), (0.0, 0), (0.0, 6), (3.0, 20), (0.0, 100)])
@pytest.mark.parametrize("n_q", [1, 3])
def test_decode_softcap_and_windows_against_the_reference(dtype, softcap, window, n_q):
    """Token t sees the window's keys before it (bottom-right), with the scores capped, in every
    split: ragged lengths, an empty sequence, a window longer than the cache."""
    lengths = torch.tensor([0, n_q, 17, 40, 33], dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(5, 4, n_q, 24, generator=g).to(DEVICE, dtype)
    k_cache, v_cache = (torch.randn(5, 2, 40, 24, generator=g).to(DEVICE, dtype) for _ in range(2))
    with torch.no_grad():
        out, lse = flashattn.decode(q, k_cache, v_cache, lengths, softcap=softcap, window_size=(window, 0),
                                    return_lse=True)
    ref, ref_lse = decode_reference(q.double(), k_cache.double(), v_cache.double(), lengths, softcap=softcap,
                                    window=window)
    low, _ = decode_reference(q, k_cache, v_cache, lengths, softcap=softcap, window=window)
    assert within_rule(out, ref, low, dtype)
    assert torch.equal(lse == float("-inf"), ref_lse == float("-inf"))
    finite = ref_lse > float("-inf")
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=2e-2 if dtype != torch.float32 else 1e-4)


def test_a_window_reads_nothing_before_the_first_tokens_window():
    """Keys before the window are NaN: had decode loaded their tiles, 0 * NaN would reach the output."""
    q, k_cache, v_cache, _, _, _ = setup(torch.float32, [0, 0], n_q=1, n_max=200)
    lengths = torch.tensor([200, 150], dtype=torch.int32)
    k_cache[0, :, :128], v_cache[0, :, :128] = float("nan"), float("nan")    # row 0 sees keys 189..199
    k_cache[1, :, :128], v_cache[1, :, :128] = float("nan"), float("nan")    # row 1 sees keys 139..149
    with torch.no_grad():
        out = flashattn.decode(q, k_cache, v_cache, lengths, window_size=(10, 0))
    clean = [t.clone() for t in (k_cache, v_cache)]
    for t in clean:
        t[:, :, :128] = 0.0
    ref, _ = decode_reference(q.double(), clean[0].double(), clean[1].double(), lengths, window=10)
    assert torch.isfinite(out).all() and torch.allclose(out.double(), ref, atol=1e-5)


def test_a_window_matches_attention_aligned_bottom_right():
    """decode's window is flashattn.attention's bottom-right window on the valid cache."""
    q, k_cache, v_cache, _, _, _ = setup(torch.float32, [0], n_q=3, heads=2, kv_heads=2)
    lengths = torch.tensor([29], dtype=torch.int32)
    with torch.no_grad():
        out = flashattn.decode(q, k_cache, v_cache, lengths, window_size=(7, 0), softcap=4.0)
        want = flashattn.attention(q, k_cache[:, :, :29], v_cache[:, :, :29], is_causal=True, window_size=(7, 0),
                                   causal_alignment="bottom_right", softcap=4.0)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap="1"), TypeError, "softcap must be a real number"),
    (dict(window_size=(4, 2)), ValueError, r"window_size is \(4, 2\): with causal=True right must be -1 or 0"),
    (dict(window_size=(-2, 0)), ValueError, "each side must be >= 0, or -1"),
    (dict(window_size=4), TypeError, "window_size must be a pair"),
])
def test_bad_decode_modifications_are_named(kwargs, error, words):
    q, k_cache, v_cache, _, _, lengths = setup(torch.float32, [4, 9])
    with pytest.raises(error, match=words), torch.no_grad():
        flashattn.decode(q, k_cache, v_cache, lengths + 2, **kwargs)
