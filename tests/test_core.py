"""The core pieces under the compressors: registry and specs, bit packing, randomness, feedback, CLI."""
from __future__ import annotations

import json
import math

import pytest
import torch

import gradpress
from gradpress.cli import main as cli
from gradpress.core.registry import split_specs
from gradpress.core.rng import Context, mix32_torch, uniform24_torch
from gradpress.kernels.bits import pack_bits, packed_nbytes, unpack_bits
from gradpress.kernels.jit import numba_disabled
from numerics import unit_roundoff


# -- registry and specs ---------------------------------------------------------------------------
def test_make_reads_typed_parameters():
    c = gradpress.make("topk:ratio=1/64")
    assert c.ratio == pytest.approx(1 / 64) and c.spec == "topk:ratio=0.015625"
    assert gradpress.make("randomk:scale=true", ratio=0.5).spec == "randomk:ratio=0.5,scale=true"


def test_unknown_name_lists_what_exists():
    with pytest.raises(ValueError, match=r"unknown compressor 'nope' \(did you mean 'none'\?\); known: .*topk"):
        gradpress.make("nope")


def test_unknown_key_lists_the_parameters():
    with pytest.raises(ValueError, match=r"'topk' has no parameter 'k'; its parameters: ratio"):
        gradpress.make("topk:k=3")


@pytest.mark.parametrize("spec", ["topk:ratio=abc", "topk:ratio", "randomk:scale=maybe", ":ratio=1"])
def test_malformed_specs_raise(spec):
    with pytest.raises(ValueError):
        gradpress.make(spec)


def test_parameter_validation():
    with pytest.raises(ValueError, match="ratio must be in"):
        gradpress.make("topk:ratio=0")


def test_composition_needs_kept_values():
    c = gradpress.make("topk:ratio=0.5+fp16")
    assert isinstance(c, gradpress.Compose) and c.spec == "topk:ratio=0.5+fp16"
    with pytest.raises(ValueError, match="ambiguous"):
        gradpress.make("topk+fp16", ratio=0.1)
    for variable in ("threshold", "dgc"):  # a receiver cannot decode another worker's second stage yet
        with pytest.raises(ValueError, match="data-dependent number of values"):
            gradpress.make(f"{variable}+natural")


def test_split_specs():
    assert split_specs("topk:ratio=0.01,randomk:ratio=0.1,scale=true,none") == [
        "topk:ratio=0.01", "randomk:ratio=0.1,scale=true", "none"]
    assert split_specs("topk:ratio=0.1+fp16,bf16") == ["topk:ratio=0.1+fp16", "bf16"]
    with pytest.raises(ValueError, match="without a compressor name"):
        split_specs("ratio=0.1,topk")


def test_every_registered_compressor_declares_its_facts():
    for name in gradpress.compressor_names():
        c = gradpress.make(name)
        assert c.name == name and c.__doc__ and isinstance(c.unbiased, bool) and isinstance(c.summable, bool)
        assert c.default_feedback in gradpress.feedback_names()


