import pytest

from auditor import lrmath


@pytest.mark.parametrize("m,n,expected", [(4096, 4096, 2048.0), (4096, 1024, 819.2), (768, 768, 384.0)])
def test_break_even_exact(m, n, expected):
    assert lrmath.break_even(m, n) == expected


def test_break_even_embedding_one_decimal():
    assert round(lrmath.break_even(50_000, 768), 1) == 756.4


def test_square_layer_compression_is_d_over_2r():
    assert lrmath.params_dense(4096, 4096) == 16_777_216
    assert lrmath.params_at_rank(4096, 4096, 256) == 2_097_152
    assert lrmath.compression(4096, 4096, 256) == 8.0
    assert lrmath.compression(1000, 1000, 50) == 1000 / (2 * 50)


def test_embedding_factorized_params():
    assert lrmath.params_dense(50_000, 768) == 38_400_000
    assert lrmath.params_at_rank(50_000, 768, 128) == 6_498_304


@pytest.mark.parametrize("m,n,r,saves", [(4096, 4096, 2047, True), (4096, 4096, 2048, False),
                                         (4096, 1024, 819, True), (4096, 1024, 820, False), (1, 9, 1, False)])
def test_saves_at_the_boundary(m, n, r, saves):
    assert lrmath.saves(m, n, r) is saves


@pytest.mark.parametrize("m,n,expected", [(4096, 4096, 2047), (4096, 1024, 819), (1, 9, 0), (2, 2, 0), (3, 3, 1)])
def test_max_useful_rank(m, n, expected):
    assert lrmath.max_useful_rank(m, n) == expected


def test_macs_at_rank_linear_and_lookup():
    # Linear 4096x4096 applied at 10 positions: dense 10*m*n, rank 256 -> 10*256*(m+n)
    assert lrmath.macs_at_rank(4096, 4096, 256, macs_linear=10 * 4096 * 4096) == 10 * 256 * 8192
    # embedding: lookups are free dense; the factorized table adds E*H per token
    assert lrmath.macs_at_rank(50_000, 768, 128, macs_linear=0, lookups=128) == 128 * 128 * 768


def test_relative_error():
    assert lrmath.relative_error(0.75) == 0.5
    assert lrmath.relative_error(1.0) == 0.0


def test_energy_rank():
    assert lrmath.energy_rank([0.5, 0.9, 0.99, 1.0], 0.9) == 2
    assert lrmath.energy_rank([0.5, 0.9, 0.99, 1.0], 0.91) == 3
    assert lrmath.energy_rank([0.5, 0.9, 0.99, 1.0], 1.0) == 4
