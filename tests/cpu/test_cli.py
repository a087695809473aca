"""The CLI as users run it: real subprocess for generate, in-process main() for the rest."""
import json
import subprocess
import sys

from raydecode.cli import main


def test_model_info_k3_matches_published_scale(capsys):
    assert main(["model-info", "k3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert abs(d["total_params"] / 2.8e12 - 1) <= 0.02
    assert abs(d["active_params_excl_embedding"] / 104e9 - 1) <= 0.05
    assert (d["mla_layers"], d["kda_layers"], d["dense_ffn_layers"]) == (24, 69, 1)
    # 24 MLA layers × 576-wide bf16 rows; 69 KDA layers × (96·128·128·4 B + 3·12288·3·2 B)
    assert d["kv_bytes_per_token"] == 24 * 576 * 2
    assert d["kda_state_bytes_per_seq"] == 69 * (96 * 128 * 128 * 4 + 3 * 12288 * 3 * 2)


def test_model_info_tiny_table(capsys):
    assert main(["model-info", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "KDA" in out and "MLA" in out and "latent MoE" in out


def test_generate_prints_text_and_rate():
    r = subprocess.run([sys.executable, "-m", "raydecode.cli", "generate", "--model", "tiny",
                        "--prompt", "Hello there", "--max-tokens", "8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr and "8 tokens" in r.stderr
    assert r.stdout.strip()


def test_unknown_model_is_a_clear_error():
    r = subprocess.run([sys.executable, "-m", "raydecode.cli", "model-info", "no-such-model"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a preset" in r.stderr
    assert "Traceback" not in r.stderr
