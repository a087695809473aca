"""scripts/offline_wheels.py without a network: every staged wheel pinned to one version, and
the triton_kernels build refusing a folder that is not the library's source."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from raydecode.scripts import offline_wheels as W


def test_every_set_pins_exact_versions():
    for name, pkgs in W.SETS.items():
        for p in pkgs:
            assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][A-Za-z0-9_.+\-]*", p), (name, p)


def test_triton_kernels_ref_is_the_ogs_extras_pin():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert re.fullmatch(r"[0-9a-f]{40}", W.TRITON_KERNELS_REF)
    assert f"triton.git@{W.TRITON_KERNELS_REF}#subdirectory=python/triton_kernels" in text


def test_build_refuses_a_folder_that_is_not_triton_kernels(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    with pytest.raises(SystemExit, match=f"{tmp_path}: not python/triton_kernels .*"
                                         f"{W.TRITON_KERNELS_REF}"):
        W.build_triton_kernels(str(tmp_path), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
