"""The settings surface (kernels/settings.py): environment settings typed and read in one
module, the decode options validated at construction and from benchmark flags."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from raydecode.kernels import settings as S
from raydecode.kernels.settings import DEFAULT_OPTIONS, DecodeOptions, parse_option_pairs

ROOT = Path(__file__).resolve().parents[2]
CODE = ("actors", "cluster", "engine", "kernels", "models", "raydecode", "scripts")


def _environ_readers() -> dict[str, list[int]]:
    """Source files outside tests that read a RAYDECODE_* variable from os.environ (get,
    getenv, pop, setdefault, or a subscript load), the key a literal or a module constant
    bound to one: {path: [line, ...]}. kernels/settings.py reads through a variable."""
    found: dict[str, list[int]] = {}
    for folder in CODE:
        for path in (ROOT / folder).rglob("*.py"):
            src = path.read_text()
            if "RAYDECODE_" not in src:
                continue
            tree = ast.parse(src)
            consts = {t.id for n in tree.body if isinstance(n, ast.Assign)
                      and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                      and n.value.value.startswith("RAYDECODE_")
                      for t in n.targets if isinstance(t, ast.Name)}

            def names_raydecode(key) -> bool:
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    return key.value.startswith("RAYDECODE_")
                return isinstance(key, ast.Name) and key.id in consts

            for node in ast.walk(tree):
                key = None
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.args and "environ" in ast.unparse(node.func)
                        or isinstance(node, ast.Call) and ast.unparse(node.func) == "os.getenv"
                        and node.args):
                    key = node.args[0]
                elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                      and ast.unparse(node.value) == "os.environ"):
                    key = node.slice
                if key is not None and (names_raydecode(key)
                                        or path.name == "settings.py"):
                    found.setdefault(str(path.relative_to(ROOT)), []).append(node.lineno)
    return found


def test_only_the_settings_module_reads_raydecode_environment_variables():
    readers = _environ_readers()
    assert set(readers) == {"kernels/settings.py"}, readers


def test_every_setting_has_a_default_that_parses_and_a_meaning(monkeypatch):
    for name, s in S.SETTINGS.items():
        assert name.startswith("RAYDECODE_") and s.meaning and s.accepted
        monkeypatch.delenv(name, raising=False)
        S.get(name)                                     # the default parses
    assert len(S.describe_settings()) == len(S.SETTINGS)
    with pytest.raises(KeyError, match="not a raydecode setting"):
        S.get("RAYDECODE_NOPE")


@pytest.mark.parametrize("field", ["moe_fused", "ffn_out_fused", "mla_absorbed_q"])
def test_decode_switch_is_validated(field, monkeypatch):
    """The served on/off switches: booleans on the options (default on), 0/1 from a bench
    flag, anything else refused by name; their retired environment variable is refused."""
    with pytest.raises(ValueError, match=f"{field} = 'yes': expected true or false"):
        DecodeOptions(**{field: "yes"})
    assert getattr(DEFAULT_OPTIONS, field) is True
    assert getattr(parse_option_pairs([f"{field}=0"]), field) is False
    assert getattr(parse_option_pairs([f"{field}=true"]), field) is True
    with pytest.raises(ValueError, match=f"--decode '{field}=yes'"):
        parse_option_pairs([f"{field}=yes"])
    env = next(k for k, v in S.RETIRED.items() if v == field)
    monkeypatch.setenv(env, "0")
    with pytest.raises(ValueError, match=f"{env}='0' \\(now decode option '{field}'\\)"):
        S.check_no_retired()
    monkeypatch.delenv(env)
    S.check_no_retired()


def test_env_choice_is_validated(monkeypatch):
    name, choices = "RAYDECODE_L2PF_KIND", ("bulk", "lines")
    monkeypatch.delenv(name, raising=False)
    assert S.get(name) == choices[0]
    monkeypatch.setenv(name, choices[-1])
    assert S.get(name) == choices[-1]
    monkeypatch.setenv(name, "fast")
    with pytest.raises(ValueError, match=f"{name}='fast'; accepted: {', '.join(choices)}"):
        S.get(name)
    with pytest.raises(ValueError, match="moe_kernel = 'fast': accepted auto, cuda_core, "
                                         "resident"):
        DecodeOptions(moe_kernel="fast")


def test_settings_parse_as_they_always_read(monkeypatch):
    """Flags are off only at '0'; rank threads are at least 1; the step-graph tristate."""
    for v, want in (("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("RAYDECODE_ONESHOT_ALLREDUCE", v)
        assert S.oneshot_allreduce() is want
    monkeypatch.setenv("RAYDECODE_RANK_THREADS", "0")
    assert S.rank_threads() == 1
    monkeypatch.setenv("RAYDECODE_RANK_THREADS", "x")
    with pytest.raises(ValueError, match="RAYDECODE_RANK_THREADS='x'; accepted: an integer"):
        S.rank_threads()
    monkeypatch.setenv("RAYDECODE_L2PF_CHUNK", "24")
    with pytest.raises(ValueError, match="RAYDECODE_L2PF_CHUNK='24'; accepted: a positive "
                                         "multiple of 16"):
        S.get("RAYDECODE_L2PF_CHUNK")
    monkeypatch.delenv("RAYDECODE_CACHE", raising=False)
    assert S.model_cache_dir() == Path.home() / ".cache" / "raydecode"


def test_option_pairs_cover_every_scalar_field_and_refuse_unknown_ones():
    got = parse_option_pairs(["skinny_max_m=0", "kda_splits=4", "moe_kernel=resident",
                              "router_gather=false"])
    assert (got.skinny_max_m, got.kda_splits, got.moe_kernel, got.router_gather) == \
        (0, 4, "resident", False)
    assert parse_option_pairs(["kda_splits=none"], got).kda_splits is None
    with pytest.raises(ValueError, match="FIELD one of moe_fused"):
        parse_option_pairs(["nope=1"])
    with pytest.raises(ValueError, match="skinny_max_m = -1: expected an integer ≥ 0"):
        parse_option_pairs(["skinny_max_m=-1"])
    with pytest.raises(ValueError, match="FIELD one of"):
        parse_option_pairs(["gemv_configs=1"])          # tables come from their own flags
    scalar = {f.name for f in dataclasses.fields(DecodeOptions)} - {"gemv_configs",
                                                                    "moe_decode_configs"}
    assert scalar <= set(S.OPTION_DOCS)
    assert DEFAULT_OPTIONS.as_dict()["gemv_configs"] == []


def test_deployment_config_carries_the_decode_options():
    """The deployment config's `decode` section: every served option a field with its
    default and a description, unknown keys and bad values refused at the edge by name."""
    from raydecode.actors.config import DecodeOptionsConfig, DeployConfigError, parse_deploy_config

    cfg = parse_deploy_config({"model": "tiny", "decode": {"moe_fused": False,
                                                           "kda_splits": 4}})
    assert cfg.decode_options() == DEFAULT_OPTIONS.replace(moe_fused=False, kda_splits=4)
    assert parse_deploy_config({"model": "tiny"}).decode_options() == DEFAULT_OPTIONS
    for name, field in DecodeOptionsConfig.model_fields.items():
        assert field.description, name
        if hasattr(DEFAULT_OPTIONS, name):
            assert field.default == getattr(DEFAULT_OPTIONS, name), name
    scalar = {f.name for f in dataclasses.fields(DecodeOptions)} - {"gemv_configs",
                                                                    "moe_decode_configs",
                                                                    "gemv_l2_prefetch_mib"}
    assert scalar <= set(DecodeOptionsConfig.model_fields)
    with pytest.raises(DeployConfigError, match="decode.nope: unknown key"):
        parse_deploy_config({"model": "tiny", "decode": {"nope": 1}})
    with pytest.raises(DeployConfigError, match="skinny_max_m = -1: expected an integer ≥ 0"):
        parse_deploy_config({"model": "tiny", "decode": {"skinny_max_m": -1}})


def test_no_served_module_imports_an_experiment():
    """kernels/experimental and scripts/explore are imported by nothing served (the CLI,
    actors, engine, models, kernels, cluster), at module level or inside a function."""
    bad = []
    for folder in ("raydecode", "actors", "engine", "models", "kernels", "cluster"):
        for path in (ROOT / folder).rglob("*.py"):
            if "experimental" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [f"{node.module}.{a.name}" for a in node.names]
                         if isinstance(node, ast.ImportFrom) and node.module else [])
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                        if "kernels.experimental" in n or "scripts.explore" in n]
    assert not bad, bad
