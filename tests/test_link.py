"""The link model: bus-traffic durations, serial service, presets and their errors."""

import pytest

from zerobench.instruments.link import PRESETS, Link, SerialLink, bus_factor, resolve_link


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("broadcast", 8) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0


def test_duration_is_latency_plus_bus_bytes_over_bandwidth():
    link = Link(2.0, 100.0)
    # 8 MB all-reduce over 4 ranks: 1.5 * 8e6 / 2e9 = 6 ms, plus 0.1 ms
    assert link.duration_s("all_reduce", 8_000_000, 4) == pytest.approx(6.1e-3)


def test_two_collectives_issued_together_take_the_sum_not_the_max():
    link = SerialLink(Link(1.0, 0.0))
    a = link.reserve(0.0, "broadcast", 1_000_000, 2)  # 1 ms
    b = link.reserve(0.0, "broadcast", 2_000_000, 2)  # 2 ms, waits for a
    assert a == pytest.approx((0.0, 1e-3))
    assert b == pytest.approx((1e-3, 3e-3))
    c = link.reserve(10e-3, "broadcast", 1_000_000, 2)  # issued after the link went idle
    assert c == pytest.approx((10e-3, 11e-3))


def test_resolve_link_presets_and_errors():
    assert resolve_link("ib-400g") is PRESETS["ib-400g"]
    assert resolve_link("pcie4", gbps=20.0).bandwidth_gbps == 20.0
    assert resolve_link(gbps=0.5, latency_us=50).latency_us == 50
    with pytest.raises(ValueError, match="unknown preset 'nvlink9'.*allowed: nvlink4-8gpu"):
        resolve_link("nvlink9")
    with pytest.raises(ValueError, match="bandwidth_gbps must be"):
        Link(0.0)
    with pytest.raises(ValueError, match="latency_us must be"):
        Link(1.0, -1.0)
    with pytest.raises(ValueError, match="not a collective kind"):
        Link(1.0).duration_s("gossip", 1, 2)
