"""The rows kernel (eyas.models.rows_matmul): what F.linear computes, each row the same whatever rows run beside
it, and F.linear wherever the kernel does not take the call."""

import pytest
import torch
from torch import nn

from eyas.models import c_kernels, rows_matmul
from eyas.models.layers import gemv_layout


@pytest.fixture(autouse=True)
def one_thread():
    """The kernel runs where torch runs on one thread (the engine's rule for small models on CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def head(n: int, k: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=False)
    linear.weight = nn.Parameter(gemv_layout(linear.weight.detach()), requires_grad=False)
    return linear


@pytest.mark.parametrize("n, k", [(8192, 192), (300, 64), (37, 5), (16, 1)])  # column tails of 16 and of 1
def test_the_kernel_computes_f_linear_and_each_row_alone_equals_it_in_the_batch(n, k):
    linear = head(n, k)
    for m in (1, 2, 3, 4, 5, 6, 8, 9, 17, 32):
        x = torch.randn(m, k)
        with torch.no_grad():
            assert rows_matmul.takes(x, linear)
            got = rows_matmul.rows_matmul(x, linear)
            torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
            for r in range(m):  # bit for bit: a decode row and the same row among verify rows agree
                assert torch.equal(rows_matmul.rows_matmul(x[r:r + 1], linear), got[r:r + 1])
    x = torch.randn(2, 3, k)
    with torch.no_grad():
        torch.testing.assert_close(rows_matmul.linear_rows(x, linear), linear(x), rtol=1e-5, atol=1e-5)
        assert rows_matmul.linear_rows(x[:0], linear).shape == (0, 3, n)


@pytest.mark.parametrize("n, k", [(8192, 192), (37, 5)])
def test_a_bfloat16_weight_gives_its_float32_copys_logits_bit_for_bit(n, k):
    """Half the bytes read, the same logits: the kernel widens bfloat16 exactly; bfloat16 rows are widened too."""
    as_float = head(n, k)
    as_float.weight.data = gemv_layout(as_float.weight.detach().bfloat16().float())
    as_bf16 = nn.Linear(k, n, bias=False)
    as_bf16.weight = nn.Parameter(gemv_layout(as_float.weight.detach().bfloat16()), requires_grad=False)
    for m in (1, 2, 4, 9, 32):
        x = torch.randn(m, k)
        with torch.no_grad():
            assert rows_matmul.takes(x, as_bf16) and rows_matmul.takes(x.bfloat16(), as_bf16)
            got = rows_matmul.linear_rows(x, as_bf16)
            assert got.dtype == torch.float32 and torch.equal(got, rows_matmul.linear_rows(x, as_float))
            assert torch.equal(rows_matmul.linear_rows(x.bfloat16(), as_bf16),
                               rows_matmul.linear_rows(x.bfloat16().float(), as_float))
    assert not rows_matmul.takes(torch.randn(2, k).half(), as_bf16)


def test_f_linear_runs_where_the_kernel_does_not_take_the_call():
    linear = head(64, 32)
    x = torch.randn(3, 32)
    row_major = nn.Linear(32, 64, bias=False)  # not in gemv_layout
    with_bias = head(64, 32)
    with_bias.bias = nn.Parameter(torch.zeros(64))
    with torch.no_grad():
        assert not rows_matmul.takes(x, row_major) and not rows_matmul.takes(x, with_bias)
        assert not rows_matmul.takes(x.double(), linear) and not rows_matmul.takes(x[:, :16], linear)
        torch.testing.assert_close(rows_matmul.linear_rows(x, row_major), row_major(x))
    torch.set_num_threads(2)  # BLAS spreads the head over every thread
    assert not rows_matmul.takes(x, linear)
    torch.set_num_threads(1)
    assert not rows_matmul.takes(x.requires_grad_(), linear)  # training keeps autograd's op


def test_the_logits_run_f_linear_where_the_kernel_cannot_be_built(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(c_kernels, "COMPILER", str(tmp_path / "no-such-cc"))
    rows_matmul._library.cache_clear()
    linear = head(64, 32)
    try:
        with pytest.warns(UserWarning, match="the lm_head runs F.linear.*set CC"):
            assert not rows_matmul.takes(torch.randn(2, 32), linear)
        with torch.no_grad():
            x = torch.randn(2, 32)
            torch.testing.assert_close(rows_matmul.linear_rows(x, linear), linear(x))
    finally:
        rows_matmul._library.cache_clear()
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.parametrize("tied, threads", [(False, 1), (True, 1), (False, 2)])
def test_a_bfloat16_targets_logits_are_float32_whatever_rows_run_beside(tmp_path, tied, threads):
    """A tied lm_head is the embedding's matrix (rows an embedding reads): the target keeps a copy in the kernel's
    layout, so its logits are float32 and batch-invariant as an untied head's. On several threads BLAS takes the
    logits: from a float32 copy, not rounded to bfloat16."""
    from tiny import make_hf_checkpoint

    from eyas import load_model
    from eyas.models.layers import pack_for_inference

    make_hf_checkpoint(tmp_path, dtype=torch.bfloat16, tie_word_embeddings=tied)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    torch.set_num_threads(threads)
    pack_for_inference(model)
    assert (model.rows_head is not None) == (tied or threads > 1)
    x = torch.randn(5, model.config.hidden_size).bfloat16()
    with torch.no_grad():
        logits = model.compute_logits(x)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, x.float() @ model.lm_head.weight.float().t(), rtol=1e-5, atol=1e-5)
        if threads == 1:  # the kernel's; BLAS on several threads does not promise it
            assert all(torch.equal(model.compute_logits(x[r:r + 1]), logits[r:r + 1]) for r in range(5))
