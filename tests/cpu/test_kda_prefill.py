"""KDA varlen prefill (kernels/kda_prefill.py) on CPU: the reference dispatch against a
per-sequence `kda_recurrent` (fp64 and fp32), input validation, and the layer's step with
several prefill sequences against each sequence run alone, both on the CPU path and on the
varlen path (fla's call replaced by a stand-in that checks the calling contract: fla itself
runs on CUDA only, tests/gpu/test_kda_prefill_gpu.py)."""
import pytest
import torch

from raydecode.kernels import kda_prefill as KP
from raydecode.models.cache import SeqSlice, StepBatch
from raydecode.models.config import load_config
from raydecode.models.k3 import K3ForCausalLM, init_random_, make_caches
from raydecode.models.kda import kda_recurrent, l2_normalize
from raydecode.models.parallel import Parallel

from _numerics import fresh_seed, max_rel_err

torch.set_num_threads(1)


def _inputs(lens, h, dk, dv, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    rn = lambda *s: torch.randn(*s, generator=gen)               # noqa: E731
    return dict(q=l2_normalize(rn(T, h, dk)), k=l2_normalize(rn(T, h, dk)), v=rn(T, h, dv),
                g=-5.0 * torch.sigmoid(3.0 * rn(T, h, dk)), beta=torch.sigmoid(rn(T, h)),
                scale=dk ** -0.5, states=0.3 * rn(len(lens), h, dk, dv),
                cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]))


def _per_sequence(x, dtype):
    """Each sequence alone through kda_recurrent in `dtype`: (o (T, h, dv), finals)."""
    cu = x["cu_seqlens"].tolist()
    os_, Ss = [], []
    for n in range(len(cu) - 1):
        sl = slice(cu[n], cu[n + 1])
        o, S = kda_recurrent(*(x[k][sl].to(dtype) for k in ("q", "k", "v", "g", "beta")),
                             x["scale"], x["states"][n].to(dtype))
        os_.append(o)
        Ss.append(S)
    return torch.cat(os_), torch.stack(Ss)


# fp32: the chunked form's rounding (the intra-chunk solve) against the fp64 recurrence
# reached 1.3e-5 over 300 seeds (2 above 1e-5: a 1e-5 bound failed ~1 CI run in 150); a
# transposed state or a lost hand-over between chunks is O(1)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 5e-5)])
def test_reference_dispatch_matches_per_sequence_recurrence(dtype, tol):
    seed = fresh_seed()
    lens = [1, 5, 63, 64, 65, 130]                  # around the 64-token chunk
    x = _inputs(lens, 3, 16, 24, seed)              # dk != dv catches transposes
    x.update({k: x[k].to(dtype) for k in ("q", "k", "v", "g", "beta")})
    if dtype == torch.float64:
        x["states"] = x["states"].double()
    states0 = x["states"].clone()
    assert not KP.available(x["q"])                 # CPU tensors: the reference serves them
    o, S = KP.kda_prefill(**x)
    o_ref, S_ref = _per_sequence(x, torch.float64)
    assert o.dtype == dtype and S.dtype == dtype and S.shape == (len(lens), 3, 16, 24)
    assert max_rel_err(o, o_ref) < tol, f"seed {seed}"
    assert max_rel_err(S, S_ref) < tol, f"seed {seed}"
    assert torch.equal(x["states"], states0)        # initial states are inputs, not updated


def _bad(**change):
    x = _inputs([3, 4], 2, 8, 8, 0)
    x.update(change)
    return x


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.randn(7, 16)), "q of shape"),
    (dict(v=torch.randn(7, 3, 8)), "v of shape"),
    (dict(k=torch.randn(7, 2, 4)), "k of shape"),
    (dict(g=torch.randn(6, 2, 8)), "g of shape"),
    (dict(beta=torch.randn(7, 2, 1)), "beta of shape"),
    (dict(states=torch.randn(3, 2, 8, 8)), "states of shape"),
    (dict(states=torch.randn(2, 2, 8, 8).half()), "states dtype"),
    (dict(v=torch.ones(7, 2, 8, dtype=torch.int32)), "v dtype"),
    (dict(scale=0.0), "scale"),
    (dict(scale=True), "scale"),
    (dict(cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32)), "int64 CPU"),
    (dict(cu_seqlens=[0, 3, 7]), "list"),
    (dict(cu_seqlens=torch.tensor([0, 3, 6]), states=torch.randn(2, 2, 8, 8)), "c_N = T"),
    (dict(cu_seqlens=torch.tensor([0, 3, 3, 7]), states=torch.randn(3, 2, 8, 8)),
     "at least one token"),
    (dict(cu_seqlens=torch.tensor([1, 3, 7])), "0 = c_0"),
])
def test_validation_names_the_offending_input(change, match):
    with pytest.raises(ValueError, match=match):
        KP.kda_prefill(**_bad(**change))


