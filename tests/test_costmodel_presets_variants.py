"""The presets people have (DGX A100 320GB, DGX-1 V100, DGX-2, a 4-GPU PCIe A100 node) and the
``--machine NAME:key=value,...`` variants one flag away from any preset.

Each preset's numbers are checked against the datasheet figure its sources cite: memory per
GPU in bytes, the dense peak behind each dtype's GEMM rate (the presets' GEMM curve tops out
at 85% of it), HBM bandwidth (0.9 of the datasheet's), NICs and their line rate. A variant
must change exactly the field it names (``to_dict`` before and after differ there, in the
name, and in the provenance that says the variant set it), refuse bad specs naming the key,
and move a prediction the way the hardware would.
"""

from __future__ import annotations

import io
import json

import pytest

from summasim.costmodel import (GridShape, Machine, Placement, group_path, list_presets,
                                load_machine, load_preset, nccl_time)
from summasim.costmodel.machine.presets import (ALIASES, VARIANT_KEYS, derive, describe,
                                                main_sources, presets_listing)
from summasim.costmodel.machine.sanity import sanity_problems
from summasim.costmodel.collectives.nccl import predicted_bus_bandwidth

GiB = 1 << 30
GEMM_EFF = 0.85            # the presets' ASSUMED efficiency of a n=16384 GEMM (notes.gamma_gemm)
#: The measured 16-bit plateau that replaces it where a microbenchmark gives one (Bekman's
#: MAMF table: A100 SXM 267.9, A100 PCIe 256.4 TFLOP/s).
MAMF = {"dgx-a100-40gb": 267.9e12, "aws-p4d": 267.9e12, "pcie-a100-4gpu": 256.4e12}
HBM_EFF = 0.9              # achievable fraction of the HBM datasheet rate (device.sources)

#: name -> the datasheet figures its sources cite.
DATASHEET = {
    # DGX A100 320GB: A100-SXM4-40GB, HBM2 1,555 GB/s, 8x HDR 200 Gb/s, NVSwitch 300 GB/s/dir
    "dgx-a100-40gb": dict(gpus=8, memory=40 * GiB, hbm=1555e9, nics=8, nic_gbps=200,
                          intra_kind="nvswitch", intra=300e9,
                          peaks={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12,
                                 "float64": 19.5e12},
                          vector={"float64": 9.7e12, "float32": 19.5e12}),
    # AWS p4d.24xlarge: the same A100-SXM4-40GB board, 4 x 100 Gb/s EFA
    "aws-p4d": dict(gpus=8, memory=40 * GiB, hbm=1555e9, nics=4, nic_gbps=100,
                    intra_kind="nvswitch", intra=300e9,
                    peaks={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12,
                           "float64": 19.5e12},
                    vector={"float64": 9.7e12, "float32": 19.5e12}),
    # DGX-1: V100-SXM2-32GB, HBM2 900 GB/s, 4x EDR 100 Gb/s, 6 NVLink2 x 25 GB/s per direction
    "dgx1-v100": dict(gpus=8, memory=32 * GiB, hbm=900e9, nics=4, nic_gbps=100,
                      intra_kind="nvlink", intra=150e9,
                      peaks={"float16": 125e12, "float32": 15.7e12, "float64": 7.8e12},
                      vector={"float64": 7.8e12, "float32": 15.7e12}),
    # DGX-2 (350 W): 2 PFLOPS / 16 = 125 TFLOPS per V100, 8x EDR, NVSwitch 150 GB/s/dir
    "dgx2-v100": dict(gpus=16, memory=32 * GiB, hbm=900e9, nics=8, nic_gbps=100,
                      intra_kind="nvswitch", intra=150e9,
                      peaks={"float16": 125e12, "float32": 15.7e12, "float64": 7.8e12},
                      vector={"float64": 7.8e12, "float32": 15.7e12}),
    # 4x A100-PCIe-80GB, HBM2e 1,935 GB/s, PCIe Gen4 x16 (31.5 GB/s/dir), one HDR NIC
    "pcie-a100-4gpu": dict(gpus=4, memory=80 * GiB, hbm=1935e9, nics=1, nic_gbps=200,
                           intra_kind="pcie", intra=16e9 * 16 * 128 / 130 / 8,
                           peaks={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12,
                                  "float64": 19.5e12},
                           vector={"float64": 9.7e12, "float32": 19.5e12}),
}