# -- bit packing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_pack_round_trip_and_size(bits, n):
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == packed_nbytes(n, bits) == math.ceil(n * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, n), codes)
    with numba_disabled():
        assert torch.equal(pack_bits(codes, bits), packed)
        assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_pack_layout_is_little_endian_bit_stream():
    # codes 1, 2, 3 in 3 bits: stream bits 100 010 110 -> byte0 = 0b11010001, byte1 = 0b0
    packed = pack_bits(torch.tensor([1, 2, 3], dtype=torch.uint8), 3)
    assert packed.tolist() == [0b11010001, 0]


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError):
        pack_bits(torch.zeros(3, dtype=torch.uint8), 9)
    with pytest.raises(TypeError):
        pack_bits(torch.zeros(3, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 100)


# -- randomness -----------------------------------------------------------------------------------
def test_shared_streams_ignore_rank_private_streams_do_not():
    a, b = Context(seed=1, step=2, key="w", rank=0), Context(seed=1, step=2, key="w", rank=3)
    assert a.shared_seed() == b.shared_seed()
    assert a.private_seed() != b.private_seed()
    assert a.shared_seed() != Context(seed=1, step=3, key="w").shared_seed()
    assert a.shared_seed() != a.with_key("v").shared_seed()


def test_hash_uniforms_are_uniform():
    u = uniform24_torch(1 << 20, seed=12345, device="cpu")
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    hist = torch.histc(u, bins=64, min=0, max=1)
    expected = u.numel() / 64
    chi2 = float(((hist - expected) ** 2 / expected).sum())
    assert chi2 < 120  # 63 degrees of freedom: p < 1e-5 beyond ~120
    # neighbouring elements and neighbouring seeds are uncorrelated
    v = uniform24_torch(1 << 20, seed=12346, device="cpu")
    assert abs(float(torch.corrcoef(torch.stack([u[1:], u[:-1]]))[0, 1])) < 0.005
    assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 0.005
    assert int(mix32_torch(torch.tensor([0]), 0)) == 0  # fmix32(0) = 0 is the hash's fixed point


def test_numba_hash_is_the_torch_hash():
    import numpy as np
    from numba import njit

    from gradpress.kernels.jit import mix32, uniform24

    @njit
    def hashes(n, seed):
        out = np.empty(n, np.uint32)
        uniforms = np.empty(n, np.float32)
        for i in range(n):
            out[i] = mix32(i, seed)
            uniforms[i] = uniform24(i, seed)
        return out, uniforms

    for seed in (0, 7, 0xDEADBEEF):
        bits, uniforms = hashes(1 << 16, np.uint32(seed))
        index = torch.arange(1 << 16)
        assert torch.equal(torch.from_numpy(bits.astype(np.int64)), mix32_torch(index, seed))
        assert torch.equal(torch.from_numpy(uniforms), uniform24_torch(1 << 16, seed, "cpu"))


# -- feedback -------------------------------------------------------------------------------------
def test_residual_feedback_telescopes():
    """GRACE Eq. 5 with β = γ = 1: what was transmitted plus the final memory equals what came in."""
    c, fb = gradpress.make("topk:ratio=0.05"), gradpress.make_feedback("residual")
    grads = [torch.randn(500) for _ in range(6)]
    sent = torch.zeros(500)
    rounded = torch.zeros(500, dtype=torch.float64)
    for step, g in enumerate(grads):
        phi = fb.compensate("w", g)
        out = c.decompress(c.compress(phi, Context(step=step)))
        fb.update("w", phi, out)
        sent += out
        rounded += phi.double().abs() + fb.memory("w").double().abs() + sent.double().abs()
    total = sent + fb.memory("w")
    # float32: the identity is linear, so its error is the sum of the roundings of φ = m + g, m = φ − C(φ),
    # the running sum and this last sum, each at most u of the value rounded
    bound = unit_roundoff() * (rounded + total.double().abs())
    assert ((total.double() - sum(g.double() for g in grads)).abs() <= bound).all()


def test_residual_beta_gamma_and_state_dict():
    fb = gradpress.make_feedback("residual:beta=0.5,gamma=2")
    g = torch.ones(4, dtype=torch.bfloat16)
    fb.update("w", torch.full((4,), 3.0), torch.ones(4))  # memory = 2
    phi = fb.compensate("w", g)
    assert phi.dtype == torch.float32 and phi.tolist() == [3.0] * 4  # 0.5 * 2 + 2 * 1
    restored = gradpress.make_feedback("residual:beta=0.5,gamma=2")
    restored.load_state_dict(fb.state_dict())
    assert torch.equal(restored.compensate("w", g), phi)
    with pytest.raises(ValueError, match="shape"):
        fb.compensate("w", torch.ones(5))


@pytest.mark.parametrize("numel", [2**21, 2**21 + 13, 3 * 2**20 + 5])
def test_residual_compensates_large_tensors_in_the_bits_of_torch_add(numel):
    """φ = m + g past the caches (a numba pass with non-temporal stores on the CPU): the bits of
    torch.add, with or without numba."""
    g = torch.Generator().manual_seed(numel)
    grads, memory = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    fast, slow = gradpress.make_feedback("residual"), gradpress.make_feedback("residual")
    for fb in (fast, slow):
        fb.update("w", memory.clone(), torch.zeros(numel))
    phi = fast.compensate("w", grads)
    with numba_disabled():
        reference = slow.compensate("w", grads)
    assert torch.equal(phi, memory + grads) and torch.equal(reference, phi)


# -- CLI ------------------------------------------------------------------------------------------
def test_bench_ops_times_compress_decompress_and_copy_round_by_round():
    """One warm-up call of each, then one call of each per round: the copy a ratio divides by is timed
    beside the calls it divides, not in a block of its own after them."""
    from gradpress.bench.ops import interleaved_ms, median_ms

    order: list[str] = []
    ms = interleaved_ms({"compress": lambda: order.append("c"), "decompress": lambda: order.append("d"),
                         "copy": lambda: order.append("x")}, 3)
    assert order == ["c", "d", "x"] * 4
    assert set(ms) == {"compress", "decompress", "copy"} and all(v >= 0 for v in ms.values())
    calls: list[int] = []
    assert median_ms(lambda: calls.append(1), 5) >= 0 and len(calls) == 6


def test_bench_ops_writes_records(tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert cli(["bench", "ops", "--compressors", "topk:ratio=0.1,randomk:ratio=0.1,scale=true,none",
                "--sizes", "1000,2^12", "--repeats", "1", "--workers", "3", "--json", str(out),
                "--glibc-defaults"]) == 0  # (this test process's allocator left as it is)
    records = json.loads(out.read_text())
    assert [(r["spec"], r["numel"]) for r in records] == [
        ("topk:ratio=0.1", 1000), ("topk:ratio=0.1", 4096), ("randomk:ratio=0.1,scale=true", 1000),
        ("randomk:ratio=0.1,scale=true", 4096), ("none", 1000), ("none", 4096)]
    fields = {"name", "spec", "numel", "bits_per_element", "nmse", "nmse_avg_n", "workers",
              "compress_ms", "decompress_ms", "copy_ms", "device", "compress_syncs", "decompress_syncs",
              "compress_host_ops", "decompress_host_ops"}
    assert all(set(r) == fields for r in records)
    # the host audit is of GPU runs: on the CPU there is nothing to audit
    assert all(r["device"] == "cpu" and r["compress_syncs"] is None and r["compress_host_ops"] is None
               for r in records)
    none = records[-1]
    assert none["bits_per_element"] == 32 and none["nmse"] == 0 and none["workers"] == 3
    topk = records[1]
    assert topk["bits_per_element"] == pytest.approx(math.ceil(0.1 * 4096) * 64 / 4096)
    assert 0 < topk["nmse"] < 1
    rk = records[3]
    # random-k draws its indices from the shared stream: n workers sending the same vector send the same
    # values, so averaging them removes nothing (private-noise methods are checked in their own tests)
    assert rk["nmse_avg_n"] == pytest.approx(rk["nmse"], rel=1e-6)


def test_cli_list(capsys):
    assert cli(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in gradpress.compressor_names())


@pytest.mark.parametrize("numel", [65536, 300_001])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_topk_sampled_path_finds_every_nonfinite_value(numel, bad):
    """Top-k checks NaN/Inf among its candidates (every NaN/Inf is one), not in a pass of its own:
    a bad value anywhere, also in the strided sample or beside the largest values, raises."""
    from gradpress.compressors.sparsify import topk_indices
    from gradpress.core.compressor import NonFiniteError

    g = torch.Generator().manual_seed(3)
    x = torch.randn(numel, generator=g)
    stride = max(1, numel // 65536)
    for position in (0, stride * 7, int(x.abs().argmax()), numel - 1, 12345):
        y = x.clone()
        y[position] = bad
        with pytest.raises(NonFiniteError, match="holds 1 NaN/Inf value"):
            gradpress.make("topk:ratio=0.01").compress(y)
        with pytest.raises(NonFiniteError):
            topk_indices(y, numel // 100)
    y = x.clone()
    y[::stride] = float("nan")  # every sampled value: the estimated threshold itself is NaN
    with pytest.raises(NonFiniteError):
        topk_indices(y, numel // 100)
    assert torch.equal(topk_indices(x, 1000), torch.topk(x.abs(), 1000).indices.sort().values)


def test_randomk_receivers_regenerate_the_senders_indices():
    """random-k's packet keeps the indices it drew; a receiver that has only the seed draws the same."""
    from gradpress.core.packet import Packet

    c = gradpress.make("randomk:ratio=0.01,scale=true")
    packet = c.compress(torch.randn(100_000), gradpress.Context(seed=5, step=3, key="w"))
    received = Packet(dict(packet.tensors), packet.shape, packet.dtype, {"seed": packet.meta["seed"]})
    assert torch.equal(c.decompress(received), c.decompress(packet))
    assert torch.equal(c.sparse(received)[0], packet.meta["indices"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_any_nonfinite_agrees_with_torch_on_both_paths(dtype, bad):
    """any_nonfinite (the pre-exchange check of methods that do not find NaN/Inf in their own passes):
    the numba max-exponent kernel and the torch fallback, at every position class of a 16-lane loop."""
    from gradpress.core.compressor import any_nonfinite

    for numel, at in [(1, 0), (17, 16), (1000, 0), (1000, 999), (4099, 2050)]:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
        x[-1] = torch.finfo(dtype).max  # the largest finite value is not flagged
        if bad is not None:
            x[at] = bad
        with numba_disabled():
            reference = any_nonfinite(x)
        assert reference == (bad is not None) and any_nonfinite(x) == reference, (numel, at)
