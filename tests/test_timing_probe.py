"""bench/timing_probe.py's trial design: a run cut short by its time budget stays balanced."""

import random

from bench.timing_probe import balanced_arms


def test_arms_stay_balanced_after_any_trial_and_are_not_a_fixed_pattern():
    arms = balanced_arms(231, random.Random(3))
    assert len(arms) == 231 and set(arms) == {"hit", "miss"}
    for i in range(len(arms) + 1):
        assert abs(arms[:i].count("hit") - arms[:i].count("miss")) <= 1
    assert arms[0::2] != ["hit"] * 116 and arms[0::2] != ["miss"] * 116  # the order within pairs is random
    assert balanced_arms(230, random.Random(3)) != balanced_arms(230, random.Random(4))