# --------------------------------------------------------------------------- presets
def test_new_presets_are_listed():
    assert set(DATASHEET) <= set(list_presets())


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_preset_matches_its_datasheet(name):
    want = DATASHEET[name]
    m = load_preset(name)
    topo, dev = m.topology, m.device
    assert m.name == name and m.library == "nccl"
    assert m.memory_bytes == want["memory"]
    assert m.cores == m.node_size == topo.devices_per_node == want["gpus"]
    assert topo.intra_kind == want["intra_kind"]
    assert topo.intra_bandwidth == pytest.approx(want["intra"])
    assert topo.nics_per_node == want["nics"]
    assert topo.nic_bandwidth == pytest.approx(want["nic_gbps"] * 1e9 / 8)
    assert dev.memory_bandwidth == pytest.approx(HBM_EFF * want["hbm"])
    assert m.gamma_reduce == pytest.approx(3 / (HBM_EFF * want["hbm"]))
    assert set(m.gamma_gemm) == set(want["peaks"])
    for dtype, peak in want["peaks"].items():
        if name in MAMF and dtype in ("bfloat16", "float16"):
            assert m.peak_flops(dtype) == pytest.approx(MAMF[name]), dtype
        else:
            assert m.peak_flops(dtype) == pytest.approx(GEMM_EFF * peak), dtype
    for dtype, flops in want["vector"].items():
        assert dev.vector_flops[dtype] == pytest.approx(flops), dtype
    assert sanity_problems(m) == []
    assert Machine.from_dict(m.to_dict()) == m


def test_dgx_a100_40gb_differs_from_dgx_a100_only_in_what_the_40gb_gpu_changes():
    a, b = load_preset("dgx-a100").to_dict(), load_preset("dgx-a100-40gb").to_dict()
    changed = {k for k in a if a[k] != b[k]}
    assert changed == {"name", "source", "memory_bytes", "gamma_reduce", "gamma_reduce_mpi",
                       "device", "notes", "topology"}
    for part in ("topology", "device"):                  # numbers equal but HBM; sources differ
        da = {k: v for k, v in a[part].items() if k != "sources"}
        db = {k: v for k, v in b[part].items() if k != "sources"}
        diff = {k for k in da if da[k] != db[k]}
        assert diff == (set() if part == "topology" else {"name", "memory_bandwidth"})
    assert a["gamma_gemm"] == b["gamma_gemm"]


def test_aws_p4d_is_the_40gb_board_with_efa_at_its_measured_efficiency():
    """p4d.24xlarge: the DGX A100 320GB's board; only the network between nodes differs.
    NCCL over its EFA reached 29.61 GB/s of all-reduce bus bandwidth on 4 instances
    (NVIDIA/nccl #527), which is the preset's efficiency times the 50 GB/s line rate, and
    the model's busbw for that run follows from it."""
    a, b = load_preset("dgx-a100-40gb").to_dict(), load_preset("aws-p4d").to_dict()
    changed = {k for k in a if a[k] != b[k]}
    assert changed == {"name", "source", "notes", "inter", "topology"}
    ta = {k: v for k, v in a["topology"].items() if k != "sources"}
    tb = {k: v for k, v in b["topology"].items() if k != "sources"}
    assert {k for k in ta if ta[k] != tb[k]} == {"nics_per_node", "nic_bandwidth",
                                                 "nic_efficiency"}
    topo = load_preset("aws-p4d").topology
    line = topo.nics_per_node * topo.nic_bandwidth
    assert line == pytest.approx(400e9 / 8)
    assert topo.nic_efficiency == pytest.approx(29.61e9 / line, abs=0.005)
    assert "#527" in topo.sources["nic_efficiency"]
    path = group_path(topo, GridShape.of(32), "world", 32)
    busbw = predicted_bus_bandwidth("allreduce", 1 << 30, path, ll128=topo.ll128)
    assert busbw == pytest.approx(topo.nic_efficiency * line, rel=0.03)
    # a DGX's InfiniBand at its assumed 90% would have priced the same run 1.5x faster
    ib = load_preset("dgx-a100-40gb").topology
    assert ib.nic_efficiency / topo.nic_efficiency > 1.5


def test_dgx2_differs_from_dgx2h_only_in_clocks():
    h, d = load_preset("dgx2h-v100"), load_preset("dgx2-v100")
    assert d.peak_flops("float16") / h.peak_flops("float16") == pytest.approx(2.0 / 2.1, rel=1e-3)
    assert d.memory_bytes == h.memory_bytes and d.intra == h.intra and d.inter == h.inter
    strip = lambda t: {k: v for k, v in t.to_dict().items() if k != "sources"}  # noqa: E731
    assert strip(d.topology) == strip(h.topology)
    assert d.device.memory_bandwidth == h.device.memory_bandwidth