def test_warmup_is_a_no_op_where_fla_cannot_run():
    assert KP.warmup(6, 128, "cpu") == 0
    with pytest.raises(ValueError, match="T ≥ 2"):
        KP.warmup(6, 128, "cpu", tokens=(64, 1))


# ---- the dot precision (RAYDECODE_KDA_PRECISION): what apply_precision sets, and when --------

@pytest.fixture
def fake_triton_fla(monkeypatch):
    """Stand-ins for the two things apply_precision writes (Triton's fp32 dot knob and fla's
    solve constant: neither package is installed on the CPU path), a fresh process state."""
    import sys
    import types
    knobs = types.SimpleNamespace(language=types.SimpleNamespace(fp32_default=None))
    tl = types.ModuleType("triton.language")
    tl.constexpr = lambda v: ("constexpr", v)
    triton = types.ModuleType("triton")
    triton.knobs, triton.language = knobs, tl
    intra = types.ModuleType("fla.ops.kda.chunk_intra")
    intra.SOLVE_TRIL_DOT_PRECISION = ("constexpr", "tf32")
    kda = types.ModuleType("fla.ops.kda")
    kda.chunk_intra = intra
    for name, mod in {"triton": triton, "triton.language": tl, "fla": types.ModuleType("fla"),
                      "fla.ops": types.ModuleType("fla.ops"), "fla.ops.kda": kda,
                      "fla.ops.kda.chunk_intra": intra}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(KP, "_applied", [])
    return knobs, intra


@pytest.mark.parametrize("precision", ["bf16x3", "tf32x3", "ieee"])
def test_apply_precision_sets_the_dot_default_and_the_solve(fake_triton_fla, precision):
    knobs, intra = fake_triton_fla
    assert KP.precision() is None
    assert KP.apply_precision(precision) == precision
    assert knobs.language.fp32_default == precision
    assert intra.SOLVE_TRIL_DOT_PRECISION == ("constexpr", precision)
    assert KP.precision() == precision
    assert KP.apply_precision(precision) == precision          # the same again: a no-op
    with pytest.raises(RuntimeError, match=f"'tf32' asked after '{precision}'"):
        KP.apply_precision("tf32")


def test_tf32_leaves_triton_and_fla_as_they_are(fake_triton_fla):
    knobs, intra = fake_triton_fla
    assert KP.apply_precision("tf32") == "tf32"
    assert knobs.language.fp32_default is None
    assert intra.SOLVE_TRIL_DOT_PRECISION == ("constexpr", "tf32")
    with pytest.raises(RuntimeError, match="one precision per process"):
        KP.apply_precision("ieee")


def test_an_unknown_precision_is_refused_by_name(fake_triton_fla, monkeypatch):
    with pytest.raises(ValueError, match="'fp16'; accepted: tf32, bf16x3, tf32x3, ieee"):
        KP.apply_precision("fp16")
    assert KP.precision() is None
    from raydecode.kernels import settings
    monkeypatch.setenv("RAYDECODE_KDA_PRECISION", "tf32x1")
    with pytest.raises(ValueError, match="RAYDECODE_KDA_PRECISION='tf32x1'; accepted"):
        settings.kda_precision()


# ---- the state recurrence's BV candidates (widen_recurrence) -----------------------------

class _Config:
    """triton.Config's fields widen_recurrence reads and writes."""

    def __init__(self, kwargs, num_warps=4, num_stages=2):
        self.kwargs, self.num_warps, self.num_stages = dict(kwargs), num_warps, num_stages

    def key(self):
        return (self.kwargs["BV"], self.num_warps, self.num_stages)


def test_widen_recurrence_adds_bv16_beside_each_bv32_config_once(monkeypatch):
    import sys
    import types
    triton = types.ModuleType("triton")
    triton.Config = _Config
    monkeypatch.setitem(sys.modules, "triton", triton)
    fla = [_Config({"BV": bv}, w, st) for w in (2, 4) for st in (2, 3) for bv in (32, 64)]
    tuner = types.SimpleNamespace(configs=list(fla), cache={})
    assert KP.widen_recurrence(tuner) == 4
    keys = [c.key() for c in tuner.configs]
    assert keys[:8] == [c.key() for c in fla]                 # fla's own, first, unchanged
    assert sorted(keys[8:]) == [(16, w, st) for w in (2, 4) for st in (2, 3)]
    assert KP.widen_recurrence(tuner) == 0 and len(tuner.configs) == 12    # idempotent
    only64 = types.SimpleNamespace(configs=[_Config({"BV": 64})], cache={})
    assert KP.widen_recurrence(only64) == 0                     # nothing at 32: nothing added


