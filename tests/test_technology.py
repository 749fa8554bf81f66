"""The technology generator: datasheet reproduction, interpolation, jit / vmap / grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffperf.internal import technology as T


@pytest.mark.parametrize("row", T.reference_table(), ids=lambda r: r["gpu"])
def test_generator_reproduces_datasheets_within_10_percent(row):
    for key in ("flops_bf16", "hbm_bandwidth", "hbm_capacity", "nvlink_bandwidth"):
        assert abs(row[f"{key}_ratio"] - 1.0) < 0.10, (row["gpu"], key, row[f"{key}_ratio"])


@pytest.mark.parametrize("gpu, system", [("a100", "dgx-a100"), ("h100", "dgx-h100"),
                                         ("b200", "dgx-b200")])
def test_generated_network_latency_and_nvls_match_the_preset_system(gpu, system):
    """The NVLink generation carries its hop latency (2 us to NVLink3, NCCL's 0.6 us LL hop
    from NVLink4) and NVLS, as the shipped systems do."""
    from diffperf import presets
    net = T.reference(gpu).network
    want = presets.system(system).network
    assert np.isclose(float(net.nvlink_latency), float(want.nvlink_latency), rtol=1e-5)
    assert float(net.nvlink_sharp) == float(want.nvlink_sharp)
    assert np.isclose(float(net.scaleout_latency), float(want.scaleout_latency), rtol=1e-6)


def test_nvls_flag_is_the_nearest_generation_and_vmaps():
    flags = jax.vmap(lambda i: T.technology(5.0, 2.0, i).nvlink_sharp)(
        jnp.array([0.0, 1.0, 1.4, 1.6, 2.0, 5.0, 9.0]))
    assert np.asarray(flags).tolist() == [0, 0, 0, 1, 1, 1, 1]
    # the hop latency interpolates in log space between NVLink3 (2 us) and NVLink4 (0.6 us)
    mid = float(T.technology(5.0, 2.0, 1.5).nvlink_latency)
    assert np.isclose(mid, np.sqrt(2e-6 * 0.6e-6), rtol=1e-4)


def test_interpolation_hits_table_rows_and_is_monotonic():
    rows = T.tables()["logic"]["rows"]
    for r in rows:
        tp = T.technology(r["node_nm"], 0, 0)
        assert np.isclose(float(tp.logic_density), r["logic_mtr_per_mm2"], rtol=1e-4)
    nodes = jnp.geomspace(12.0, 1.0, 40)
    dens = jax.vmap(lambda n: T.technology(n, 1.0, 1.0).logic_density)(nodes)
    assert np.all(np.diff(np.asarray(dens)) > 0)
    # between rows: geometric (log-space) interpolation
    mid = float(T.technology(np.sqrt(7 * 5), 0, 0).logic_density)
    assert np.isclose(mid, np.sqrt(91.2 * 138.2), rtol=1e-3)


def test_generator_vmaps_and_differentiates_over_the_node():
    _, design, arch = T.reference_point("h100")
    arch_p = T.architecture(arch)

    def flops(node):
        return T.generate(T.technology(node, 2.0, 2.0), design, arch_p).accelerator.flops_bf16

    f = jax.jit(jax.vmap(flops))(jnp.array([12.0, 7.0, 4.0, 3.0, 1.0]))
    assert np.all(np.isfinite(f)) and np.all(np.diff(np.asarray(f)) > 0)
    g = jax.grad(lambda n: jnp.log(flops(n)))(4.0)
    assert np.isfinite(g) and g < 0  # smaller node -> more FLOP/s


def test_power_budget_is_respected_and_binds_when_small():
    tech, design, arch = T.reference_point("b200")
    arch_p = T.architecture(arch)
    for p in (500.0, 700.0, 1000.0, 2000.0):
        d = T.Design(design.area_mm2, design.sram_mm2, design.hbm_stacks, design.nvlink_lanes,
                     p, design.perimeter_mm, design.dies)
        u = T.generate(tech, d, arch_p).usage
        assert float(u.power_w) <= p * (1 + 1e-5)
    low = T.Design(design.area_mm2, design.sram_mm2, design.hbm_stacks, design.nvlink_lanes,
                   500.0, design.perimeter_mm, design.dies)
    assert float(T.generate(tech, low, arch_p).usage.freq_scale) < 0.7
    # below the IO + leakage power the design is infeasible: reported, never NaN
    tiny = T.Design(design.area_mm2, design.sram_mm2, design.hbm_stacks, design.nvlink_lanes,
                    300.0, design.perimeter_mm, design.dies)
    u = T.generate(tech, tiny, arch_p).usage
    assert float(u.io_power_w) > 300.0 and np.isfinite(float(u.power_w))


def test_unknown_reference_and_architecture_raise():
    with pytest.raises(ValueError, match="unknown reference"):
        T.reference_point("v100")
    with pytest.raises(ValueError, match="unknown architecture"):
        T.architecture("volta")


def test_every_table_row_has_a_source():
    t = T.tables()
    for section in ("logic", "memory", "network"):
        for r in t[section]["rows"]:
            assert r.get("source"), (section, r)
    for name in T.reference_names():
        assert t["references"][name]["source"]


@pytest.mark.slow
def test_technology_cli_takes_an_inference_workload(capsys):
    """`diffperf technology --infer-model/--tp/--batch/--input/--output` studies that plan (the
    JSON says which), and a plan whose tp does not divide the heads is refused by name."""
    import json

    from diffperf.cli import main
    assert main(["technology", "--nodes", "12", "--infer-model", "llama3-8b", "--tp", "1",
                 "--batch", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inference"] == {"model": "llama3-8b", "tp": 1, "batch": 16, "input": 128,
                                "output": 128}
    tpot = [r["infer_tpot_ms"] for r in out["nodes"]]
    assert len(tpot) == 4 and all(np.isfinite(tpot))
    assert main(["technology", "--nodes", "12", "--tp", "3"]) == 2
    assert "tp does not divide heads (tp=3" in capsys.readouterr().err