def test_dgx1_notes_say_how_the_cube_mesh_is_approximated():
    m = load_preset("dgx1-v100")
    text = m.notes["hybrid_cube_mesh"]
    for words in ("three interwoven rings", "6 x 25 = 150 GB/s", "OPTIMISTIC", "groups of 2 or 4"):
        assert words in text
    assert "32 GB" in m.source and "16 or 32 GB" in m.source


@pytest.mark.parametrize("name", sorted(set(list_presets())))
def test_every_preset_cites_sources(name):
    m = load_preset(name)
    assert len(m.source) > 40 and main_sources(m)
    assert m.notes
    if m.library == "nccl":            # from datasheets: GEMM peaks and memory say where from
        for f in ("gamma_gemm", "gamma_reduce", "memory_bytes"):
            assert isinstance(m.notes.get(f), str) and m.notes[f].strip(), (name, f)
    else:                              # fitted here: the command that measured it
        assert m.notes.get("command"), name
    if m.topology is not None:
        srcs = m.topology.sources
        for f in ("devices_per_node", "intra_bandwidth", "nics_per_node", "nic_bandwidth"):
            assert srcs.get(f, "").strip(), (name, f)
    if m.device is not None:
        for f in ("memory_bandwidth", "vector_flops"):
            assert m.device.sources.get(f, "").strip(), (name, f)


def test_alias_resolves_to_the_same_machine():
    assert ALIASES["dgx-a100-80gb"] == "dgx-a100"
    assert load_machine("dgx-a100-80gb") == load_preset("dgx-a100")
    assert load_preset("dgx-a100-80gb") == load_preset("dgx-a100")
    assert "dgx-a100-80gb" not in list_presets()          # listed as an alias, not twice


# --------------------------------------------------------------------------- variants
from test_costmodel_frozen_presets import _leaves  # noqa: E402  (one flattener of JSON)


def _changed(before: Machine, after: Machine) -> set:
    a, b = _leaves(before.to_dict()), _leaves(after.to_dict())
    return {k for k in set(a) | set(b) if a.get(k, object()) != b.get(k, object())}


PROVENANCE = {"/name", "/notes/variant/of"}


@pytest.mark.parametrize("spec,fields", [
    ("memory=40GiB", {"/memory_bytes", "/notes/memory_bytes"}),
    ("nics=4", {"/topology/nics_per_node", "/topology/sources/nics_per_node"}),
    ("nic_gbps=400", {"/topology/nic_bandwidth", "/topology/sources/nic_bandwidth"}),
    ("gpus=4", {"/topology/devices_per_node", "/node_size", "/cores",
                "/topology/sources/devices_per_node"}),
])
def test_variant_changes_exactly_the_named_field(spec, fields):
    base = load_preset("dgx-a100")
    var = load_machine("dgx-a100:" + spec)
    key = spec.split("=")[0]
    assert _changed(base, var) == fields | PROVENANCE | {f"/notes/variant/set/{key}"}
    assert var.name == "dgx-a100:" + spec
    assert var.notes["variant"] == {"of": "dgx-a100", "set": {key: spec.split("=")[1]}}


def test_variant_values_and_units():
    assert load_machine("dgx-a100:memory=40GiB").memory_bytes == 40 * GiB
    assert load_machine("dgx-a100:memory=80GB").memory_bytes == 80 * GiB   # NVIDIA's 80 GB
    assert load_machine("dgx-a100:memory=2048MiB").memory_bytes == 2048 * (1 << 20)
    assert load_machine("dgx-a100:memory=80gb").memory_bytes == 80 * GiB  # bytes, as byte_size
    for tib in ("1TiB", "1TB", "1T", "1.0 TiB", "1tib"):
        assert load_machine(f"dgx-a100:memory={tib}").memory_bytes == 1 << 40, tib
    leaf = load_machine("dgx-a100:nodes_per_leaf=4,oversub=2").topology
    assert (leaf.nodes_per_leaf, leaf.oversubscription) == (4, 2.0)
    with pytest.raises(ValueError, match="reserve_bytes"):  # below the CUDA context's reserve
        load_machine("dgx-a100:memory=512MiB")
    assert load_machine("dgx-a100:nic_gbps=400").topology.nic_bandwidth == 50e9
    var = load_machine("dgx-a100:memory=40GiB,nics=4,nic_gbps=100")
    assert var.name == "dgx-a100:memory=40GiB,nics=4,nic_gbps=100"
    assert (var.memory_bytes, var.topology.nics_per_node, var.topology.nic_bandwidth) == \
        (40 * GiB, 4, 12.5e9)
    # a variant of a variant's base file, and the variant equals the preset with memory set
    assert load_machine("dgx-a100:memory=40GiB").replace(name="x", notes={}) == \
        load_preset("dgx-a100").replace(name="x", notes={}, memory_bytes=40 * GiB)


