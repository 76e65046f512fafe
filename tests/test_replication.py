"""Predictive replication policy: hot, repeatedly pulled prefixes are copied ahead of demand."""

from policies.replication import ReplicationConfig, ReplicationPolicy


def test_prefix_becomes_hot_after_threshold_pulls_in_window():
    p = ReplicationPolicy(ReplicationConfig(threshold=3, window_s=10, cooldown_s=100, max_targets=2))
    cands, holders = ["w0", "w1", "w2", "w3"], ["w0"]
    p.record_pull(b"k", 0.0)
    p.record_pull(b"k", 1.0)
    assert p.targets(b"k", cands, holders, 1.0) == []  # 2 < threshold
    p.record_pull(b"k", 2.0)
    assert p.targets(b"k", cands, holders, 2.0) == ["w1", "w2"]  # not the holder, at most 2
    p.record_pull(b"k", 3.0)
    assert p.targets(b"k", cands, holders, 3.0) == []  # cooling down
    assert p.replications == 1


def test_old_pulls_leave_the_window_and_other_prefixes_are_independent():
    p = ReplicationPolicy(ReplicationConfig(threshold=2, window_s=5, cooldown_s=0))
    p.record_pull(b"a", 0.0)
    p.record_pull(b"a", 10.0)
    assert p.targets(b"a", ["x", "y"], [], 10.0) == []  # first pull expired
    p.record_pull(b"b", 10.0)
    assert p.targets(b"b", ["x"], [], 10.0) == []
    p.record_pull(b"a", 11.0)
    assert p.targets(b"a", ["x", "y"], ["x"], 11.0) == ["y"]
    assert p.targets(b"a", ["x"], ["x"], 11.0) == []  # everyone holds it


def test_disabled_and_bounded_memory():
    p = ReplicationPolicy(ReplicationConfig(threshold=1, enabled=False))
    p.record_pull(b"a", 0.0)
    assert p.targets(b"a", ["x"], [], 0.0) == []
    q = ReplicationPolicy(ReplicationConfig(threshold=1, max_tracked=2))
    for k in (b"1", b"2", b"3"):
        q.record_pull(k, 0.0)
    assert q.targets(b"1", ["x"], [], 0.0) == []  # evicted from tracking
    assert q.targets(b"3", ["x"], [], 0.0) == ["x"]
