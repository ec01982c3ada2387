"""SpikeDetector in-process: warm-up, the strict threshold, the rolling window, and its checkpointed history."""

from __future__ import annotations

import json

import pytest

from lightning_mlopt.diagnosis.spikes import SpikeDetector


def _fed(detector: SpikeDetector, losses: list[float], norm: float = 1.0) -> SpikeDetector:
    for loss in losses:
        assert detector.observe(loss, norm) is None, f"{loss} was judged a spike while feeding the history"
    return detector


def test_the_constructor_refuses_a_window_under_two_and_a_threshold_not_above_zero():
    with pytest.raises(ValueError, match=r"^spike_window must be >= 2, got 1$"):
        SpikeDetector(window=1)
    with pytest.raises(ValueError, match=r"^spike_threshold must be > 0, got 0$"):
        SpikeDetector(threshold=0)
    with pytest.raises(ValueError, match=r"^spike_threshold must be > 0, got -1.5$"):
        SpikeDetector(threshold=-1.5)


def test_nothing_is_judged_before_min_history_steps_and_the_unjudged_values_join_the_history():
    detector = _fed(SpikeDetector(window=10, threshold=1.0, min_history=4), [1.0, 1.0, 1.0])
    assert detector.observe(1000.0, 1000.0) is None  # the 4th value: only 3 known
    assert list(detector.loss_history) == [1.0, 1.0, 1.0, 1000.0]
    assert list(detector.norm_history) == [1.0, 1.0, 1.0, 1000.0]
    assert detector.events == 0


def test_a_min_history_below_two_still_waits_for_two_values_to_have_a_standard_deviation():
    detector = SpikeDetector(window=10, threshold=1.0, min_history=0)
    assert detector.observe(1.0, 1.0) is None
    assert detector.observe(50.0, 1.0) is None  # one value known: no deviation to judge by
    assert detector.observe(500.0, 1.0) == (
        "loss spike: 500 is more than 1 standard deviations above the mean 25.5 (std 34.6) of the last 2 steps"
    )


def test_the_threshold_is_strict_a_value_exactly_on_it_is_normal_and_one_just_above_is_a_spike():
    # History 0, 2, 4: mean 2 and sample standard deviation 2, both exact in binary; 1.5 deviations reach 5.
    detector = _fed(SpikeDetector(window=10, threshold=1.5, min_history=3), [0.0, 2.0, 4.0])
    assert detector.observe(5.0, 1.0) is None
    assert list(detector.loss_history) == [0.0, 2.0, 4.0, 5.0]  # normal: remembered
    detector = _fed(SpikeDetector(window=10, threshold=1.5, min_history=3), [0.0, 2.0, 4.0])
    assert detector.observe(5.0001, 1.0) == (
        "loss spike: 5 is more than 1.5 standard deviations above the mean 2 (std 2) of the last 3 steps"
    )
    assert detector.events == 1


def test_a_value_below_the_mean_however_far_is_never_a_spike():
    detector = _fed(SpikeDetector(window=10, threshold=1.0, min_history=3), [10.0, 11.0, 9.0])
    assert detector.observe(-1e9, 1.0) is None
    assert detector.events == 0


def test_a_spike_is_counted_but_kept_out_of_the_history_so_normal_stays_normal():
    detector = _fed(SpikeDetector(window=10, threshold=3.0, min_history=3), [1.0, 1.1, 0.9])
    first = detector.observe(5.0, 2.0)
    second = detector.observe(5.0, 2.0)  # still a spike: the first did not widen the history
    assert (
        first
        == second
        == ("loss spike: 5 is more than 3 standard deviations above the mean 1 (std 0.1) of the last 3 steps")
    )
    assert detector.events == 2
    assert list(detector.loss_history) == [1.0, 1.1, 0.9]
    assert list(detector.norm_history) == [1.0, 1.0, 1.0]  # the spike's norm is left out too
    assert detector.observe(1.05, 1.0) is None
    assert list(detector.loss_history) == [1.0, 1.1, 0.9, 1.05]


