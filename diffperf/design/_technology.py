"""Technology node -> accelerator and network parameters (differentiable).

The tables of `presets/technology.json` (every number with its source) describe

- logic nodes 12, 7, 5, 3, 2, 1.4, 1 nm: logic density, clock, energy per FLOP, SRAM density and
  access energy, leakage, wafer price;
- DRAM generations HBM2 .. HBM4e: bandwidth, capacity and energy per stack, PHY shoreline/area;
- network generations NVLink2 .. NVLink7: SerDes lane rate, energy per bit, lane shoreline/area,
  scale-out NIC rate per GPU, NVLink hop latency and in-switch reduction (NVLS, from NVLink4).

`technology(node_nm, memory_index, network_index)` interpolates the tables **in log space**
(log value piecewise linear in log node, and in the generation index), so a node such as 4 nm
or generation 2.5 is a valid continuous point and every output is differentiable w.r.t. it.
Outside the table range the values are clamped to the end rows.

`generate(tech, design, arch)` turns a technology point, a design (die area, SRAM area, HBM
stacks, NVLink lanes, power and perimeter budgets) and architecture constants into an
`Accelerator`, a `Network` and the design's resource usage (area, power, perimeter, cost):

    compute area   A_c = A_die - A_sram - stacks * A_phy - lanes * A_lane - other_frac * A_die
    area-limited   F_a = A_c * density * fmax * kappa          (FLOP/s, kappa: FLOP/clk/transistor)
    power-limited  P_a = F_a * E_flop at fmax;  P_avail = P - P_hbm - P_link - P_leak - P_sram
                   with DVFS (P ~ f^3 near nominal) the clock scales by r = (P_avail / P_a)^(1/3)
    tensor FLOP/s  F = F_a * smin(1, r)                         (p-norm smooth min, p = 8)
    HBM            BW = stacks * BW_stack * s,  capacity = stacks * C_stack
    NVLink         BW = lanes * lane_rate / 8 * s,   s = smin(1, perimeter / shoreline used)

`kappa` per architecture (Ampere / Hopper / Blackwell) is the only fitted constant: it is solved
(`calibrate_architectures`) so that the A100, H100 and B200 reference designs reproduce their
datasheet dense bf16 FLOP/s; HBM bandwidth and capacity and NVLink bandwidth then follow from the
tables alone (tested within 10 %). Pure JAX: jit / vmap / grad through every leaf; the SM count
is rounded forward with a straight-through gradient.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks import names_number_fields, number_field as _F
from ..specs._hardware import Accelerator, Network

#: Sharpness of the p-norm smooth minimum used for power and shoreline limits: 32 spends a
#: binding power budget to within 2 % (8, used before 2026-11-24, left up to 8 % of the clock
#: unused at the limit, which the fitted kappa then made up for on designs with spare power).
SMOOTH_P = 32.0
#: Die area outside compute, SRAM and IO PHYs (command processors, NoC, die-to-die, media), share.
OTHER_FRAC = 0.15
#: Scale-out ring hop latency of the generated network (as in presets/systems.json), s; the
#: NVLink hop latency and NVLS come with the network generation (`technology`).
SCALEOUT_LATENCY = 14e-6
#: Fixed kernel launch cost of generated accelerators (as in presets/gpus.json), s.
LAUNCH_OVERHEAD = 3e-6
#: Usable wafer diameter for the dies-per-wafer estimate, mm.
WAFER_MM = 300.0

_LOGIC_KEYS = ("logic_mtr_per_mm2", "fmax_ghz", "vdd_v", "pj_per_flop", "sram_mb_per_mm2",
               "sram_pj_per_bit", "leakage_w_per_mm2", "wafer_usd")
_MEM_KEYS = ("gb_s_per_stack", "gb_per_stack", "pj_per_bit", "phy_shoreline_mm", "phy_area_mm2",
             "usd_per_gb")
_NET_KEYS = ("serdes_gbps", "pj_per_bit", "lane_shoreline_mm", "lane_area_mm2", "scaleout_gbps",
             "hop_latency_us")
ARCHITECTURES = ("ampere", "hopper", "blackwell")




@functools.cache
def tables() -> dict:
    """The raw technology tables (presets/technology.json)."""
    text = resources.files("diffperf.presets").joinpath("technology.json").read_text()
    return json.loads(text)


def node_names() -> list[float]:
    """Logic nodes in the table, nm (descending)."""
    return [r["node_nm"] for r in tables()["logic"]["rows"]]


def memory_names() -> list[str]:
    return [r["name"] for r in tables()["memory"]["rows"]]


def network_names() -> list[str]:
    return [r["name"] for r in tables()["network"]["rows"]]


@names_number_fields
class TechParams(eqx.Module):
    """One technology point (SI units). Every leaf is differentiable.

    Logic: `logic_density` transistors/m^2... kept in the table's engineering units for
    readability: `logic_density` MTr/mm^2, `fmax` Hz, `vdd` V, `energy_per_flop` J/FLOP,
    `sram_density` bit/mm^2, `sram_energy` J/bit, `leakage` W/mm^2, `wafer_cost` USD.
    Memory (per HBM stack): `hbm_bw` B/s, `hbm_cap` B, `hbm_energy` J/bit, `hbm_shoreline` mm,
    `hbm_phy_area` mm^2, `hbm_cost` USD/B. Network: `lane_rate` bit/s per direction,
    `link_energy` J/bit, `lane_shoreline` mm, `lane_area` mm^2, `scaleout_bw` B/s per GPU,
    `nvlink_latency` s per ring hop, `nvlink_sharp` 1 if the switches reduce in-network (NVLS;
    the nearest generation's, a step, not interpolated).
    """

    logic_density: jax.Array = _F()
    fmax: jax.Array = _F()
    vdd: jax.Array = _F()
    energy_per_flop: jax.Array = _F()
    sram_density: jax.Array = _F()
    sram_energy: jax.Array = _F()
    leakage: jax.Array = _F()
    wafer_cost: jax.Array = _F()
    hbm_bw: jax.Array = _F()
    hbm_cap: jax.Array = _F()
    hbm_energy: jax.Array = _F()
    hbm_shoreline: jax.Array = _F()
    hbm_phy_area: jax.Array = _F()
    hbm_cost: jax.Array = _F()
    lane_rate: jax.Array = _F()
    link_energy: jax.Array = _F()
    lane_shoreline: jax.Array = _F()
    lane_area: jax.Array = _F()
    scaleout_bw: jax.Array = _F()
    nvlink_latency: jax.Array = _F()
    nvlink_sharp: jax.Array = _F()


@names_number_fields
class ArchParams(eqx.Module):
    """Architecture constants (not technology): `kappa` dense bf16 tensor FLOP per clock per
    compute-area transistor (calibrated), `flop_per_clk_per_sm` (whitepapers), `vector_ratio`,
    `fp32_ratio`, `fp8`, `fp4` (multipliers of the bf16 rate), `l2_bytes_per_flop` (L2 B/s per
    tensor FLOP/s)."""

    kappa: jax.Array = _F()
    flop_per_clk_per_sm: jax.Array = _F()
    vector_ratio: jax.Array = _F()
    fp32_ratio: jax.Array = _F()
    fp8: jax.Array = _F()
    fp4: jax.Array = _F()
    l2_bytes_per_flop: jax.Array = _F()


@names_number_fields
class Design(eqx.Module):
    """A chip + package design and its budgets (continuous).

    **Arguments:**

    - `area_mm2`: total logic-die area (all dies), mm^2.
    - `sram_mm2`: die area of SRAM (L2) macros, mm^2.
    - `hbm_stacks`: HBM stacks (continuous for optimisation), count.
    - `nvlink_lanes`: NVLink SerDes lanes per direction, count.
    - `power_w`: board power budget (TDP), W.
    - `perimeter_mm`: die edge available to IO PHYs (HBM + NVLink), mm.
    - `dies`: logic dies the area is split into (for yield / cost), count.
    - `nvlink_domain`: GPUs per NVLink domain of the generated network, count.
    """

    area_mm2: jax.Array = _F()
    sram_mm2: jax.Array = _F()
    hbm_stacks: jax.Array = _F()
    nvlink_lanes: jax.Array = _F()
    power_w: jax.Array = _F()
    perimeter_mm: jax.Array = _F()
    dies: jax.Array = _F(default=1.0)
    nvlink_domain: jax.Array = _F(default=8.0)


class Usage(eqx.Module):
    """Resources a design uses and what limits it."""

    compute_mm2: jax.Array  # compute (SM array) area, mm^2
    io_mm2: jax.Array  # HBM PHY + NVLink SerDes area, mm^2
    shoreline_mm: jax.Array  # die edge used by HBM + NVLink PHYs, mm
    power_w: jax.Array  # total power at the operating point (<= power budget when feasible), W
    io_power_w: jax.Array  # HBM + NVLink + SRAM + leakage power, W
    freq_scale: jax.Array  # achieved clock / fmax (power limit), (0, 1]
    cost_usd: jax.Array  # die (yielded) + HBM + package + SerDes, USD


class Generated(eqx.Module):
    accelerator: Accelerator
    network: Network
    usage: Usage


def _smin1(r):
    """Smooth min(1, r) for r > 0: (1 + r^-p)^(-1/p), in log space (no overflow of r^-p):
    within 2.2 % of min(1, r) at r = 1 and 0.01 % at r = 1.2 or 1 / 1.2 (p = 32)."""
    r = jnp.maximum(r, 1e-12)
    return jnp.exp(-jax.nn.softplus(-SMOOTH_P * jnp.log(r)) / SMOOTH_P)


def _interp(x, xp, fp):
    """Log-value interpolation: exp(interp(x, xp, log fp)) with clamping."""
    return jnp.exp(jnp.interp(x, jnp.asarray(xp), jnp.log(jnp.asarray(fp))))


def _column(rows, key):
    return np.asarray([float(r[key]) for r in rows])


def _nearest_row(index, column):
    """`column` at the table row nearest to a continuous generation `index` (clamped): for
    flags, which do not interpolate."""
    i = jnp.clip(jnp.round(jnp.asarray(index)), 0, len(column) - 1).astype(jnp.int32)
    return jnp.asarray(column)[i]


def technology(node_nm, memory_index, network_index) -> TechParams:
    """Interpolate the tables at a (continuous) logic node (nm), HBM generation index
    (0 HBM2, 1 HBM2e, 2 HBM3, 3 HBM3e, 4 HBM4, 5 HBM4e) and network index (0 NVLink2 ..
    5 NVLink7). Log-space interpolation; clamped at the table ends. Works under jit/vmap/grad."""
    t = tables()
    logic, mem, net = t["logic"]["rows"], t["memory"]["rows"], t["network"]["rows"]
    xn = -np.log(_column(logic, "node_nm"))  # ascending
    x = -jnp.log(jnp.asarray(node_nm, dtype=jnp.result_type(float)))
    L = {k: _interp(x, xn, _column(logic, k)) for k in _LOGIC_KEYS}
    im = np.arange(len(mem), dtype=float)
    M = {k: _interp(jnp.asarray(memory_index, dtype=x.dtype), im, _column(mem, k))
         for k in _MEM_KEYS}
    inet = np.arange(len(net), dtype=float)
    N = {k: _interp(jnp.asarray(network_index, dtype=x.dtype), inet, _column(net, k))
         for k in _NET_KEYS}
    return TechParams(
        logic_density=L["logic_mtr_per_mm2"], fmax=L["fmax_ghz"] * 1e9, vdd=L["vdd_v"],
        energy_per_flop=L["pj_per_flop"] * 1e-12, sram_density=L["sram_mb_per_mm2"] * 1e6,
        sram_energy=L["sram_pj_per_bit"] * 1e-12, leakage=L["leakage_w_per_mm2"],
        wafer_cost=L["wafer_usd"],
        hbm_bw=M["gb_s_per_stack"] * 1e9, hbm_cap=M["gb_per_stack"] * 2.0**30,
        hbm_energy=M["pj_per_bit"] * 1e-12, hbm_shoreline=M["phy_shoreline_mm"],
        hbm_phy_area=M["phy_area_mm2"], hbm_cost=M["usd_per_gb"] / 2.0**30,
        lane_rate=N["serdes_gbps"] * 1e9, link_energy=N["pj_per_bit"] * 1e-12,
        lane_shoreline=N["lane_shoreline_mm"], lane_area=N["lane_area_mm2"],
        scaleout_bw=N["scaleout_gbps"] * 1e9 / 8.0, nvlink_latency=N["hop_latency_us"] * 1e-6,
        nvlink_sharp=_nearest_row(network_index, _column(net, "nvls")))


def _die_cost(tech: TechParams, design: Design):
    """Yielded logic-die cost: wafer price / good dies (Murphy yield), USD."""
    a = design.area_mm2 / design.dies
    per_wafer = (jnp.pi * (WAFER_MM / 2) ** 2 / a - jnp.pi * WAFER_MM / jnp.sqrt(2.0 * a))
    per_wafer = jnp.maximum(per_wafer, 1.0)
    d0 = tables()["costs"]["defect_density_per_cm2"] / 100.0  # per mm^2
    ad = a * d0
    yld = ((1.0 - jnp.exp(-ad)) / ad) ** 2
    return design.dies * tech.wafer_cost / (per_wafer * yld)


def generate(tech: TechParams, design: Design, arch: ArchParams) -> Generated:
    """Accelerator, Network and resource usage of `design` built in technology `tech` with
    architecture `arch` (see the module docstring for the equations). Pure JAX."""
    costs = tables()["costs"]
    io_mm2 = design.hbm_stacks * tech.hbm_phy_area + design.nvlink_lanes * tech.lane_area
    compute_mm2 = design.area_mm2 * (1.0 - OTHER_FRAC) - design.sram_mm2 - io_mm2
    # a soft floor keeps everything finite for designs with no compute area left (infeasible)
    compute_mm2 = jax.nn.softplus(compute_mm2 / 10.0) * 10.0
    shoreline = (design.hbm_stacks * tech.hbm_shoreline
                 + design.nvlink_lanes * tech.lane_shoreline)
    shore_scale = _smin1(design.perimeter_mm / jnp.maximum(shoreline, 1e-9))
    hbm_bw = design.hbm_stacks * tech.hbm_bw * shore_scale
    nvlink_bw = design.nvlink_lanes * tech.lane_rate / 8.0 * shore_scale

    flops_area = compute_mm2 * tech.logic_density * 1e6 * tech.fmax * arch.kappa
    l2_bw_per_flop = arch.l2_bytes_per_flop
    # power of everything but the tensor datapath, at the final bandwidths (SRAM power scales
    # with the L2 traffic, approximated at the area-limited rate)
    p_io = (hbm_bw * 8.0 * tech.hbm_energy + 2.0 * nvlink_bw * 8.0 * tech.link_energy
            + tech.leakage * design.area_mm2
            + l2_bw_per_flop * flops_area * 8.0 * tech.sram_energy * 0.25)
    p_avail = design.power_w - p_io
    p_avail = jax.nn.softplus(p_avail / (0.01 * design.power_w)) * 0.01 * design.power_w
    p_area = flops_area * tech.energy_per_flop
    r = (p_avail / p_area) ** (1.0 / 3.0)
    freq_scale = _smin1(r)
    flops = flops_area * freq_scale
    power = p_io + p_area * freq_scale ** 3

    f = tech.fmax * freq_scale
    sms = flops / (arch.flop_per_clk_per_sm * f)
    sms = jnp.maximum(sms, 1.0)
    sms = sms + jax.lax.stop_gradient(jnp.round(sms) - sms)
    sram_bytes = design.sram_mm2 * tech.sram_density / 8.0
    acc = Accelerator(
        flops_fp32=flops * arch.fp32_ratio, flops_bf16=flops, flops_fp8=flops * arch.fp8,
        flops_fp4=flops * arch.fp4, vector_flops=flops * arch.vector_ratio,
        hbm_capacity=design.hbm_stacks * tech.hbm_cap, hbm_bandwidth=hbm_bw,
        l2_capacity=jnp.maximum(sram_bytes, 1.0), l2_bandwidth=flops * l2_bw_per_flop,
        num_sms=sms, launch_overhead=LAUNCH_OVERHEAD)
    net = Network(nvlink_domain=design.nvlink_domain, nvlink_bandwidth=nvlink_bw,
                  nvlink_latency=tech.nvlink_latency, scaleout_bandwidth=tech.scaleout_bw,
                  scaleout_latency=SCALEOUT_LATENCY, nvlink_sharp=tech.nvlink_sharp)
    cost = (_die_cost(tech, design) + design.hbm_stacks * tech.hbm_cap * tech.hbm_cost
            + costs["package_usd"] + design.nvlink_lanes * costs["usd_per_nvlink_lane"])
    usage = Usage(compute_mm2=compute_mm2, io_mm2=io_mm2, shoreline_mm=shoreline, power_w=power,
                  io_power_w=p_io, freq_scale=freq_scale, cost_usd=cost)
    return Generated(acc, net, usage)


def accelerator_from_technology(tech: TechParams, design: Design,
                                arch: ArchParams) -> tuple[Accelerator, Network]:
    """`(Accelerator, Network)` of `design` in technology `tech` (see `generate`)."""
    g = generate(tech, design, arch)
    return g.accelerator, g.network


# ----------------------------------------------------------------------------- references


def _arch_row(name: str) -> dict:
    archs = tables()["architectures"]
    if name not in archs or name.startswith("_"):
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    return archs[name]


_FLOP_PER_CLK_PER_SM = {"ampere": 2048.0, "hopper": 4096.0, "blackwell": 8192.0}
_L2_BYTES_PER_FLOP = {"ampere": 5.0e12 / 312e12, "hopper": 10e12 / 989.5e12,
                      "blackwell": 20e12 / 2250e12}


def _arch(name: str, kappa) -> ArchParams:
    row = _arch_row(name)
    return ArchParams(kappa=kappa, flop_per_clk_per_sm=_FLOP_PER_CLK_PER_SM[name],
                      vector_ratio=row["vector_ratio"], fp32_ratio=row["fp32_ratio"],
                      fp8=row["fp8"], fp4=row["fp4"], l2_bytes_per_flop=_L2_BYTES_PER_FLOP[name])


def reference_names() -> list[str]:
    return [k for k in tables()["references"] if not k.startswith("_")]


def _reference_row(name: str) -> dict:
    refs = tables()["references"]
    key = str(name).lower()
    if key not in refs or key.startswith("_"):
        raise ValueError(f"unknown reference design {name!r}; known: "
                         f"{', '.join(reference_names())}")
    return refs[key]


def reference_point(name: str) -> tuple[TechParams, Design, str]:
    """Technology, design and architecture name of a reference GPU (a100, h100, b200)."""
    row = _reference_row(name)
    tech = technology(row["node_nm"], row["memory_index"], row["network_index"])
    sram_mm2 = row["sram_mb"] * 8e6 / tech.sram_density
    perimeter = row["dies"] * 4.0 * np.sqrt(row["area_mm2"] / row["dies"])
    design = Design(area_mm2=row["area_mm2"], sram_mm2=sram_mm2, hbm_stacks=row["hbm_stacks"],
                    nvlink_lanes=row["nvlink_lanes"], power_w=row["power_w"],
                    perimeter_mm=perimeter, dies=row["dies"])
    return tech, design, row["arch"]


@functools.cache
def calibrate_architectures() -> dict[str, float]:
    """Solve `kappa` of each architecture so its reference design reproduces the datasheet dense
    bf16 FLOP/s (bisection in log kappa; the FLOP/s are monotonic in kappa). Returns
    {arch: kappa} in FLOP per clock per compute-area transistor."""
    out = {}
    for ref in reference_names():
        row = _reference_row(ref)
        tech, design, arch = reference_point(ref)
        target = row["target_flops_bf16"]

        def flops(log_k, tech=tech, design=design, arch=arch):
            return float(generate(tech, design, _arch(arch, np.exp(log_k))).accelerator.flops_bf16)

        lo, hi = np.log(1e-9), np.log(1e-3)
        for _ in range(45):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if flops(mid) < target else (lo, mid)
        out[arch] = float(np.exp(0.5 * (lo + hi)))
    return out


def architecture(name: str) -> ArchParams:
    """Calibrated `ArchParams` of an architecture (ampere, hopper, blackwell)."""
    _arch_row(name)
    return _arch(name, calibrate_architectures()[name])


def reference(name: str) -> Generated:
    """The generated A100 / H100 / B200 (for comparison with their datasheets)."""
    tech, design, arch = reference_point(name)
    return generate(tech, design, architecture(arch))


def reference_table() -> list[dict]:
    """Generated vs datasheet for every reference design (ratios generated / datasheet)."""
    rows = []
    for name in reference_names():
        row = _reference_row(name)
        g = reference(name)
        a, n = g.accelerator, g.network
        got = {"flops_bf16": float(a.flops_bf16), "hbm_bandwidth": float(a.hbm_bandwidth),
               "hbm_capacity": float(a.hbm_capacity), "nvlink_bandwidth": float(n.nvlink_bandwidth)}
        out = {"gpu": name, "freq_scale": float(g.usage.freq_scale),
               "power_w": float(g.usage.power_w), "cost_usd": float(g.usage.cost_usd),
               "num_sms": float(a.num_sms)}
        for k, v in got.items():
            out[k] = v
            out[f"{k}_ratio"] = v / row[f"target_{k}"]
        rows.append(out)
    return rows


def scaled_design(base: Design, node_nm) -> Design:
    """The same design budgets at another node (area, power, perimeter, stacks, lanes kept; the
    SRAM area kept too, so capacity scales with SRAM density)."""
    del node_nm
    return base
