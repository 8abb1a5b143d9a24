"""Bad input gets a TypeError or ValueError that names the argument and says what was expected."""
import math

import pytest
import torch

import flashattn

DEVICE = flashattn.DEVICE


def t(*shape, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape).to(dtype=dtype, device=device)


GOOD = dict(q=t(1, 2, 8, 16), k=t(1, 2, 8, 16), v=t(1, 2, 8, 16))


def call(**overrides):
    args = dict(GOOD)
    kwargs = {key: overrides.pop(key) for key in ("is_causal", "scale", "return_lse") if key in overrides}
    args.update(overrides)
    return flashattn.attention(args["q"], args["k"], args["v"], **kwargs)


@pytest.mark.parametrize("overrides,error,words", [
    (dict(q=t(1, 2, 8, 16, dtype=torch.float64)), TypeError, ["q", "float64", "float16"]),
    (dict(k=t(1, 2, 8, 16).to(torch.int32)), TypeError, ["k", "int32"]),
    (dict(v=t(1, 2, 8, 16, dtype=torch.float16)), TypeError, ["v", "float16", "q has torch.float32"]),
    (dict(q=[1.0, 2.0]), TypeError, ["q", "torch.Tensor", "list"]),
    (dict(q=t(16)), ValueError, ["q", "at least 2 dims", "(16,)"]),
    (dict(k=t(1, 3, 8, 16), v=t(1, 3, 8, 16)), ValueError, ["k", "leading dims", "(1, 3)", "(1, 2)"]),
    (dict(k=t(3, 8, 16), v=t(3, 8, 16)), ValueError, ["k", "leading dims"]),   # (2, 8, 16) would broadcast
    (dict(k=t(1, 2, 8, 32)), ValueError, ["k", "head dim 32", "16"]),
    (dict(v=t(1, 2, 8, 300)), ValueError, ["v's head dim", "300", "256"]),  # v's may differ from q's
    (dict(v=t(1, 2, 8, 0)), ValueError, ["v's head dim", "is 0"]),
    (dict(q=t(1, 2, 8, 300), k=t(1, 2, 8, 300), v=t(1, 2, 8, 300)), ValueError, ["head dim", "300", "256"]),
    (dict(v=t(1, 2, 9, 16)), ValueError, ["k has 8 keys", "v has 9"]),
    (dict(scale=float("nan")), ValueError, ["scale", "finite", "nan"]),
    (dict(scale=math.inf), ValueError, ["scale", "finite"]),
    (dict(scale=-1.0), ValueError, ["scale", "positive"]),
    (dict(scale="0.1"), TypeError, ["scale", "str"]),
    (dict(is_causal="yes"), TypeError, ["is_causal", "bool"]),
    (dict(return_lse=1), TypeError, ["return_lse", "bool"]),
])
def test_bad_input_is_named(overrides, error, words):
    with pytest.raises(error) as info:
        call(**overrides)
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_tensors_on_another_device():
    # A meta tensor stands in for "some other device" on any machine, GPU or not.
    with pytest.raises(ValueError, match="k is on meta but q is on"):
        call(k=torch.empty(1, 2, 8, 16, device="meta"))
    with pytest.raises(ValueError, match="q is on meta.*flashattn runs on"):
        call(q=torch.empty(1, 2, 8, 16, device="meta"), k=torch.empty(1, 2, 8, 16, device="meta"),
             v=torch.empty(1, 2, 8, 16, device="meta"))


def test_explicit_config_that_cannot_work():
    from flashattn.kernels.backward import attention_backward
    q = t(1, 1, 8, 16)
    with pytest.raises(ValueError, match="BLOCK_Q must divide BLOCK_KV"):
        attention_backward(q, q, q, q, q[..., 0].float(), q, False, 0.25,
                           configs={"bwd_dkdv": dict(BLOCK_KV=32, BLOCK_Q=24)})


def test_the_launchers_below_the_public_ops_refuse_float64():
    """flashattn.attention refuses float64 by name; the launchers a chapter calls directly refuse it
    too, instead of reading float64 through float32 pointers (gradients off by about 2)."""
    from flashattn.kernels import backward, forward

    q, k, v = (torch.randn(1, 1, 5, 16, dtype=torch.float64, device=flashattn.DEVICE) for _ in range(3))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32 tensors, got torch.float64"):
        forward.attention_forward(q, k, v, False, 0.25)
    o, lse2 = forward.attention_forward(q.float(), k.float(), v.float(), False, 0.25)
    with pytest.raises(TypeError, match="got torch.float64"):
        backward.attention_backward(q, k, v, o.double(), lse2, o.double(), False, 0.25)