@pytest.mark.parametrize("env, widened", [(None, True), ("1", True), ("0", False)])
def test_first_use_widens_the_recurrence_unless_switched_off(fake_triton_fla, monkeypatch,
                                                              env, widened):
    """fla's first use (`_chunk_kda`) widens the recurrence's candidates, after the precision
    is applied; RAYDECODE_KDA_RECURRENCE_BV16=0 leaves fla's list as it is."""
    import sys
    import types
    sys.modules["triton"].Config = _Config
    tuner = types.SimpleNamespace(configs=[_Config({"BV": 32}), _Config({"BV": 64})], cache={})
    common = types.ModuleType("fla.ops.common.chunk_delta_h")
    common.chunk_gated_delta_rule_fwd_kernel_h_blockdim64 = types.SimpleNamespace(fn=tuner)
    sys.modules["fla.ops.kda"].chunk_kda = object()
    monkeypatch.setitem(sys.modules, "fla.ops.common", types.ModuleType("fla.ops.common"))
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_delta_h", common)
    monkeypatch.delenv("RAYDECODE_KDA_PRECISION", raising=False)
    if env is None:
        monkeypatch.delenv("RAYDECODE_KDA_RECURRENCE_BV16", raising=False)
    else:
        monkeypatch.setenv("RAYDECODE_KDA_RECURRENCE_BV16", env)
    KP._chunk_kda.cache_clear()
    try:
        assert KP._chunk_kda() is sys.modules["fla.ops.kda"].chunk_kda
    finally:
        KP._chunk_kda.cache_clear()
    assert KP.precision() == "bf16x3"
    assert [c.key() for c in tuner.configs] == [(32, 4, 2), (64, 4, 2)] + \
        ([(16, 4, 2)] if widened else [])


# ---- the layer: several prefill sequences in one step == each alone -------------------------

def _layer():
    cfg = load_config("tiny")
    model = init_random_(K3ForCausalLM(cfg), 0)
    return cfg, model.model.layers[1].self_attn                     # layer 1: KDA


def _fake_fla(calls):
    """Stand-in for fla's chunk_kda on CPU: checks the calling contract kda_prefill keeps
    (packed [1, T, H, K], fp32, initial states (N, H, K, V) fp32, cu_seqlens with its host
    copy, no in-kernel norm / gate / sigmoid) and computes each sequence by the recurrence."""
    def chunk_kda(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens,
                  cu_seqlens_cpu, **flags):
        assert not any(flags.values()) and output_final_state
        assert q.shape[0] == 1 and q.dtype == k.dtype == v.dtype == torch.float32
        assert initial_state.dtype == torch.float32
        assert initial_state.shape == (len(cu_seqlens_cpu) - 1, q.shape[2], q.shape[3],
                                       v.shape[3])
        assert torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
        calls.append(cu_seqlens_cpu.tolist())
        cu = cu_seqlens_cpu.tolist()
        o, finals = torch.empty_like(v), []
        for n in range(len(cu) - 1):
            sl = slice(cu[n], cu[n + 1])
            o[0, sl], S = kda_recurrent(q[0, sl], k[0, sl], v[0, sl], g[0, sl], beta[0, sl],
                                        scale, initial_state[n])
            finals.append(S)
        return o, torch.stack(finals)
    return chunk_kda