def test_variant_of_a_machine_file(tmp_path):
    path = tmp_path / "m.json"
    load_preset("pcie-a100-4gpu").save(path)
    var = load_machine(f"{path}:nics=2")
    assert var.topology.nics_per_node == 2 and var.name == "pcie-a100-4gpu:nics=2"
    assert load_machine(str(path)) == load_preset("pcie-a100-4gpu")


def test_variant_round_trips_through_json(tmp_path):
    var = load_machine("dgx1-v100:memory=16GiB,nics=8")
    var.save(tmp_path / "v.json")
    assert Machine.load(tmp_path / "v.json") == var


@pytest.mark.parametrize("text,key", [
    ("dgx-a100:foo=1", "foo"),
    ("dgx-a100:memory=40", "memory"),             # no unit
    ("dgx-a100:memory=forty GiB", "memory"),
    ("dgx-a100:memory=0GiB", "memory"),
    ("dgx-a100:nics=0", "nics"),
    ("dgx-a100:nics=-2", "nics"),
    ("dgx-a100:nics=2.5", "nics"),
    ("dgx-a100:gpus=0", "gpus"),
    ("dgx-a100:nic_gbps=0", "nic_gbps"),
    ("dgx-a100:nic_gbps=inf", "nic_gbps"),
    ("dgx-a100:nic_gbps=fast", "nic_gbps"),
    ("dgx-a100:nics", "nics"),                    # no value
    ("dgx-a100:nics=4,nics=2", "nics"),           # twice
    ("local-2core-mpich:nics=2", "nics"),         # no topology: does not apply
    ("local-2core-mpich:gpus=2", "gpus"),
    ("frontera-rtx:gpus=3", "gpus"),              # 3 GPUs do not split over 2 sockets
    ("dgx-a100:memory=80Gb", "memory"),           # gigabits, not bytes
    ("dgx-a100:memory=1Tb", "memory"),
    ("dgx-a100:memory=99999999999999999999G", "memory"),   # beyond any device
    ("dgx-a100:nics=99999999999", "nics"),
    ("dgx-a100:gpus=1048577", "gpus"),
    ("dgx-a100:nic_gbps=1e-300", "nic_gbps"),     # 1e301 ms steps, not a machine
    ("dgx-a100:nic_gbps=1e290", "nic_gbps"),
    ("dgx-a100:nodes_per_leaf=1,oversub=1e308", "oversub"),
    ("dgx-a100:oversub=4", "oversub"),            # no leaf domains: it would change nothing
])
def test_bad_variant_names_the_key_and_the_valid_ones(text, key):
    with pytest.raises(ValueError) as err:
        load_machine(text)
    msg = str(err.value)
    assert repr(key) in msg or f"{key}=" in msg, msg
    assert "valid keys" in msg and "memory" in msg, msg


def test_empty_variant_and_unknown_base_are_refused():
    with pytest.raises(ValueError, match="nothing after ':'"):
        load_machine("dgx-a100:")
    with pytest.raises(ValueError, match="one variant per machine"):   # not the last wins
        load_machine("dgx-a100:nics=4:nics=2")
    with pytest.raises(ValueError, match="neither a machine file nor a preset"):
        load_machine("no-such-machine:memory=40GiB")


def test_only_model_read_fields_are_keys():
    # every key sets a field the model reads: the memory-fit checks, or group_path's
    # NICs and fabric (nodes_per_leaf and oversub: the spine bound)
    assert set(VARIANT_KEYS) == {"memory", "gpus", "nics", "nic_gbps", "nodes_per_leaf",
                                 "oversub"}
    for absent in ("oversubscription", "sms", "fragmentation"):
        with pytest.raises(ValueError, match="unknown key"):
            derive(load_preset("dgx-a100"), f"{absent}=2")


# --------------------------------------------------------------------------- predictions
def _allreduce_seconds(machine: Machine, nbytes: float = 1 << 30) -> float:
    """An all-reduce over all 16 GPUs of two nodes of ``machine``."""
    topo = machine.topology
    path = group_path(topo, GridShape.of(2 * topo.devices_per_node), "world",
                      2 * topo.devices_per_node, Placement())
    assert path.nodes == 2
    return nccl_time("allreduce", nbytes, path, ll128=topo.ll128).seconds


