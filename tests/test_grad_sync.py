"""``flashpar.models.grad_sync``: gradient sums posted during backward, in one fixed order on every rank.

One process: ``dist.all_reduce`` is replaced by a recorder (the sums themselves are exercised by every
multi-rank training test: tests/test_train_step.py and ``--check`` compare the summed gradients' effects
with the single-process model).  The chain ``loss = ((1 a) b) c`` completes its gradients in the order
c, b, a.
"""

from __future__ import annotations

import pytest
import torch

from flashpar.models import grad_sync
from flashpar.models.grad_sync import GradSync

GROUP = object()  # a stand-in group: the recorder never uses it


class _Done:
    def wait(self, *args):
        return True


@pytest.fixture
def chain(monkeypatch):
    """(a, b, c, loss(), posted): ``posted`` lists (the tensor summed, whether ``a`` had its gradient then)."""
    a, b, c = (torch.nn.Parameter(torch.tensor([v])) for v in (2.0, 3.0, 5.0))
    posted: list[tuple[torch.Tensor, bool]] = []

    def all_reduce(t, group=None, async_op=False):
        assert group is GROUP and async_op
        posted.append((t, a.grad is not None))
        return _Done()

    monkeypatch.setattr(grad_sync.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(grad_sync, "stream_waits", lambda group: False)
    return a, b, c, lambda: (((torch.tensor([1.0]) * a) * b) * c).sum(), posted


def _names(posted, **params) -> list[tuple[str, bool]]:
    return [(next(n for n, p in params.items() if p.grad is t), a_done) for t, a_done in posted]


def test_sums_are_posted_during_backward_as_gradients_complete(chain):
    a, b, c, loss, posted = chain
    sync = GradSync([(c, GROUP), (b, GROUP), (a, GROUP)], timeout_s=5)
    sync.arm()
    loss().backward()
    # c and b were posted before a's gradient existed: during backward, not after it
    assert _names(posted, a=a, b=b, c=c) == [("c", False), ("b", False), ("a", True)]
    sync.finish()
    assert len(posted) == 3  # nothing left to post


def test_the_posting_order_is_fixed_whatever_order_gradients_complete_in(chain):
    a, b, c, loss, posted = chain
    unused = torch.nn.Parameter(torch.zeros(()))
    sync = GradSync([(a, GROUP), (b, GROUP), (c, None), (unused, GROUP)], timeout_s=5)
    sync.arm()
    loss().backward()
    # a completes last, so nothing could be posted before it; then a, b in the fixed order (c needs no sum)
    assert _names(posted, a=a, b=b) == [("a", True), ("b", True)]
    sync.finish()  # the parameter that got no gradient: zeros, summed in its place in the order
    assert _names(posted, a=a, b=b, unused=unused)[2:] == [("unused", True)]
    assert torch.equal(unused.grad, torch.zeros(()))


def test_arming_again_before_finishing_is_refused(chain):
    a, b, c, loss, posted = chain
    sync = GradSync([(a, GROUP)], timeout_s=5)
    sync.arm()
    loss().backward()
    with pytest.raises(RuntimeError, match="not finished"):
        sync.arm()
    sync.finish()
    sync.arm()  # a finished step arms again


def test_without_arming_backward_posts_nothing_and_finish_sums_everything(chain):
    a, b, c, loss, posted = chain
    sync = GradSync([(c, GROUP), (a, GROUP)], timeout_s=5)
    loss().backward()
    assert posted == []
    sync.finish()
    assert _names(posted, a=a, c=c) == [("c", True), ("a", True)]
