"""The clock table per GPU model and the fallback for models it does not know."""

from __future__ import annotations

from power.clocks import CLOCK_TABLE, clock_profile
from power.config import Level, Priority


def test_a100_uses_polcas_published_caps() -> None:
    p = clock_profile("NVIDIA A100-SXM4-80GB")
    assert p is not None and p.key == "a100"
    assert p.cap_for(Level.T1, Priority.LOW) == 1275
    assert p.cap_for(Level.T1, Priority.HIGH) is None
    assert p.cap_for(Level.T2_LP, Priority.LOW) == 1110
    assert p.cap_for(Level.T2_LP, Priority.HIGH) is None
    assert p.cap_for(Level.T2_HP, Priority.HIGH) == 1305
    assert p.cap_for(Level.BRAKE, Priority.HIGH) == p.min_mhz == 210


def test_every_table_row_orders_caps_sensibly() -> None:
    for key, p in CLOCK_TABLE.items():
        c = p.caps_mhz
        assert p.min_mhz == c["brake"] < c["lp_t2"] < c["lp_t1"] < c["hp_t2"] < p.max_mhz, key
        assert all(v % 15 == 0 for k, v in c.items() if k != "brake") or key == "a100"
    for name, key in [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA L40S", "l40s"),
    ]:
        prof = clock_profile(name)
        assert prof is not None and prof.key == key


def test_unknown_model_uses_fractions_of_its_reported_range() -> None:
    p = clock_profile("Some Future GPU", sm_clock_max_mhz=2000, sm_clock_min_mhz=400)
    assert p is not None and p.key == "unknown" and p.clocks_usable
    # T1 sits 88.75% of the way up the range, like A100's 1275 in 210..1410.
    assert p.caps_mhz["lp_t1"] == 1815  # 400 + 0.8875 * 1600 = 1820 -> nearest 15 MHz step
    assert p.caps_mhz["brake"] == 400
    only_max = clock_profile("Some Future GPU", sm_clock_max_mhz=1410)
    assert only_max is not None and only_max.min_mhz == 210


def test_unknown_model_without_range_has_no_clock_knob() -> None:
    assert clock_profile("Mystery") is None
    p = clock_profile("Mystery", power_limit_max_w=300.0)
    assert p is not None and not p.clocks_usable and p.tdp_w == 300.0


def test_reported_power_limits_and_overrides_win() -> None:
    p = clock_profile(
        "NVIDIA A100-PCIE-40GB",
        power_limit_max_w=250.0,
        power_limit_min_w=150.0,
        overrides={"a100": {"lp_t1": 1200}},
    )
    assert p is not None and p.tdp_w == 250.0 and p.power_limit_min_w == 150.0
    assert p.caps_mhz["lp_t1"] == 1200 and p.caps_mhz["lp_t2"] == 1110
