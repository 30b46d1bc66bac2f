"""The input's exact k-mer embedding: rows, the non-base row, and the carried tail."""

import numpy as np
import pytest
import torch

from megabase.core.vocab import N_BASES, PAD
from megabase.model.kmer import KmerEmbedding


def _expected_rows(ids: list[int], n: int) -> np.ndarray:
    """Row of each k-mer (k = 2..n) ending at each position, computed base by base."""
    offset, out = 0, np.zeros((len(ids), n - 1), dtype=np.int64)
    for k in range(2, n + 1):
        for t in range(len(ids)):
            kmer = [ids[t - j] if t - j >= 0 else PAD for j in range(k)]  # kmer[j]: j back
            if all(b < N_BASES for b in kmer):
                out[t, k - 2] = offset + sum(b * N_BASES**j for j, b in enumerate(kmer))
            else:
                out[t, k - 2] = offset + N_BASES**k
        offset += N_BASES**k + 1
    return out


def test_rows_are_the_exact_kmers(real_tokens):
    ids = real_tokens[:, 5_000:5_300].clone()
    ids[0, 100] = 4  # an N: every k-mer holding it goes to its table's own row
    emb = KmerEmbedding(5, 8)
    got = emb.rows(ids)[0].numpy()
    np.testing.assert_array_equal(got, _expected_rows(ids[0].tolist(), 5))
    offsets = np.cumsum([0] + [N_BASES**k + 1 for k in range(2, 5)])
    for k in range(2, 6):  # the k k-mers that hold the N share their table's last row
        assert (got[100 : 100 + k, k - 2] == offsets[k - 2] + N_BASES**k).all()
        assert got[100 + k, k - 2] != offsets[k - 2] + N_BASES**k
    assert got.max() < emb.table.shape[0]


def test_a_piece_with_its_tail_embeds_as_the_whole(real_tokens):
    torch.manual_seed(0)
    emb = KmerEmbedding(8, 16)
    torch.nn.init.normal_(emb.table)
    ids = real_tokens[:, :2_000]
    whole = emb(ids)
    tail, parts = None, []
    for piece in ids.split([3, 700, 1_297], dim=1):  # a piece shorter than the tail, too
        parts.append(emb(piece, tail))
        tail = emb.tail(piece, tail)
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=0, atol=0)


@pytest.mark.parametrize("value", [1, 11, -1])
def test_bad_sizes_are_refused(value):
    from megabase.core.errors import InputError
    from megabase.model import get_preset

    with pytest.raises(InputError, match="model.kmer_embed"):
        get_preset("debug", kmer_embed=value)
