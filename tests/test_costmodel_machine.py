"""Machine: JSON round trip, validation, presets, gamma interpolation, slowdown."""

import json
import math

import pytest

from summasim.costmodel import Link, Machine, list_presets, load_preset
from summasim.costmodel.machine import DEFAULT_PRESET, get_machine, itemsize_of


def _machine():
    return Machine(name="t", source="test", cores=2,
                   intra=Link(1e-6, 1e-10, 5e-6, 2e-10, 8192),
                   inter=Link(2e-6, 1e-9, 9e-6, 5e-10, 65536),
                   gamma_gemm={"float64": [[100, 1e-10], [10000, 1e-12]],
                               "float32": [[64, 3e-11]]},
                   gamma_reduce=1e-10, node_size=4, memory_bytes=1e9,
                   notes={"date": "2026-11-22", "points": [[8, 1e-6]]})


def test_presets_exist_and_cite_sources():
    names = list_presets()
    assert {"local-2core-mpich", "h100-dgx-ndr", "frontera-rtx"} <= set(names)
    assert DEFAULT_PRESET in names
    for name in names:
        m = load_preset(name)
        assert m.name == name
        assert len(m.source) > 40
    h100 = load_preset("h100-dgx-ndr")
    assert "H100" in h100.source and "datasheet" in h100.source
    assert "NDR" in h100.source and "900 GB/s" in h100.source
    # datasheet figures: NVLink 900 GB/s bidirectional -> 450 GB/s per direction; NDR 50 GB/s
    assert h100.intra.beta_large == pytest.approx(1 / 450e9)
    assert h100.inter.beta_large == pytest.approx(1 / 50e9)
    # the measured plateau (Bekman's MAMF table: 792.1 of the datasheet's 989 TFLOP/s)
    assert h100.peak_flops("bfloat16") == pytest.approx(792.1e12)
    local = load_preset("local-2core-mpich")
    assert local.cores == 2 and "MPICH 5.0.2" in local.source
    assert "date" in local.notes and "command" in local.notes


@pytest.mark.parametrize("name", ["local-2core-mpich", "h100-dgx-ndr", "frontera-rtx"])
def test_preset_round_trip_exact(tmp_path, name):
    m = load_preset(name)
    assert Machine.from_dict(m.to_dict()) == m
    path = tmp_path / "m.json"
    m.save(path)
    m2 = Machine.load(path)
    assert m2 == m
    m2.save(tmp_path / "m2.json")
    assert (tmp_path / "m.json").read_text() == (tmp_path / "m2.json").read_text()


def test_round_trip_exact_floats(tmp_path):
    m = _machine().replace(gamma_reduce=0.1 + 0.2, intra=Link(1 / 3, 2 / 7, 1e-300, 5e-6, 8192))
    m.save(tmp_path / "x.json")
    back = Machine.load(tmp_path / "x.json")
    assert back == m
    assert back.intra.alpha_small == 1 / 3 and back.gamma_reduce == 0.1 + 0.2


@pytest.mark.parametrize("path", ["name", "source", "cores", "intra", "gamma_gemm",
                                  "gamma_reduce", "intra.alpha_small", "intra.beta_large",
                                  "intra.eager_threshold", "inter.alpha_large"])
def test_missing_field_is_named(path):
    d = _machine().to_dict()
    parent, _, key = path.rpartition(".")
    del (d[parent] if parent else d)[key]
    with pytest.raises(ValueError, match=repr(path).replace(".", r"\.")):
        Machine.from_dict(d)


@pytest.mark.parametrize("path", ["cores", "gamma_reduce", "intra.alpha_small",
                                  "intra.beta_small", "inter.beta_large", "memory_bytes"])
def test_negative_field_is_named(path):
    d = _machine().to_dict()
    parent, _, key = path.rpartition(".")
    (d[parent] if parent else d)[key] = -1
    with pytest.raises(ValueError, match=repr(path).replace(".", r"\.")):
        Machine.from_dict(d)