def test_fewer_or_slower_nics_make_a_multi_node_allreduce_slower():
    base = _allreduce_seconds(load_preset("dgx-a100"))
    assert _allreduce_seconds(load_machine("dgx-a100:nics=4")) > base
    assert _allreduce_seconds(load_machine("dgx-a100:nics=1")) > \
        _allreduce_seconds(load_machine("dgx-a100:nics=4"))
    assert _allreduce_seconds(load_machine("dgx-a100:nic_gbps=100")) > base
    assert _allreduce_seconds(load_machine("dgx-a100:nic_gbps=400")) < base
    # DGX-1's 4 EDR NICs for 8 GPUs: slower across nodes than a DGX A100's 8 HDR
    assert _allreduce_seconds(load_preset("dgx1-v100")) > base


def _predict(machine: str, *extra) -> dict:
    from summasim.costmodel.tools import predict as predict_tool

    args = predict_tool.build_parser().parse_args(
        ["--model", "gpt3-6.7b", "--machine", machine, *extra])
    return predict_tool.run(args, out=io.StringIO())


def test_fewer_nics_slow_the_data_parallel_step():
    mesh = ("--batch", "16", "--mesh", "dp=2,tp=megatron:8")
    full, one = _predict("dgx-a100", *mesh), _predict("dgx-a100:nics=1", *mesh)
    assert one["breakdown"]["exposed_comm"]["dp"] > full["breakdown"]["exposed_comm"]["dp"]
    assert one["step_seconds"] > full["step_seconds"]
    assert one["breakdown"]["gemm"] == full["breakdown"]["gemm"]      # compute untouched


def test_less_memory_makes_a_plan_that_fit_not_fit():
    grid = ("--batch", "8", "--mesh", "tp=megatron:8")
    big, small = _predict("dgx-a100", *grid), _predict("dgx-a100:memory=40GiB", *grid)
    assert big["fits"] and not small["fits"]
    # the budget is the usable memory: less the device's reserve, less fragmentation
    dev = load_preset("dgx-a100").device
    for got, mem in ((small, 40 * GiB), (big, 80 * GiB)):
        assert got["budget_bytes"] == pytest.approx(
            (mem - dev.reserve_bytes) * (1 - dev.fragmentation))
    assert small["machine"] == "dgx-a100:memory=40GiB"                 # the report says it
    assert small["seconds"] == big["seconds"]                          # time untouched
    assert small["largest_batch"] < big["largest_batch"]
    # the 40 GB DGX A100 preset agrees on the fit
    assert not _predict("dgx-a100-40gb", *grid)["fits"]


# --------------------------------------------------------------------------- the listing
def test_presets_listing_has_every_preset_sources_and_the_variant_keys():
    text = presets_listing()
    for name in list_presets():
        assert name in text
        assert describe(load_preset(name)) in text
    for key in VARIANT_KEYS:
        assert f"  {key} " in text
    assert "dgx-a100:memory=40GiB,nics=4" in text and "dgx-a100-80gb" in text
    assert "sources:" in text


def test_presets_command_lists_and_prints_a_variant(capsys):
    from summasim.costmodel.__main__ import main

    assert main(["presets"]) == 0
    assert "variants:" in capsys.readouterr().out
    assert main(["presets", "dgx-a100:nics=2"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["name"] == "dgx-a100:nics=2" and d["topology"]["nics_per_node"] == 2
    assert main(["presets", "dgx-a100:nics=zero"]) == 2
    assert "'nics'" in capsys.readouterr().err


def test_predict_command_takes_a_variant(capsys):
    from summasim.costmodel.__main__ import main

    assert main(["predict", "--model", "gpt3-6.7b", "--batch", "8", "--mesh", "tp=megatron:8",
                 "--machine", "dgx-a100:memory=40GiB"]) == 0
    out = capsys.readouterr().out
    usable = (40 * GiB - load_preset("dgx-a100").device.reserve_bytes) * 0.85 / GiB
    assert "dgx-a100:memory=40GiB" in out and f"does NOT fit in {usable:.3g} GiB" in out
    assert main(["predict", "--model", "gpt3-6.7b", "--mesh", "tp=megatron:8",
                 "--machine", "dgx-a100:nics=0"]) == 2
    assert "nics" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["dgx-a100:gpus=1", "dgx-a100:gpus=3", "h100-dgx-ndr:gpus=5"])
def test_an_odd_gpu_count_on_an_nvswitch_node_is_a_machine(text):
    """The socket split applies to PCIe nodes (whose flows cross the sockets); NVSwitch
    devices talk through the switch, so any count of them per node is a node."""
    m = load_machine(text)
    gpus = int(text.split("=")[1])
    assert m.topology.devices_per_node == gpus and m.topology.intra_kind == "nvswitch"
