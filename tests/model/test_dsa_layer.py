"""The DSA layer's k-mer hash and its copying start, on real DNA."""

import numpy as np
import torch

from megabase.eval.probe import recall_probe
from megabase.eval.score import ModelScorer
from megabase.model import build_model
from megabase.model.dsa import KmerHash


def test_kmer_hash_matches_where_a_key_follows_a_copy_of_the_query_context():
    torch.manual_seed(0)
    h = KmerHash(8, 8, query=12, key=12)
    h.table.data[..., 12:] = h.table.data[..., :12]  # tied, as a copying head starts
    ids = torch.randint(0, 4, (1, 300))
    ids[0, 200:240] = ids[0, 50:90]
    q, k = h(ids)
    # query 230 hashes ids[223..230] = ids[73..80]; key 81 hashes ids[73..80] too
    assert torch.allclose(q[0, 230], k[0, 81])
    assert not torch.allclose(q[0, 230], k[0, 80])
    # streamed in pieces with the carried tail, the hash is the full pass's, bit for bit
    tail, parts = None, []
    for a, b in ((0, 1), (1, 97), (97, 300)):
        parts.append(torch.cat(h(ids[:, a:b], tail), -1))
        tail = h.tail(ids[:, a:b], tail)
    assert torch.equal(torch.cat(parts, 1), torch.cat((q, k), -1))


def test_copying_start_finds_the_first_copy_on_real_dna(bundled_store):
    """An untrained cpu-small already selects the aligned key for most second-copy queries at
    every probe distance (chance: about topk / distance); without the hash it selects at chance."""
    tokens = np.array(bundled_store.tokens("chr22"))
    rates = {}
    for kmer in (0, 16):
        torch.manual_seed(0)
        scorer = ModelScorer(build_model("cpu-small", dsa_kmer=kmer))
        rows = recall_probe(scorer, tokens, [1_000, 8_000], n_per_distance=2, n_boot=10)
        rates[kmer] = [(min(r["dsa_hit_rate"]), r["chance_hit_rate"]) for r in rows]
    assert all(hit > max(0.4, 3 * chance) for hit, chance in rates[16]), rates
    assert all(hit < 2 * chance for hit, chance in rates[0])
