"""Weights on 2 MB pages (`speclab.core.pages`): bit-for-bit copies, really on huge pages where the kernel allows, and
a placed model decodes what it did."""
from pathlib import Path

import pytest
import torch

from speclab.core import pages


def _huge_kb_at(ptr: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds address `ptr`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setattr(pages, "ENABLED", True)


def test_copies_are_exact_and_only_where_they_apply(enabled):
    big = torch.randn(1024, 512).to(torch.bfloat16)  # 1 MB
    out = pages.on_huge_pages(big)
    assert out is not big and out.dtype == big.dtype and out.shape == big.shape and torch.equal(out, big)
    assert out.data_ptr() % 64 == 0 and out.is_contiguous()
    second = pages.on_huge_pages(big.float())  # the next one follows in the same mapping, aligned
    assert torch.equal(second, big.float()) and second.data_ptr() % 64 == 0
    small = torch.randn(16, 16)
    assert pages.on_huge_pages(small) is small
    strided = big.t()  # not contiguous: left where it is
    assert pages.on_huge_pages(strided) is strided


def test_weights_land_on_huge_pages_where_the_kernel_allows(enabled):
    if pages._thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {pages._thp_mode() or 'absent'} here")
    w = pages.on_huge_pages(torch.ones(4 << 20, dtype=torch.uint8))  # 4 MB: at least one whole 2 MB page
    assert _huge_kb_at(w.data_ptr()) >= 2048


def test_a_placed_model_keeps_its_ties_and_decodes_the_same(monkeypatch, model_dir):
    from speclab.core.target import Target
    from speclab.generate import generate

    def load(on: bool):
        monkeypatch.setattr(pages, "ENABLED", on)
        monkeypatch.setattr(pages, "MIN_BYTES", 1)  # the tiny model's weights too
        return Target.load(model_dir["qwen3"], dtype="fp32")

    plain, placed = load(False), load(True)
    p0, p1 = dict(plain.model.named_parameters()), dict(placed.model.named_parameters())
    assert all(torch.equal(p0[n], p) for n, p in p1.items())
    on_arena = {n for n, p in p1.items() if pages._ARENA.buf is not None
                and p.untyped_storage().data_ptr() == pages._ARENA.buf.untyped_storage().data_ptr()}
    assert on_arena, "nothing was placed"
    def tied(t):
        return t.model.get_input_embeddings().weight is t.model.get_output_embeddings().weight
    assert tied(placed) == tied(plain)
    for T in (0.0, 1.0):
        runs = [generate(t, "Once upon a time", "ar", max_new_tokens=24, temperature=T, seed=3)
                for t in (plain, placed)]
        assert runs[0].token_ids == runs[1].token_ids


def test_off_means_untouched(monkeypatch):
    monkeypatch.setattr(pages, "ENABLED", False)
    big = torch.randn(1024, 512)
    assert pages.on_huge_pages(big) is big
