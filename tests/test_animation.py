"""The animations of one program walking its tiles (flashattn.plotting.animation): one frame per tile
the program visits, in the kernel's order, ending on the right values, and HTML that plays anywhere."""
import gc

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from flashattn import plotting
from flashattn.kernels import traversal
from flashattn.testing import reference  # noqa: E402

# most tests look at an animation's frames without rendering it, which matplotlib warns about
pytestmark = pytest.mark.filterwarnings("ignore:Animation was deleted without rendering")


@pytest.fixture(autouse=True)
def _delete_animations():
    """Delete each test's animations (held in cycles with their figures) while the filter above
    holds: collected during a later test, they warned there."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(40, 16, generator=g, dtype=torch.float64) for _ in range(4)]


def frames(animation):
    """How many frames ``animation`` has (it is given a frame count), closing its figure."""
    plt.close(animation._fig)
    return animation._save_count


@pytest.mark.parametrize("causal", [False, True])
def test_forward_walk_visits_the_kernels_tiles(qkv, causal):
    q, k, v, _ = qkv
    anim = plotting.forward_walk(q, k, v, block_q=16, block_kv=8, q_block=2, is_causal=causal)
    _, kv_end = traversal.kv_ranges(32, 16, 8, 40, causal)
    assert frames(anim) == -(-kv_end // 8)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_walks_visit_the_kernels_tiles(qkv, causal):
    q, k, v, do = qkv
    kinds = traversal.classify_blocks(40, 40, 16, 8, causal)
    dkdv = plotting.dkdv_walk(q, k, v, do, block_q=16, block_kv=8, kv_block=1, is_causal=causal)
    assert frames(dkdv) == int((kinds[:, 1] != traversal.SKIPPED).sum())
    dq = plotting.dq_walk(q, k, v, do, block_q=16, block_kv=8, q_block=1, is_causal=causal)
    assert frames(dq) == int((kinds[1] != traversal.SKIPPED).sum())


def test_the_walks_end_on_the_right_values(qkv):
    """The last frame's state is the reference: the forward's output rows, and dK, dV, dQ of the
    program's block from torch.autograd."""
    from flashattn.plotting import animation

    q, k, v, do = (t.clone().requires_grad_() for t in qkv)
    out, _ = reference.naive_attention(q, k, v, is_causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    seen = {}

    def spy(states, *args, **kwargs):  # the states the animation draws, frame by frame
        seen["states"] = states
        return original(states, *args, **kwargs)

    original = animation._walk_panels
    animation._walk_panels = spy
    try:
        plt.close(plotting.dkdv_walk(*qkv, 16, 8, kv_block=2, is_causal=True)._fig)
        last_dv, last_dk = seen["states"][-1][2]
        assert torch.allclose(last_dv, dv[16:24]) and torch.allclose(last_dk, dk[16:24])
        plt.close(plotting.dq_walk(*qkv, 16, 8, q_block=1, is_causal=True)._fig)
        assert torch.allclose(seen["states"][-1][2][0], dq[16:32])
    finally:
        animation._walk_panels = original


def test_as_html_plays_in_a_page(qkv):
    q, k, v, _ = qkv
    html = plotting.as_html(plotting.forward_walk(q[:16], k[:16], v[:16], block_q=16, block_kv=8))
    assert "<script" in html.data and html.data.count("data:image/png;base64") == 2
