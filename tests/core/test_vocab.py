import numpy as np
import pytest
import torch

from megabase.data import (
    N, PAD, SEP, SYMBOLS, detokenize, repeat_mask, reverse_complement, tokenize, vocab_dict,
)


def test_bases_and_case_fold_to_the_same_ids():
    assert tokenize("ACGTacgt").tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert tokenize(b"acgt").dtype == np.uint8


@pytest.mark.parametrize("code", list("NRYKMSWBDHVUnrykmswbdhvu-."))
def test_every_iupac_code_and_gap_is_n(code):
    assert tokenize(code).tolist() == [N]


@pytest.mark.parametrize("bad", ["X", "1", " ", "\n", "*", ">", "é"])
def test_invalid_character_names_char_and_position(bad):
    with pytest.raises(ValueError, match=r"position 2"):
        tokenize("AC" + bad + "GT")


def test_detokenize_round_trip_upper_cases():
    seq = "ACGTNacgtnRYswKM-."
    assert detokenize(tokenize(seq)) == "ACGTNACGTNNNNNNNNN"
    assert detokenize(torch.tensor([SEP, 0, 1, PAD]), skip_special=True) == "AC"
    with pytest.raises(ValueError):
        detokenize([SEP, 0])


def test_repeat_mask_marks_lower_case():
    assert repeat_mask("ACgtN-n").tolist() == [False, False, True, True, False, False, True]


def test_reverse_complement_is_exact_and_self_inverse():
    ids = tokenize("AACGTNG")
    assert detokenize(reverse_complement(ids)) == "CNACGTT"
    rng = np.random.default_rng(0)
    x = rng.integers(0, 7, size=1001).astype(np.uint8)
    assert np.array_equal(reverse_complement(reverse_complement(x)), x)
    t = torch.from_numpy(x)
    assert torch.equal(reverse_complement(reverse_complement(t)), t)
    assert np.array_equal(reverse_complement(t).numpy(), reverse_complement(x))


def test_vocab_is_documented_once():
    vocab = vocab_dict()
    assert vocab["symbols"] == list(SYMBOLS) == ["A", "C", "G", "T", "N", "<pad>", "<sep>"]
    assert (vocab["pad"], vocab["sep"], vocab["n"]) == (PAD, SEP, N)