def test_a_reserve_that_leaves_no_memory_is_refused():
    """device.reserve_bytes at or above memory_bytes would leave every step 0 bytes: the
    machine is refused, naming both fields, rather than priced as fitting or not."""
    d = load_preset("dgx-a100").to_dict()
    d["device"]["reserve_bytes"] = d["memory_bytes"]
    with pytest.raises(ValueError, match="'device.reserve_bytes'.*'memory_bytes'"):
        Machine.from_dict(d)
    d["device"]["reserve_bytes"] = d["memory_bytes"] / 2            # half is a machine
    assert Machine.from_dict(d).device.reserve_bytes == d["memory_bytes"] / 2


def test_bad_values_rejected():
    d = _machine().to_dict()
    d["intra"]["beta_large"] = "fast"
    with pytest.raises(ValueError, match="intra.beta_large"):
        Machine.from_dict(d)
    d = _machine().to_dict()
    d["intra"]["alpha_large"] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        Machine.from_dict(d)
    d = _machine().to_dict()
    d["gamma_gemm"]["float64"] = [[1000, 1e-11], [100, 1e-10]]
    with pytest.raises(ValueError, match="increasing"):
        Machine.from_dict(d)
    d = _machine().to_dict()
    d["gamma_gemm"]["int7"] = [[1, 1e-9]]
    with pytest.raises(ValueError, match="int7"):
        Machine.from_dict(d)
    d = _machine().to_dict()
    d["alpah"] = 1.0
    with pytest.raises(ValueError, match="alpah"):
        Machine.from_dict(d)
    d = _machine().to_dict()
    d["cores"] = 0
    with pytest.raises(ValueError, match="'cores'"):
        Machine.from_dict(d)
    for notes in (5, [1, 2], "hello", [["a", 1]]):    # a TypeError traceback, or accepted
        d = _machine().to_dict()
        d["notes"] = notes
        with pytest.raises(ValueError, match="'notes' must be an object"):
            Machine.from_dict(d)


def test_bad_json_file(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Machine.load(tmp_path / "bad.json")


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="unknown machine preset 'nope'.*h100-dgx-ndr"):
        load_preset("nope")
    with pytest.raises(ValueError, match="not both"):
        get_machine("x.json", "h100-dgx-ndr")


def test_gamma_log_log_interpolation_and_clamp():
    m = _machine()
    # (100, 1e-10) .. (10000, 1e-12): straight line in log-log, so 1000 -> 1e-11
    assert m.gamma(1000) == pytest.approx(1e-11, rel=1e-12)
    assert m.gamma(10) == 1e-10 and m.gamma(1e6) == 1e-12          # clamped
    assert m.gamma(5, "float32") == 3e-11 == m.gamma(5000, "float32")  # one point
    assert m.gemm_time(1000, 1000, 1000) == pytest.approx(2e9 * 1e-11)
    # a GEMM of shape (m, k, n) uses the size (m k n)^(1/3)
    assert m.gemm_time(100, 1000, 10000) == pytest.approx(2e9 * 1e-11)
    with pytest.raises(ValueError, match="no gamma for dtype 'bfloat16'"):
        m.gamma(100, "bfloat16")


def test_link_regimes_and_slowdown():
    m = _machine()
    assert m.intra.alpha(8191) == 1e-6 and m.intra.alpha(8192) == 5e-6
    assert m.intra.time(8192) == pytest.approx(5e-6 + 8192 * 2e-10)
    assert m.link(inter=True) is m.inter and m.link() is m.intra
    simple = Machine.simple()
    assert simple.link(inter=True) is simple.intra
    assert m.slowdown(1) == 1.0 and m.slowdown(2) == 1.0 and m.slowdown(16) == 8.0
    assert m.ranks_per_node(16) == 4 and load_preset("local-2core-mpich").ranks_per_node(16) == 16


def test_itemsize():
    assert itemsize_of("float64") == 8 and itemsize_of("bfloat16") == 2
    import numpy as np

    assert itemsize_of(np.dtype("float32")) == 4
    with pytest.raises(ValueError, match="unknown dtype"):
        itemsize_of("float128x")


def test_json_is_plain_and_documented(tmp_path):
    _machine().save(tmp_path / "m.json")
    d = json.loads((tmp_path / "m.json").read_text())
    assert d["format"] == "summasim.machine/1"
    assert set(d["intra"]) == {"alpha_small", "beta_small", "alpha_large", "beta_large",
                               "eager_threshold"}
    assert math.isclose(d["gamma_gemm"]["float64"][0][1], 1e-10)
