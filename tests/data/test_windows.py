import numpy as np
import pytest

from megabase.data import Window, make_windows, parse_region, read_bed, write_bed
from megabase.data.windows import parse_split


def test_parse_split_keeps_commas_inside_coordinates():
    assert parse_split("train=chr01,chr02") == ("train", ["chr01", "chr02"])
    assert parse_split("eval=chr22:30,000,001-40,000,000,chr21") == (
        "eval", ["chr22:30,000,001-40,000,000", "chr21"])


def test_parse_region_is_samtools_style():
    names = ["chr22", "HLA-A*01:01"]
    r = parse_region("chr22:30,000,001-40,000,000", names)
    assert (r.name, r.start, r.end) == ("chr22", 30_000_000, 40_000_000)
    assert parse_region("22:101", names).start == 100 and parse_region("22:101", names).end is None
    assert parse_region("HLA-A*01:01", names).name == "HLA-A*01:01"


def test_windows_tile_every_umaydis_record_exactly(umaydis_store):
    L = 65_536
    windows, summary = make_windows(
        umaydis_store, {"train": ["chr01", "chr02"], "eval": ["chr22"]}, L, max_n_frac=1.0)
    for split, names in (("train", ["chr01", "chr02"]), ("eval", ["chr22"])):
        for name in names:
            mine = [w for w in windows if w.chrom == name]
            assert all(w.split == split for w in mine)
            assert mine[0].start == 0 and mine[-1].end == umaydis_store.length(name)
            assert all(a.end == b.start for a, b in zip(mine, mine[1:]))
            assert all(w.length == L for w in mine[:-1]) and 0 < mine[-1].length <= L
    assert summary["eval"].windows == -(-403_592 // L)
    again, _ = make_windows(
        umaydis_store, {"train": ["chr01", "chr02"], "eval": ["chr22"]}, L, max_n_frac=1.0)
    assert again == windows


def test_stride_overlap_and_short_records(umaydis_store):
    windows, summary = make_windows(umaydis_store, {"eval": ["chr22"]}, 100_000, stride=60_000)
    assert [w.start for w in windows][:3] == [0, 60_000, 120_000]
    assert windows[-1].end == 403_592 and all(w.end <= 403_592 for w in windows)
    short, s = make_windows(umaydis_store, {"x": ["um_contig_1.264"]}, 1_000_000)
    assert short == [Window("um_contig_1.264", 0, 2211, "x")] and s["x"].short == 1


def test_n_rich_windows_are_dropped_and_counted(hsap_store):
    L = 1_048_576
    windows, summary = make_windows(hsap_store, {"eval": ["chr22"]}, L, max_n_frac=0.5)
    tokens = hsap_store.tokens("chr22")
    total = -(-51_304_566 // L)
    assert summary["eval"].windows + summary["eval"].dropped_n == total
    assert summary["eval"].dropped_n >= 16  # the p-arm (first ~16 Mbp) is all N
    for w in windows:
        assert np.count_nonzero(tokens[w.start : w.end] == 4) <= 0.5 * w.length


def test_region_split_of_human_chr22(hsap_store):
    splits = {"train": ["chr22:1-35,000,000"], "eval": ["chr22:35,000,001-51,304,566"]}
    windows, _ = make_windows(hsap_store, splits, 262_144)
    train = [w for w in windows if w.split == "train"]
    evals = [w for w in windows if w.split == "eval"]
    assert max(w.end for w in train) <= 35_000_000 <= min(w.start for w in evals)


def test_bed_round_trip(tmp_path, umaydis_store):
    windows, _ = make_windows(umaydis_store, {"train": ["chr01"], "eval": ["chr22"]}, 500_000)
    path = write_bed(tmp_path / "w.bed", windows, "made by a test\nsecond line")
    assert path.read_text().startswith("# made by a test\n# second line\n#chrom\tstart\tend\tsplit\n")
    assert read_bed(path) == windows
    assert read_bed(path, split="eval") == [w for w in windows if w.split == "eval"]


@pytest.mark.parametrize("kwargs,match", [
    ({"length": 0}, "positive"), ({"stride": 0}, "stride"), ({"max_n_frac": 1.5}, "max_n_frac must be within"),
    ({"on_short": "pad"}, "policy"),
])
def test_bad_parameters(umaydis_store, kwargs, match):
    from megabase.data import InputError

    args = {"length": 100, **kwargs}
    with pytest.raises(InputError, match=match):
        make_windows(umaydis_store, {"eval": ["chr22"]}, **args)
