"""HostArena: the weights' huge-page block of host memory."""

from __future__ import annotations

import sys

import pytest
import torch

from prepos.engines import host_arena
from prepos.engines.host_arena import HUGE_PAGE, HostArena, huge_page_bytes, thp_mode
from prepos.engines.torch_llama import TorchLlamaEngine


def test_take_hands_out_disjoint_aligned_tensors():
    shapes = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((2, 2, 9), torch.float16), ((1000,), torch.float32)]
    sizes = [torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in shapes]
    arena = HostArena(HostArena.size_for(sizes))
    assert arena._raw.data_ptr() % HUGE_PAGE == 0
    taken = [arena.take(s, d) for s, d in shapes]
    for t, (shape, dtype) in zip(taken, shapes):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 4096 == 0
    spans = sorted((t.data_ptr(), t.data_ptr() + n) for t, n in zip(taken, sizes))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    for i, t in enumerate(taken):  # writes land in their own tensor only
        t.fill_(i + 1)
    assert [t.float().unique().tolist() for t in taken] == [[1.0], [2.0], [3.0], [4.0]]
    with pytest.raises(ValueError, match="0 left"):
        arena.take((1,), torch.uint8)


def test_take_past_the_end_names_the_request():
    arena = HostArena(100)
    arena.take((20,), torch.float32)
    with pytest.raises(ValueError, match=r"arena of 100 bytes has .*\(30,\) torch.float32"):
        arena.take((30,), torch.float32)
    with pytest.raises(ValueError, match="must be >= 0"):
        HostArena(-1)


def test_size_for_counts_page_alignment():
    assert HostArena.size_for([]) == 0
    assert HostArena.size_for([10]) == 10
    assert HostArena.size_for([10, 10]) == 4096 + 10
    assert HostArena.size_for([4096, 1, 4096]) == 2 * 4096 + 4096


def test_tensors_outlive_the_arena_object():
    arena = HostArena(1 << 20)
    t = arena.take((256,), torch.float32).fill_(3.0)
    del arena
    assert t.sum().item() == 768.0


@pytest.mark.parametrize("text, mode", [
    ("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
    ("always madvise [never]\n", "never"), ("garbled\n", "unavailable"),
])
def test_thp_mode_reads_the_bracketed_mode(tmp_path, monkeypatch, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    monkeypatch.setattr(host_arena, "_THP_ENABLED", str(path))
    assert thp_mode() == mode
    monkeypatch.setattr(host_arena, "_THP_ENABLED", str(tmp_path / "absent"))
    assert thp_mode() == "unavailable"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_huge_page_bytes_finds_the_mapping():
    arena = HostArena(8 << 20)
    t = arena.take((2 << 20,), torch.float32).fill_(1.0)  # touch all 8 MiB
    huge = huge_page_bytes(t)
    assert huge is not None and 0 <= huge <= (8 << 20) + HUGE_PAGE
    assert huge % HUGE_PAGE == 0


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_engine_weights_in_the_arena_give_the_same_logits(which, request):
    path, _ = request.getfixturevalue(which)
    ids = [5, 9, 300, 17, 2, 44, 100]
    in_arena, plain = TorchLlamaEngine(path), TorchLlamaEngine(path, host_arena=False)
    arena_w, plain_w = in_arena.products, plain.products
    base = arena_w.lm_head.untyped_storage().data_ptr()
    matrices = [*arena_w.wqkv, *arena_w.wo, *arena_w.wgu, *arena_w.wdown, arena_w.lm_head]
    assert {m.untyped_storage().data_ptr() for m in matrices} == {base}  # one block of memory
    assert plain_w.wqkv[0].untyped_storage().data_ptr() != plain_w.wo[0].untyped_storage().data_ptr()
    for a, b in zip(matrices, [*plain_w.wqkv, *plain_w.wo, *plain_w.wgu, *plain_w.wdown, plain_w.lm_head]):
        assert torch.equal(a, b)
    assert torch.equal(in_arena.prefill("s", ids[:5]), plain.prefill("s", ids[:5]))
    for t in ids[5:]:
        assert torch.equal(in_arena.decode("s", t), plain.decode("s", t))