def test_the_gradient_norm_is_judged_against_its_own_history_and_the_loss_is_named_first():
    detector = SpikeDetector(window=10, threshold=2.0, min_history=3)
    for loss, norm in ((1.0, 10.0), (2.0, 12.0), (3.0, 14.0)):
        assert detector.observe(loss, norm) is None
    assert detector.observe(2.0, 20.0) == (
        "gradient norm spike: 20 is more than 2 standard deviations above the mean 12 (std 2) of the last 3 steps"
    )
    assert detector.observe(9.0, 20.0) == (  # both spiked: one message, the loss's
        "loss spike: 9 is more than 2 standard deviations above the mean 2 (std 1) of the last 3 steps"
    )
    assert detector.events == 2


def test_a_constant_history_makes_anything_above_it_a_spike_and_its_own_value_normal():
    detector = _fed(SpikeDetector(window=10, threshold=6.0, min_history=3), [2.0, 2.0, 2.0])
    assert detector.observe(2.0, 1.0) is None
    assert detector.observe(2.001, 1.0) == (
        "loss spike: 2.001 is more than 6 standard deviations above the mean 2 (std 0) of the last 4 steps"
    )


def test_the_window_rolls_so_an_old_outlier_stops_widening_what_counts_as_normal():
    detector = _fed(SpikeDetector(window=3, threshold=3.0, min_history=3), [100.0, 1.0, 2.0, 3.0])
    assert list(detector.loss_history) == [1.0, 2.0, 3.0]  # 100 rolled out
    assert detector.observe(5.5, 1.0) == (
        "loss spike: 5.5 is more than 3 standard deviations above the mean 2 (std 1) of the last 3 steps"
    )
    # With 100 still in the history (a window of 4) the same value is well inside the spread.
    wide = _fed(SpikeDetector(window=4, threshold=3.0, min_history=3), [100.0, 1.0, 2.0, 3.0])
    assert wide.observe(5.5, 1.0) is None


def test_values_are_written_with_four_significant_digits():
    detector = _fed(SpikeDetector(window=10, threshold=3.0, min_history=3), [1000.0, 1100.0, 900.0])
    assert detector.observe(12345.678, 1.0) == (
        "loss spike: 1.235e+04 is more than 3 standard deviations above the mean 1000 (std 100) of the last 3 steps"
    )


def test_a_restored_detector_judges_as_the_saved_one_would_and_keeps_its_event_count():
    saved = _fed(SpikeDetector(window=10, threshold=3.0, min_history=3), [1.0, 1.1, 0.9])
    assert saved.observe(5.0, 2.0) is not None
    state = json.loads(json.dumps(saved.state_dict()))  # JSON-able, and survives the round trip
    assert state == {"loss_history": [1.0, 1.1, 0.9], "norm_history": [1.0, 1.0, 1.0], "events": 1}
    restored = SpikeDetector(window=10, threshold=3.0, min_history=3)
    restored.load_state_dict(state)
    assert restored.events == 1
    assert restored.observe(5.0, 2.0) == saved.observe(5.0, 2.0)
    assert restored.observe(1.05, 1.0) is None
    assert restored.events == saved.events == 2


def test_a_history_loaded_into_a_smaller_window_keeps_the_newest_values():
    detector = SpikeDetector(window=2, threshold=3.0, min_history=2)
    detector.load_state_dict({"loss_history": [1.0, 2.0, 3.0], "norm_history": [4.0, 5.0, 6.0], "events": 3})
    assert list(detector.loss_history) == [2.0, 3.0]
    assert list(detector.norm_history) == [5.0, 6.0]
    assert detector.loss_history.maxlen == detector.norm_history.maxlen == 2
    detector.observe(2.5, 5.5)
    assert list(detector.loss_history) == [3.0, 2.5]  # still rolls at the detector's own window


def test_an_older_checkpoint_without_the_keys_loads_as_an_empty_history():
    detector = _fed(SpikeDetector(window=10, threshold=3.0, min_history=2), [1.0, 2.0])
    detector.events = 4
    detector.load_state_dict({})
    assert list(detector.loss_history) == list(detector.norm_history) == []
    assert detector.events == 0
    assert detector.observe(1e6, 1e6) is None  # warming up again


def test_a_min_history_longer_than_the_window_is_refused_since_nothing_would_ever_be_judged():
    with pytest.raises(ValueError, match=r"^spike_min_history \(20\) must be <= spike_window \(5\): the history holds"):
        SpikeDetector(window=5, threshold=3.0, min_history=20)
    assert SpikeDetector(window=5, threshold=3.0, min_history=5).min_history == 5
