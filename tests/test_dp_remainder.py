"""Data that run out with a remainder over the dp ranks: every dp rank runs the same number of steps.

A dp rank holding one sequence more than another must not start a step alone (its peers never join its
collectives: the job would wait out ``--timeout``).  The count is whole global batches, from the global number
of sequences, the same on every rank."""

from __future__ import annotations

import json

import pytest

from flashpar.cli import main
from flashpar.train.data import PlannedSequences


class _Sequences:
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, k):
        return {"k": k, "doc_lens": [64]}


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 3])
def test_every_dp_rank_counts_the_same_whole_steps(dp, micro):
    """For every length, start and epoch count: one step count on all dp ranks, every rank holds the sequences of
    those steps, and one more step would need a sequence that does not exist."""
    for n in range(1, 14):
        for epochs in (1, 2):
            for start in range(0, epochs * n + 1):
                ranks = [PlannedSequences(_Sequences(n), 1, dp_rank=d, dp_size=dp, start=start, epochs=epochs)
                         for d in range(dp)]
                counts = {r.steps(micro) for r in ranks}
                assert len(counts) == 1, (n, start, counts)
                steps = counts.pop()
                assert all(len(r) >= steps * micro for r in ranks)
                assert (steps + 1) * micro * dp > epochs * n - start  # no whole step left out


def test_per_rank_lengths_differ_where_the_old_count_hung():
    """The case the step count must not be taken from: 5 sequences at dp 2 hold 3 and 2 per rank."""
    ranks = [PlannedSequences(_Sequences(5), 1, dp_rank=d, dp_size=2) for d in range(2)]
    assert [len(r) for r in ranks] == [3, 2]
    assert [r.steps(1) for r in ranks] == [2, 2]


def test_steps_refuse_a_bad_micro_batch_count():
    with pytest.raises(ValueError, match="micro_batches must be a positive int"):
        PlannedSequences(_Sequences(5), 1).steps(0)


def _docs(root, count: int):
    root.mkdir()
    for i in range(count):
        (root / f"d{i}.txt").write_text("def f(x):\n    return x\n" * 40)  # 960 bytes: 961 tokens with its end


@pytest.mark.parametrize(("dp", "micro", "docs"), [(2, 1, 3), (3, 2, 6), (2, 2, 6), (3, 1, 6)])
def test_a_run_whose_data_leave_a_remainder_over_dp_ends_on_every_rank(tmp_path, capfd, dp, micro, docs):
    """Byte tokens of ``docs`` documents of 961 tokens in 512-token sequences: 3 docs make 5 sequences (ranks hold
    3 and 2 at dp 2), 6 make 11 (4, 4, 3 at dp 3).  The run trains the whole global batches and ends with its
    summary, its checkpoint and exit 0, well inside its timeout."""
    from flashpar.train.config import TrainConfig
    from flashpar.train.data import training_data

    _docs(tmp_path / "docs", docs)
    out = tmp_path / "run"
    argv = ["train", "--data", str(tmp_path / "docs"), "--nproc", str(dp), "--dp", str(dp), "--cp", "1", "--tp",
            "1", "--seq-len", "512", "--workers", "0", "--micro-batches", str(micro), "--steps", "50",
            "--save-every", "50", "--hidden", "32", "--layers", "1", "--ffn", "64", "--out", str(out),
            "--timeout", "60"]
    assert main(argv) == 0
    sequences = len(training_data(TrainConfig(data=(str(tmp_path / "docs"),), seq_len=512, cp=1, tp=1)))
    steps = sequences // (dp * micro)
    assert sequences % (dp * micro), "the case needs a remainder over dp"
    assert steps >= 1
    out_text, err = capfd.readouterr()
    assert f"trained {steps} steps" in out_text, out_text + err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["data_ran_out_at"] == steps
    assert (out / "checkpoints" / f"step_{steps}").is_dir()
