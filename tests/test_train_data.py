"""The trainer's data pipeline: packing, labels, determinism, data-parallel sharding, resume, plans in workers."""

from __future__ import annotations

import random

import pytest
import torch

from flashpar import corpus
from flashpar.cp import plan
from flashpar.cp.lengths import pack
from flashpar.train.data import PackedCorpus, PlannedSequences, make_loader

DOCS, SEQ = 60, 256


@pytest.fixture(scope="module")
def ds() -> PackedCorpus:
    return PackedCorpus(SEQ, max_docs=DOCS, seed=3)


def _shuffled_docs(max_docs: int, seed: int) -> list[torch.Tensor]:
    """The documents in stream order, built from scratch (brute force)."""
    docs = [tokens for _, tokens in corpus.documents(max_docs)]
    random.Random(seed).shuffle(docs)
    return docs


def _all(dataset) -> list[dict]:
    return [dataset[i] for i in range(len(dataset))]


def test_sequences_are_the_prefix_of_the_shuffled_stream_and_doc_lens_match(ds):
    docs = _shuffled_docs(DOCS, 3)
    stream = torch.cat(docs)
    items = _all(ds)
    assert len(ds) == stream.numel() // SEQ > 1
    assert torch.equal(torch.cat([it["tokens"] for it in items]), stream[: len(ds) * SEQ])
    assert [it["doc_lens"] for it in items] == pack([d.numel() for d in docs], SEQ)
    for i, it in enumerate(items):
        assert it["index"] == i and it["tokens"].dtype == torch.long and it["tokens"].shape == (SEQ,)
        assert sum(it["doc_lens"]) == SEQ and ds.doc_lens(i) == it["doc_lens"]


def test_labels_are_next_token_of_the_same_document(ds):
    docs = _shuffled_docs(DOCS, 3)
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])
    items = _all(ds)
    got = torch.cat([it["labels"] for it in items])
    assert torch.equal(got, labels[: len(ds) * SEQ])
    # -100 exactly at the last token of each document; elsewhere the next token, also across sequences
    ends = torch.tensor([d.numel() for d in docs]).cumsum(0) - 1
    assert torch.equal((got == -100).nonzero().flatten(), ends[ends < got.numel()])
    crossing = [i for i, it in enumerate(items[:-1]) if it["labels"][-1] != -100]
    assert crossing and all(items[i]["labels"][-1] == items[i + 1]["tokens"][0] for i in crossing)


def test_same_seed_same_sequences_other_seed_other_order(ds):
    again = PackedCorpus(SEQ, max_docs=DOCS, seed=3)
    other = PackedCorpus(SEQ, max_docs=DOCS, seed=4)
    assert again.order == ds.order and other.order != ds.order
    for i in (0, len(ds) // 2, len(ds) - 1):
        assert torch.equal(again[i]["tokens"], ds[i]["tokens"])
    assert not torch.equal(other[0]["tokens"], ds[0]["tokens"])


def test_dp_ranks_are_disjoint_cover_everything_and_start_resumes(ds):
    dp = 3
    ranks = [PlannedSequences(ds, 2, "contiguous", dp_rank=r, dp_size=dp) for r in range(dp)]
    seen = [[ranks[r].global_index(j) for j in range(len(ranks[r]))] for r in range(dp)]
    flat = sorted(i for s in seen for i in s)
    assert flat == list(range(len(ds)))
    for r in range(dp):
        assert seen[r] == list(range(r, len(ds), dp))
    # resume after k steps on every rank: start = k * dp_size gives exactly the items that would have come next
    k = 4
    for r in range(dp):
        resumed = PlannedSequences(ds, 2, "contiguous", dp_rank=r, dp_size=dp, start=k * dp)
        assert len(resumed) == len(ranks[r]) - k
        assert [resumed.global_index(j) for j in range(len(resumed))] == seen[r][k:]
        a, b = resumed[0], ranks[r][k]
        assert a["index"] == b["index"] and torch.equal(a["tokens"], b["tokens"])
        assert torch.equal(a["labels"], b["labels"]) and a["plan"] == b["plan"]
    end = PlannedSequences(ds, 2, dp_size=dp, dp_rank=dp - 1, start=len(ds))
    assert len(end) == 0


def test_item_plan_matches_in_process_plan_in_a_spawned_worker(ds):
    planned = PlannedSequences(ds, 4, "flashcp", dp_rank=1, dp_size=2, start=2)
    loader = make_loader(planned, num_workers=1, prefetch_factor=1)
    assert loader.batch_size is None and loader.persistent_workers
    got = []
    for item in loader:
        got.append(item)
        if len(got) == 2:
            break
    for j, item in enumerate(got):
        want = ds[2 + j * 2 + 1]
        assert item["index"] == want["index"] == 2 + j * 2 + 1
        assert torch.equal(item["tokens"], want["tokens"]) and torch.equal(item["labels"], want["labels"])
        assert item["doc_lens"] == want["doc_lens"]
        assert item["plan"] == plan(want["doc_lens"], 4, strategy="flashcp")
        assert item["planning_s"] == item["plan"].planning_s > 0


def test_loader_without_workers_plans_in_process(ds):
    planned = PlannedSequences(ds, 2, "headtail")
    item = next(iter(make_loader(planned, num_workers=0)))
    assert item["index"] == 0 and item["plan"] == plan(ds.doc_lens(0), 2, strategy="headtail")


@pytest.mark.parametrize(("make", "words"), [
    (lambda ds: PackedCorpus(0, max_docs=5), "seq_len"),
    (lambda ds: PackedCorpus(10**9, max_docs=5), "shorter than one sequence"),
    (lambda ds: PackedCorpus(SEQ, max_docs=0), "shorter than one sequence"),
    (lambda ds: PlannedSequences(ds, 2, dp_rank=2, dp_size=2), "dp_rank"),
    (lambda ds: PlannedSequences(ds, 2, dp_rank=-1, dp_size=2), "dp_rank"),
    (lambda ds: PlannedSequences(ds, 2, dp_size=0), "dp_size"),
    (lambda ds: PlannedSequences(ds, 0), "cp_size"),
    (lambda ds: PlannedSequences(ds, 2, "nonsense"), "unknown strategy"),
    (lambda ds: PlannedSequences(ds, 2, start=len(ds) + 1), "start"),
])
def test_bad_inputs_raise_value_error(ds, make, words):
    with pytest.raises(ValueError, match=words):
        make(ds)


def test_out_of_range_items_raise_index_error(ds):
    with pytest.raises(IndexError, match="out of range: the documents pack into"):
        ds[len(ds)]
    with pytest.raises(IndexError, match="out of range: dp rank 0 has"):
        PlannedSequences(ds, 2)[len(ds)]
