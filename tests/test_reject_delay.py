"""The ingress holds the 429 of a tenant that retries inside its last Retry-After (policies/reject_delay.py)."""

import pytest

from policies.reject_delay import RejectionDelay


def test_first_refusal_is_sent_at_once_an_early_retry_is_held():
    d = RejectionDelay(max_delay_s=1.0, max_held=8)
    assert d.acquire("f", now=0.0, retry_after_s=2.0) == 0.0  # told to wait until 2.0
    assert d.acquire("f", now=0.5, retry_after_s=2.0) == 1.0  # ignored it: held
    d.release()
    # the held one told it to wait until 0.5 + 1.0 + 2.0 = 3.5
    assert d.acquire("f", now=3.4, retry_after_s=2.0) == 1.0
    d.release()
    assert d.acquire("f", now=7.0, retry_after_s=2.0) == 0.0  # it waited (3.4 + 1 + 2 = 6.4 < 7): at once
    assert d.num_delayed == 2 and d.held == 0


def test_tenants_are_judged_apart():
    d = RejectionDelay(1.0, 8)
    assert d.acquire("f", 0.0, 5.0) == 0.0
    assert d.acquire("polite", 0.1, 5.0) == 0.0  # another tenant's early retries do not delay this one
    assert d.acquire("f", 0.2, 5.0) == 1.0


def test_held_refusals_are_bounded_and_released():
    d = RejectionDelay(1.0, max_held=2)
    d.acquire("f", 0.0, 10.0)
    assert [d.acquire("f", 0.1, 10.0) for _ in range(4)] == [1.0, 1.0, 0.0, 0.0]  # beyond 2 held: at once
    assert d.held == 2
    d.release()
    assert d.acquire("f", 0.2, 10.0) == 1.0 and d.held == 2
    d.release(), d.release()
    with pytest.raises(RuntimeError):
        d.release()


def test_zero_delay_disables_it_and_bad_knobs_are_refused():
    d = RejectionDelay(0.0, 8)
    assert [d.acquire("f", t, 5.0) for t in (0.0, 0.1, 0.2)] == [0.0, 0.0, 0.0] and d.held == 0
    with pytest.raises(ValueError):
        RejectionDelay(-1.0, 8)
    with pytest.raises(ValueError):
        RejectionDelay(1.0, -1)
