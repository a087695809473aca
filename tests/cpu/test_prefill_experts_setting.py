"""RAYDECODE_PREFILL_EXPERTS: the setting's values and refusal, and the load-time conversion
of the experts to matmul_ogs's Hopper layouts (engine/loader.py `prepare_prefill_experts`):
when it runs, what it converts, and its refusals (library missing, not enough free memory).
The conversion itself is the GPU's (tests/gpu/test_moe_ogs.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from raydecode.engine import loader
from raydecode.kernels import moe_ogs
from raydecode.kernels import settings as S
from raydecode.models.moe import RoutedExperts
from raydecode.models.parallel import Parallel


def test_setting_defaults_to_auto_and_names_what_it_accepts(monkeypatch):
    monkeypatch.delenv("RAYDECODE_PREFILL_EXPERTS", raising=False)
    assert S.prefill_experts() == "auto"
    monkeypatch.setenv("RAYDECODE_PREFILL_EXPERTS", "ogs-hopper")
    assert S.prefill_experts() == "ogs-hopper"
    monkeypatch.setenv("RAYDECODE_PREFILL_EXPERTS", "fast")
    with pytest.raises(ValueError, match="RAYDECODE_PREFILL_EXPERTS='fast'; accepted: auto, "
                                         "split, blocked, hybrid, ogs, ogs-hopper"):
        S.prefill_experts()


def test_the_kernels_read_the_setting_at_import():
    env = dict(os.environ, RAYDECODE_PREFILL_EXPERTS="blocked")
    out = subprocess.run([sys.executable, "-c", "from raydecode.kernels import moe_mxfp4 as M;"
                          "print(M.PREFILL_EXPERTS, M.prefill_config(3584, 192).blocked)"],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["blocked", "True"]


def _model(layers=3, E=4, L=64, I=64):
    return nn.ModuleList(RoutedExperts(E, L, I, 4.0, 25.0, Parallel(), torch.bfloat16,
                                       mxfp4=True) for _ in range(layers))


def test_only_ogs_hopper_on_cuda_converts(monkeypatch):
    seen = []
    monkeypatch.setattr(moe_ogs, "ogs_weights", lambda ex, layout: seen.append(layout))
    m = _model()
    assert loader.prepare_prefill_experts(m, "cpu", "ogs-hopper") == 0
    for kind in ("auto", "split", "blocked", "hybrid", "ogs"):
        assert loader.prepare_prefill_experts(m, "cuda", kind) == 0
    assert seen == []


def test_ogs_hopper_converts_every_layer_once_when_it_fits(monkeypatch):
    seen = []
    monkeypatch.setattr(moe_ogs, "ogs_unavailable", lambda dev=None: None)
    monkeypatch.setattr(moe_ogs, "ogs_weights",
                        lambda ex, layout: seen.append((ex.w13.data_ptr(), layout)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (80 * 2 ** 30, 80 * 2 ** 30))
    m = _model(layers=3)
    need = loader.prepare_prefill_experts(m, "cuda", "ogs-hopper")
    per = m[0].packed().expert_bytes() * 4
    assert need == 3 * per
    assert [lay for _, lay in seen] == ["hopper"] * 3 and len({p for p, _ in seen}) == 3


def test_ogs_hopper_refuses_without_the_library_or_the_memory(monkeypatch):
    m = _model(layers=2)
    monkeypatch.setattr(moe_ogs, "ogs_unavailable", lambda dev=None: "no triton_kernels")
    with pytest.raises(RuntimeError, match="RAYDECODE_PREFILL_EXPERTS=ogs-hopper: no "
                                           "triton_kernels; install the `ogs` extra"):
        loader.prepare_prefill_experts(m, "cuda", "ogs-hopper")
    monkeypatch.setattr(moe_ogs, "ogs_unavailable", lambda dev=None: None)
    monkeypatch.setattr(moe_ogs, "ogs_weights", lambda ex, layout: pytest.fail("converted"))
    free = loader.PREFILL_COPY_HEADROOM             # the copies would eat into the headroom
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (free, 80 * 2 ** 30))
    with pytest.raises(RuntimeError, match=r"Hopper copies of 2 MoE layers' experts take ≈ "
                                           r"0\.0 GiB, 4\.0 GiB are free"):
        loader.prepare_prefill_experts(m, "cuda", "ogs-hopper")


def test_a_kind_takes_moeconfig_fields_for_a_same_run_ab(monkeypatch):
    """KIND+FIELD=VALUE... (settings.py `parse_prefill_experts`): the fields are set on the
    configs KIND picks; blocked-only options leave auto's split form (below 128 pairs per
    expert) as it is; a misspelt field, a bad value, a field set twice or fields on an ogs
    kind are refused naming the part; the setting refuses them too."""
    from raydecode.kernels import moe_mxfp4 as M
    assert S.parse_prefill_experts("auto+fuse_situ=1+down_bn=128") == \
        ("auto", (("fuse_situ", True), ("down_bn", 128)))
    assert set(S.PREFILL_EXPERT_FIELDS) <= {f.name for f in M.dataclasses.fields(M.MoEConfig)}
    for raw, msg in (("auto+fuse=1", r"'fuse=1'; expected FIELD=VALUE with FIELD one of "),
                     ("auto+down_bn=0", r"down_bn='0'; expected an integer ≥ 1"),
                     ("auto+fuse_situ=yes", r"fuse_situ='yes'; expected 0 or 1"),
                     ("auto+down_bn=64+down_bn=128", "a field set twice"),
                     ("ogs-hopper+down_bn=64", "takes no \\+FIELD=VALUE"),
                     ("auto+", r"''; expected FIELD=VALUE")):
        with pytest.raises(ValueError, match=msg):
            S.parse_prefill_experts(raw)
    monkeypatch.setenv("RAYDECODE_PREFILL_EXPERTS", "auto+down_bk=abc")
    with pytest.raises(ValueError, match=r"RAYDECODE_PREFILL_EXPERTS='auto\+down_bk=abc': "
                                         r"down_bk='abc'; expected an integer"):
        S.prefill_experts()
    E, L, I = 896, 3584, 192
    big, small = (M.AUTO_BLOCKED_LOAD + 1) * E, M.AUTO_BLOCKED_LOAD * E
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "auto")
    auto_big, auto_small = M.prefill_config(L, I, big, E), M.prefill_config(L, I, small, E)
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "auto+fuse_situ=1+down_bn=128")
    assert M.prefill_config(L, I, big, E) == M.dataclasses.replace(auto_big, fuse_situ=True,
                                                                   down_bn=128)
    assert M.prefill_config(L, I, small, E) == M.dataclasses.replace(auto_small, down_bn=128)
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "auto-nopf+num_warps=8")
    assert M.prefill_config(L, I, big, E) == M.dataclasses.replace(
        auto_big, prefetch_scales=False, num_warps=8)


def test_the_load_checks_the_fields_against_the_experts_shapes(monkeypatch):
    """A +FIELD=VALUE that cannot run on the model's experts (a tile that is not a power of
    two, a K step that does not divide I) fails the rank's load check (engine/loader.py
    `check_prefill_experts`, before the warm-up), naming the setting and the field; a good
    one passes."""
    from raydecode.kernels import moe_mxfp4 as M
    m = _model(E=4, L=64, I=64)
    for bad, msg in (("auto+down_bn=48", r"MoEConfig.down_bn 48: expected a power of two"),
                     ("hybrid+down_bk=128", r"BK must be a multiple of 32 dividing"),
                     ("blocked+gate_up_bn=16+fuse_situ=1", r"fuse_situ: gate_up_bn 16"),
                     ("auto+down_warps=3", r"down_warps 3: expected 1, 2, 4, 8 or 16")):
        monkeypatch.setattr(M, "PREFILL_EXPERTS", bad)
        with pytest.raises(ValueError, match=r"RAYDECODE_PREFILL_EXPERTS=.*L=64, I=64.*" + msg):
            loader.check_prefill_experts(m)
    monkeypatch.setattr(M, "PREFILL_EXPERTS", "auto+fuse_situ=1+down_bn=128")
    loader.check_prefill_experts(m)
