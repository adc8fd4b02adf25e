"""Pushing a finished run to the Hub: the real huggingface_hub client against a local server (tests/hub_server.py)
that speaks repo creation, preupload, the LFS batch and upload endpoints, and commits."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import quantforge_cli, read_json, tree_digest
from hub_server import FakeHub

TOKEN = "hf_quantforge_test_token_0123456789"
SUFFIXES = {"int8": "W8A8", "gptq-int8": "GPTQ-Int8", "gptq-int4": "GPTQ-Int4", "awq": "AWQ"}


@pytest.fixture
def push_env(tmp_path):
    home = tmp_path / "hf-home"
    # Xet off: the local server speaks the classic LFS upload protocol, which the client uses without Xet
    return {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": TOKEN}


def _unchanged(run: Path, before: dict) -> bool:
    """Every file of the run is as it was (a push may add its own files under publish/ and push.json)."""
    after = tree_digest(run)
    return {name: after.get(name) for name in before} == before


def _all_text(folder: Path) -> str:
    return "".join(p.read_bytes().decode(errors="replace") for p in folder.rglob("*") if p.is_file())


def test_push_uploads_every_artifact_with_its_model_card_and_resumes_as_a_no_op(mixed_run, push_env, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(mixed_run, run, ignore=shutil.ignore_patterns("work"))
    with FakeHub({}, token=TOKEN) as hub:
        env = {**push_env, "HF_ENDPOINT": hub.endpoint}
        result = quantforge_cli("push", str(run), "--to", "acme/tiny", "--private", env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        card = read_json(run / "card.json")
        expected = {f"acme/tiny-{suffix}" for suffix in SUFFIXES.values()} | {"acme/tiny-GGUF"}
        assert set(hub.pushed) == expected and all(repo["private"] for repo in hub.created.values())
        shared = {name: (run / name).read_bytes() for name in ("card.json", "card-quality.png")}
        for entry in card["formats"]:
            folder = run / entry["artifact"]
            if entry["family"] == "hf":
                repo_id = f"acme/tiny-{SUFFIXES[entry['key']]}"
                pushed = dict(hub.pushed[repo_id])
                readme = pushed.pop("README.md").decode()
                on_disk = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
                local_readme = on_disk.pop("README.md").decode()
                assert pushed == {**on_disk, **shared}  # byte for byte, with the run's card and plot beside them
                # the model card as the repo shows it: its usage names the repo, not the run's folder
                assert f"vllm serve {repo_id} " in readme and f"./{folder.name}" not in readme
                assert readme == local_readme.replace(f"./{folder.name}", repo_id).replace(
                    "\n## Recommendation",
                    "\n![mean KL divergence against file size, every format of the run]"
                    "(card-quality.png)\n\n## Recommendation",
                )
                assert yaml.safe_load(readme.split("---")[1])["library_name"] == "transformers"
                assert "How each figure was made is in card.json" in readme
            else:
                gguf = next(folder.glob("*.gguf"))
                assert hub.pushed["acme/tiny-GGUF"][gguf.name] == gguf.read_bytes()
                assert f"Modelfile.{entry['scheme']}" in hub.pushed["acme/tiny-GGUF"]
        gguf_repo = hub.pushed["acme/tiny-GGUF"]
        assert {name: gguf_repo[name] for name in shared} == shared
        readme = gguf_repo["README.md"].decode()
        assert "| tiny-llama-Q8_0.gguf | Q8_0 |" in readme and "ollama run hf.co/acme/tiny-GGUF:" in readme
        assert "## Which file" in readme and "| the smallest file | Q4_K_M |" in readme
        download = next(line for line in readme.splitlines() if line.startswith("hf download "))
        assert all(header == f"Bearer {TOKEN}" for header in hub.auth_headers)
        assert TOKEN not in result.stdout + result.stderr and TOKEN not in _all_text(run)
        commits, puts = len(hub.commit_log), len(hub.lfs_puts)

        again = quantforge_cli("push", str(run), "--to", "acme/tiny", "--private", env=env)
        assert again.returncode == 0, again.stderr[-2000:]
        assert again.stdout.count("unchanged") == len(expected)
        assert (len(hub.commit_log), len(hub.lfs_puts)) == (commits, puts)

    # The model card's download line, run as written by huggingface_hub's own `hf` command against the repo as
    # pushed: it fetches the recommended file alone.
    served = tmp_path / "served"
    for name, data in gguf_repo.items():
        (served / name).parent.mkdir(parents=True, exist_ok=True)
        (served / name).write_bytes(data)
    hf = Path(sys.executable).with_name("hf")
    with FakeHub({"acme/tiny-GGUF": served}) as hub:
        fetched = tmp_path / "fetched"
        words = shlex.split(download)
        subprocess.run(
            [str(hf), *words[1:-1], str(fetched)],
            check=True, capture_output=True, env={**os.environ, **push_env, "HF_ENDPOINT": hub.endpoint},
        )  # fmt: skip
    tag = readme.split("llama-server -hf acme/tiny-GGUF:")[1].split()[0]
    ggufs = [name for name in gguf_repo if name.endswith(".gguf")]
    assert [p.name for p in fetched.glob("*.gguf")] == [name for name in ggufs if tag in name] and len(ggufs) > 1


@pytest.mark.parametrize(
    "repo, token, message",
    [
        ("acme/tiny", None, "error: pushing to the Hub needs a token with write access: set HF_TOKEN"),
        ("acme/bad--name", TOKEN, "error: --push-to-hub acme/bad--name: not a valid Hub repo name"),
        ("no-namespace", TOKEN, "error: --push-to-hub no-namespace: not a valid Hub repo name"),
        ("acme/tiny", "hf_wrong", "error: the Hub refused the token for acme/tiny-GGUF (HTTP 401)"),
    ],
)
def test_bad_push_input_is_one_line_and_changes_nothing(tiny_run, push_env, tmp_path, repo, token, message):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("work"))
    before = tree_digest(run)
    with FakeHub({}, token=TOKEN) as hub:
        env = {**push_env, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": token or ""}
        result = quantforge_cli("push", str(run), "--to", repo, env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(message), result.stderr[-1500:]
    assert _unchanged(run, before)
    assert not hub.commit_log


def test_a_push_cut_off_by_the_network_fails_in_one_line_and_resumes(tiny_run, push_env, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("work"))
    before = tree_digest(run)
    q4 = next((run / "artifacts" / "gguf-q4km").glob("*.gguf"))
    q4_oid = hashlib.sha256(q4.read_bytes()).hexdigest()
    with FakeHub({}, token=TOKEN) as hub:
        env = {**push_env, "HF_ENDPOINT": hub.endpoint}
        hub.drop_uploads.add(q4_oid)  # every attempt at this file is cut off: the client's retries run out
        failed = quantforge_cli("push", str(run), "--to", "acme/tiny", env=env)
        assert failed.returncode == 2
        last = failed.stderr.strip().splitlines()[-1]
        assert last.startswith("error: push to acme/tiny-GGUF failed (") and "run the same command again" in last
        assert _unchanged(run, before) and not hub.commit_log
        uploaded_before = set(hub.lfs_puts)
        assert q4_oid not in uploaded_before and len(uploaded_before) == 2  # F16 and Q8_0 got through

        hub.drop_uploads.clear()
        resumed = quantforge_cli("push", str(run), "--to", "acme/tiny", env=env)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert hub.lfs_puts.count(q4_oid) == 1 and all(hub.lfs_puts.count(o) == 1 for o in uploaded_before)
        assert hub.pushed["acme/tiny-GGUF"][q4.name] == q4.read_bytes()


def test_a_large_gguf_is_split_in_llama_cpp_format_and_loads_with_the_same_logits(tiny_run, tmp_path):
    from llama_cpp import Llama

    from quantforge.publish import split_gguf

    gguf = next((tiny_run / "artifacts" / "gguf-q8_0").glob("*.gguf"))
    shards = split_gguf(gguf, gguf.stat().st_size // 3, tmp_path / "split")
    assert [s.name for s in shards] == [
        f"{gguf.stem}-0000{i}-of-0000{len(shards)}.gguf" for i in range(1, len(shards) + 1)
    ]
    # a shard holds at least one tensor, so the embedding of this tiny model fills one alone
    assert len(shards) == 3 and sum(s.stat().st_size for s in shards) < gguf.stat().st_size * 1.01
    assert split_gguf(gguf, gguf.stat().st_size // 3, tmp_path / "split") == shards  # reused, not rewritten

    def logits(path: Path) -> np.ndarray:
        model = Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
        model.eval(list(range(1, 33)))
        scores = np.array(model.scores[:32], dtype=np.float32)
        model.close()
        return scores

    np.testing.assert_array_equal(logits(shards[0]), logits(gguf))


def test_a_release_pushes_each_model_after_its_card(tiny_run, tiny_llama, push_env, tmp_path, monkeypatch):
    from quantforge.errors import QuantforgeError
    from quantforge.release import check_pushes, load_release, plan_release, run_unit

    path = tmp_path / "release.yaml"
    release_text = (
        f"out: {tmp_path / 'out'}\nmodels:\n  - model: {tiny_llama}\n    name: tiny\n"
        "    formats: [gguf-q8_0]\n    push: {to: acme/tiny, gguf_repos: per-format}\n"
    )
    path.write_text(release_text)
    release = load_release(path)
    units, _ = plan_release(release)
    assert [u.id for u in units][-2:] == ["tiny/card", "tiny/push"] and units[-1].depends == ["tiny/card"]
    monkeypatch.setenv("HF_TOKEN", "")
    with pytest.raises(QuantforgeError, match="needs a token"):
        check_pushes(release)
    path.write_text(release_text.replace("acme/tiny", "acme/bad..name"))
    with pytest.raises(QuantforgeError, match="not a valid Hub repo name"):
        check_pushes(load_release(path))
    path.write_text(release_text)

    shutil.copytree(tiny_run, tmp_path / "out" / "tiny", ignore=shutil.ignore_patterns("work"))  # its build is done
    with FakeHub({}, token=TOKEN) as hub:
        for name, value in {**push_env, "HF_ENDPOINT": hub.endpoint}.items():
            monkeypatch.setenv(name, value)
        import huggingface_hub.constants as hub_constants

        monkeypatch.setattr(hub_constants, "ENDPOINT", hub.endpoint)
        monkeypatch.setattr(hub_constants, "HF_HUB_DISABLE_XET", True)
        result = run_unit(str(path), "tiny", "push", None)
    assert result["repos"] == ["acme/tiny-F16-GGUF", "acme/tiny-Q4_K_M-GGUF", "acme/tiny-Q8_0-GGUF"]
    assert set(hub.pushed["acme/tiny-Q8_0-GGUF"]) >= {"README.md", "Modelfile", "tiny-llama-Q8_0.gguf"}


def test_build_refuses_a_bad_push_target_before_any_work(tiny_llama, push_env, tmp_path):
    out = tmp_path / "run"
    bad_name = quantforge_cli("build", str(tiny_llama), "--out", str(out), "--push-to-hub", "acme/-bad", env=push_env)
    no_token = quantforge_cli(
        "build", str(tiny_llama), "--out", str(out), "--push-to-hub", "acme/tiny", env={**push_env, "HF_TOKEN": ""}
    )
    assert bad_name.returncode == no_token.returncode == 2
    assert bad_name.stderr.strip().splitlines()[-1].startswith("error: --push-to-hub acme/-bad: not a valid Hub repo")
    assert "needs a token with write access" in no_token.stderr.strip().splitlines()[-1]
    assert not out.exists()