def _fake_fla_forward(calls):
    """Stand-in for fla's chunk_kda_fwd (the forward kda_prefill calls with its own chunk
    index): the public stand-in's contract, plus the chunk index and offsets of cu_seqlens
    (the layout test_varlen_index_is_fla_layout_built_on_the_host pins)."""
    public = _fake_fla(calls)

    def chunk_kda_fwd(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                      cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_size, chunk_offsets):
        cu = cu_seqlens_cpu.tolist()
        chunks = [-(-(b - a) // chunk_size) for a, b in zip(cu, cu[1:])]
        assert chunk_indices.tolist() == [[n, i] for n, c in enumerate(chunks)
                                          for i in range(c)]
        assert chunk_offsets.tolist() == [sum(chunks[:n]) for n in range(len(chunks) + 1)]
        for t in (q, k, v, g, beta):
            assert t.is_contiguous()
        o, final = public(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                          cu_seqlens_cpu=cu_seqlens_cpu)
        return (o, final) + (None,) * 10          # the forward's 12 outputs
    return chunk_kda_fwd


def _step_vs_alone(monkeypatch, varlen: bool, observer: bool = False, entry: str = "forward"):
    """One step holding prefills at pos 0 (on slots with stale state), a continued prefill
    at pos > 0 and decode tokens, against each sequence alone on the CPU path (the history
    too); `varlen`: the step through the varlen path. -> the calls the step made to fla."""
    cfg, attn = _layer()
    gen = torch.Generator().manual_seed(fresh_seed())
    H = cfg.hidden_size
    caches = make_caches(cfg, Parallel(), 6, 1, 4)
    caches.kda.rec.normal_(generator=gen)                  # stale contents every pos 0 ignores
    caches.kda.conv.normal_(generator=gen)
    # history: slot 3 holds a 5-token prefill, slot 4 a 9-token one (run alone, cached)
    for slot, n in ((3, 5), (4, 9)):
        attn(torch.randn(n, H, generator=gen), StepBatch([SeqSlice(slot, 0, n, 0)]), caches)
    seqs = [(0, 7, 0), (3, 66, 5), (2, 1, 0), (4, 1, 9), (1, 65, 0)]   # (slot, length, pos)
    xs = [torch.randn(n, H, generator=gen) for _, n, _ in seqs]
    alone = make_caches(cfg, Parallel(), 6, 1, 4)
    alone.kda.rec.copy_(caches.kda.rec)
    alone.kda.conv.copy_(caches.kda.conv)
    ref = torch.cat([attn(x, StepBatch([SeqSlice(s, 0, n, p)]), alone)
                     for x, (s, n, p) in zip(xs, seqs)])
    batch, at = [], 0
    for s, n, p in seqs:
        batch.append(SeqSlice(s, at, n, p))
        at += n
    calls, seen = [], []
    if varlen:
        monkeypatch.setattr(KP, "available", lambda *ts: True)
        monkeypatch.setattr(KP, "_chunk_kda", lambda: _fake_fla(calls))
        monkeypatch.setattr(KP, "_chunk_kda_fwd", lambda: _fake_fla_forward(calls)
                            if entry == "forward" else None)
    if observer:
        caches.kda_observer = lambda row, s, *_: seen.append(s.slot)
    out = attn(torch.cat(xs), StepBatch(batch), caches)
    assert max_rel_err(out, ref) < 1e-5
    row = caches.kda_index[1]
    for s, _, _ in seqs:
        assert max_rel_err(caches.kda.rec[row, s], alone.kda.rec[row, s]) < 1e-5
        # (the projections of a batch and of one sequence may round differently: not bitwise)
        assert max_rel_err(caches.kda.conv[row, s], alone.kda.conv[row, s]) < 1e-5
    assert torch.equal(caches.kda.rec[row, 5], alone.kda.rec[row, 5])  # untouched slot
    if observer:
        assert seen == [s for s, _, _ in seqs]
    return calls


def test_step_of_several_prefills_equals_each_alone_on_the_cpu_path(monkeypatch):
    assert _step_vs_alone(monkeypatch, varlen=False) == []


@pytest.mark.parametrize("entry", ["forward", "public"])
def test_varlen_path_packs_the_multi_token_sequences_into_one_call(monkeypatch, entry):
    # the step's three multi-token sequences (7, 66, 65) as one call; its decode-length
    # ones by the recurrence. forward: fla's chunk_kda_fwd with the host-built chunk index;
    # public: chunk_kda, where a later fla moved the forward
    assert _step_vs_alone(monkeypatch, varlen=True, entry=entry) == [[0, 7, 73, 138]]


def test_varlen_path_keeps_the_per_sequence_loop_under_an_observer(monkeypatch):
    assert _step_vs_alone(monkeypatch, varlen=True, observer=True) == []


@pytest.mark.parametrize("bounds", [(0, 1), (0, 64), (0, 65, 66, 300), (0, 17, 81, 145, 146)])
def test_varlen_index_is_fla_layout_built_on_the_host(bounds):
    """The chunk index handed to fla's forward: one (sequence, chunk) row per 64-token chunk
    of each sequence in order, each sequence's first chunk in the offsets (the layout
    fla.ops.utils.index builds with a device copy), all four tensors int64."""
    host, dev, index, offsets = KP._varlen_index(bounds, torch.device("cpu"))
    assert host.tolist() == dev.tolist() == list(bounds)
    want, first = [], [0]
    for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
        c = (b - a + KP.CHUNK - 1) // KP.CHUNK
        want += [[n, i] for i in range(c)]
        first.append(first[-1] + c)
    assert index.tolist() == want and offsets.tolist() == first
    assert {t.dtype for t in (host, dev, index, offsets)} == {torch.int64}
    assert KP._varlen_index(bounds, torch.device("cpu"))[2] is index     # memoized per bounds
