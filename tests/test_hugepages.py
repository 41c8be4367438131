"""Decoding weights on 2 MiB pages (engine/hugepages.py): the same values on other pages, the huge page advice
on their mapping, and a decoding forward whose every output is what it was on 4 KiB pages."""

import pytest
import torch

from draftsmith.engine import hugepages
from draftsmith.engine.fastpath import FastBody
from tests.test_blockquant import _packed_tiny
from tests.test_fastpath import _hf_and_fast


def _need_huge_pages(monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_HUGEPAGES", raising=False)
    why = hugepages.why_not()
    if why is not None:
        pytest.skip(f"no transparent huge pages here: {why}")


def test_placed_tensors_keep_their_values_in_one_advised_aligned_mapping(monkeypatch):
    _need_huge_pages(monkeypatch)
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(1000, 577, generator=g), torch.randint(0, 255, (33, 7), dtype=torch.uint8),
          torch.randn(3, 5, generator=g).bfloat16(), torch.randn(2049, 1024, generator=g)]
    placed = hugepages.to_huge_pages(ts)
    assert placed is not None and placed.address % hugepages.HUGE == 0
    assert placed.nbytes % hugepages.HUGE == 0 and placed.nbytes >= sum(t.numel() * t.element_size() for t in ts)
    for t, v in zip(ts, placed.tensors):
        assert v.dtype == t.dtype and v.shape == t.shape and v.is_contiguous()
        assert torch.equal(v, t) and v.data_ptr() != t.data_ptr()
        assert v.data_ptr() % hugepages.ALIGN == 0
        assert placed.address <= v.data_ptr() < placed.address + placed.nbytes
    assert placed.advised(), "the mapping lacks the huge page advice (VmFlags hg)"
    region = hugepages.smaps_region(placed.address)
    assert region is not None and region["Size"] >= placed.nbytes
    assert region["range"][0] <= placed.address < region["range"][1]
    assert placed.huge_bytes() is not None
    # the views own the mapping: writing through one after the list is gone is still valid memory
    v = placed.tensors[0]
    del placed
    v.add_(1.0)
    assert torch.equal(v, ts[0] + 1.0)


def test_turned_off_or_refused_input_places_nothing(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_HUGEPAGES", "0")
    assert hugepages.why_not() == "DRAFTSMITH_HUGEPAGES=0"
    assert hugepages.to_huge_pages([torch.ones(4)]) is None
    monkeypatch.delenv("DRAFTSMITH_HUGEPAGES")
    if hugepages.why_not() is None:
        with pytest.raises(ValueError, match="contiguous"):
            hugepages.to_huge_pages([torch.ones(4, 6).t()])
        assert hugepages.to_huge_pages([]) is None


def test_a_kernel_setting_of_never_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv("DRAFTSMITH_HUGEPAGES", raising=False)
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "THP_SETTING", setting)
    assert hugepages.thp_setting() == "never"
    if hasattr(__import__("mmap"), "MADV_HUGEPAGE"):
        assert "never" in hugepages.why_not()
    setting.write_text("always [madvise] never\n")
    assert hugepages.thp_setting() == "madvise"
    monkeypatch.setattr(hugepages, "THP_SETTING", tmp_path / "missing")
    assert hugepages.thp_setting() is None


@pytest.mark.parametrize("pack", [False, True], ids=["float32", "packed"])
def test_the_fast_forward_reads_its_weights_from_huge_pages_and_computes_the_same_bits(monkeypatch, pack):
    _need_huge_pages(monkeypatch)
    tgt = _packed_tiny()  # matrices on Q4_1/Q8_0 grids: with pack, every group packs
    monkeypatch.setenv("DRAFTSMITH_HUGEPAGES", "0")
    small = FastBody(tgt.model, compile=False, pack=pack)
    assert small.core.pages == {"why": "DRAFTSMITH_HUGEPAGES=0"}
    a = _hf_and_fast(tgt, small)
    monkeypatch.delenv("DRAFTSMITH_HUGEPAGES")
    tgt2 = _packed_tiny()
    fast = FastBody(tgt2.model, compile=False, pack=pack)
    if not fast.core.rows_native:
        pytest.skip("the native kernels are not built here: the step's products are torch's")
    assert bool(fast.packed) == pack
    pages = fast.core.pages
    assert pages.get("mb", 0) > 0, pages
    # what the step reads (packed copies, else the matrices, the model's own o/down/head parameters moved by
    # .data: one copy in memory) lives in one advised mapping
    read = ([p.q for ps in fast.core.packed.values() for p in ps] if pack else
            [w for ws in fast.core.weight_groups().values() for w in ws])
    region = hugepages.smaps_region(read[0].data_ptr())
    assert region is not None and "hg" in region.get("VmFlags", ())
    assert all(hugepages.smaps_region(t.data_ptr())["range"] == region["range"] for t in read[1:])
    assert tgt2.model.model.layers[0].self_attn.o_proj.weight.data_ptr() == fast.core.o[0].data_ptr()
    assert fast.core.place_on_huge_pages() is pages  # once per core
    b = _hf_and_fast(tgt2, fast)
    assert torch.equal(a[1], b[1]), "the same forward on other pages gave other logits"
    for l1, l2 in zip(a[3].layers, b[3].layers):
        assert torch.equal(l1.keys, l2.keys) and torch.equal(l1.values, l2.values)


def test_a_compiled_fast_body_raises_dynamos_graph_limit():
    """Every FastBody compiles the same function under its own guards; at dynamo's default limit of 8 a process
    holding several compiled lines (benchmarks.fastest_plain --pages-ab: six) ran the last ones eagerly. Building
    one raises the limit, before any graph is traced."""
    import torch._dynamo
    from tests.test_decoder import tiny
    cfg = torch._dynamo.config
    before = cfg.recompile_limit  # set and put back by hand: monkeypatch's undo deletes the option (torch 2.13)
    try:
        cfg.recompile_limit = 8
        FastBody(tiny(vocab=40, layers=1).model, compile=False)
        assert cfg.recompile_limit == 8  # an eager body compiles nothing
        FastBody(tiny(vocab=40, layers=1).model, compile=True)
        assert cfg.recompile_limit >= 64
    finally:
        cfg.recompile_limit = before
    assert cfg.recompile_limit == before
