"""The Hub path: real huggingface_hub code against a local server that speaks the Hub's API."""

from __future__ import annotations

import pytest
from conftest import FAST_EVAL, quantforge_cli, read_json
from hub_server import FakeHub


@pytest.fixture
def hub_env(tmp_path):
    # HF_HUB_CACHE too: GPTQModel's tokenicer sets it in this test process when an earlier test imported it.
    home = tmp_path / "hf-home"
    return {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_DISABLE_XET": "1"}


@pytest.mark.slow
def test_build_from_the_hub_then_offline_from_the_cache(tiny_llama, tmp_path, hub_env):
    with FakeHub({"acme/tiny-llama": tiny_llama}) as hub:
        env = {**hub_env, "HF_ENDPOINT": hub.endpoint}
        result = quantforge_cli(
            "build", "acme/tiny-llama", "--formats", "gguf-q8_0", "--out", str(tmp_path / "run"), *FAST_EVAL, env=env
        )
        assert result.returncode == 0, result.stderr
        assert any(
            r.startswith("GET /acme/tiny-llama/resolve/") and r.endswith("model.safetensors") for r in hub.requests
        )
        commit = hub.commits["acme/tiny-llama"]
    model = read_json(tmp_path / "run" / "card.json")["model"]
    assert model["hub_id"] == "acme/tiny-llama" and model["revision"] == commit
    assert "hf-home" in model["path"]  # the standard HF cache, not a copy of ours
    # The server is gone: the same command works offline from the cache and redoes nothing.
    offline = quantforge_cli(
        "build",
        "acme/tiny-llama",
        "--formats",
        "gguf-q8_0",
        "--out",
        str(tmp_path / "run"),
        *FAST_EVAL,
        env={**hub_env, "HF_HUB_OFFLINE": "1"},
    )
    assert offline.returncode == 0, offline.stderr
    assert "evaluate gguf-q8_0 (done earlier" in offline.stderr


def test_unknown_repo_is_a_clear_error(tiny_llama, tmp_path, hub_env):
    with FakeHub({"acme/tiny-llama": tiny_llama}) as hub:
        result = quantforge_cli(
            "build",
            "acme/missing",
            "--out",
            str(tmp_path / "run"),
            *FAST_EVAL,
            env={**hub_env, "HF_ENDPOINT": hub.endpoint},
        )
    assert result.returncode == 2
    assert "error: no model 'acme/missing' on the Hub" in result.stderr


def test_a_download_that_does_not_match_the_hub_sha256_is_refused(tiny_llama, tmp_path, hub_env):
    with FakeHub({"acme/tiny-llama": tiny_llama}, lfs_sha_override={"model.safetensors": "0" * 64}) as hub:
        result = quantforge_cli(
            "build",
            "acme/tiny-llama",
            "--out",
            str(tmp_path / "run"),
            *FAST_EVAL,
            env={**hub_env, "HF_ENDPOINT": hub.endpoint},
        )
    assert result.returncode == 2
    assert "does not match the sha256 the Hub records" in result.stderr


def test_hub_token_never_lands_in_logs_manifests_or_cards(tiny_llama, tmp_path, hub_env):
    token = "hf_quantforgeSECRETtoken1234567890"
    with FakeHub({"acme/tiny-llama": tiny_llama}) as hub:
        result = quantforge_cli(
            "build",
            "acme/tiny-llama",
            "--formats",
            "gguf-q8_0",
            "--out",
            str(tmp_path / "run"),
            *FAST_EVAL,
            env={**hub_env, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": token},
        )
    assert result.returncode == 0, result.stderr[-2000:]
    assert token not in result.stdout + result.stderr
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path


def test_revision_reaches_the_hub_and_is_refused_for_a_local_folder(tiny_llama, tmp_path, hub_env):
    with FakeHub({"acme/tiny-llama": tiny_llama}) as hub:
        env = {**hub_env, "HF_ENDPOINT": hub.endpoint}
        plan = quantforge_cli(
            "build", "acme/tiny-llama", "--revision", "v1.0", "--formats", "gguf-q8_0", "--plan-only", "--json", env=env
        )
        assert plan.returncode == 0, plan.stderr
        assert "GET /acme/tiny-llama/resolve/v1.0/config.json" in hub.requests
    local = quantforge_cli("build", str(tiny_llama), "--revision", "v1.0", "--plan-only", env=hub_env)
    assert local.returncode == 2
    assert local.stderr.strip().splitlines()[-1].startswith("error: --revision v1.0: a revision applies to Hub models")
