"""bench.traffic's ECMP sweep over flows per connection (issue 21 item 2)."""

from __future__ import annotations

from bench.traffic import FLOW_MODEL_NOTE, ecmp_setting


def test_ecmp_distribution_and_speedup_per_flow_setting() -> None:
    few = ecmp_setting(1, 1, gpus=128, oversubscription=2.0, seeds=3)
    many = ecmp_setting(4, 2, gpus=128, oversubscription=2.0, seeds=3)
    for e in (few, many):
        assert e["seeds"] == 3
        assert e["ecmp_busbw_gbps_p10"] <= e["ecmp_busbw_gbps_median"] <= e["ecmp_busbw_gbps_p90"]
        assert e["ours_busbw_gbps"] >= e["ecmp_busbw_gbps_median"]
        implied = e["speedup_vs_ecmp_median"] * e["ecmp_busbw_gbps_median"]
        assert abs(implied - e["ours_busbw_gbps"]) < 0.01 * e["ours_busbw_gbps"]
    assert many["flows_per_connection"] == 8 and many["flows"] == 8 * few["flows"]
    # More, smaller flows: ECMP's collisions cost less, so planning gains less.
    assert many["speedup_vs_ecmp_median"] < few["speedup_vs_ecmp_median"]
    assert "flow-level model" in FLOW_MODEL_NOTE and "leaves out" in FLOW_MODEL_NOTE
