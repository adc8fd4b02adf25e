"""Generation tasks (lm-eval generate_until): greedy decoding in each format's own runtime, exact-match scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import FAST_EVAL, REPO, build_run, read_json

QUESTIONS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = 7\n#### 7"),
    ("A box holds 12 eggs. How many eggs are in 2 boxes?", "12 * 2 = 24\n#### 24"),
    ("Sara reads 5 pages a day for 6 days. How many pages does she read?", "5 * 6 = 30\n#### 30"),
    ("There are 20 birds and 8 fly away. How many birds are left?", "20 - 8 = 12\n#### 12"),
]


@pytest.fixture(scope="module")
def gsm_data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gsm")
    rows = [json.dumps({"question": q, "answer": a}) for q, a in QUESTIONS]
    (folder / "gsm8k_test.jsonl").write_text("\n".join(rows) + "\n")
    return folder


@pytest.fixture(scope="module")
def short_gsm8k(tmp_path_factory) -> Path:
    """The shipped gsm8k definition with 12 generated tokens at most, as a team's own (QUANTFORGE_PATH) task."""
    root = tmp_path_factory.mktemp("team")
    definition = yaml.safe_load((REPO / "evals" / "tasks" / "gsm8k.yaml").read_text())
    definition["generation_kwargs"]["max_gen_toks"] = 12
    (root / "evals" / "tasks").mkdir(parents=True)
    (root / "evals" / "tasks" / "gsm8k.yaml").write_text(yaml.safe_dump(definition, sort_keys=False))
    return root


def test_greedy_generation_is_the_same_text_in_llama_cpp_and_transformers(tiny_run, tiny_llama):
    """The F16 GGUF in llama.cpp and the float checkpoint in transformers decode the same tokens greedily."""
    from transformers import AutoTokenizer

    from quantforge.backends.llamacpp import LlamaCppRunner
    from quantforge.runners import TorchRunner
    from quantforge.tasks import greedy_generate

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    gguf = next((tiny_run / "artifacts" / "gguf-f16").glob("*.gguf"))
    runners = [LlamaCppRunner(gguf, context=256, threads=2), TorchRunner.from_folder(tiny_llama, threads=2)]
    settings = {"until": ["Question:"], "do_sample": False, "max_gen_toks": 16}
    texts = [
        [greedy_generate(runner, tokenizer, f"Question: {q}\nAnswer:", settings, 256) for q, _ in QUESTIONS]
        for runner in runners
    ]
    for runner in runners:
        runner.close()
    assert texts[0] == texts[1]
    assert all(text and "Question:" not in text for text in texts[0])


def test_greedy_generation_stops_at_a_stop_string_and_refuses_sampling(tiny_llama, tiny_run):
    from transformers import AutoTokenizer

    from quantforge.backends.llamacpp import LlamaCppRunner
    from quantforge.errors import QuantforgeError
    from quantforge.tasks import greedy_generate

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    runner = LlamaCppRunner(next((tiny_run / "artifacts" / "gguf-q8_0").glob("*.gguf")), context=256, threads=2)
    free = greedy_generate(runner, tokenizer, "Question: 1 + 1?\nAnswer:", {"max_gen_toks": 12}, 256)
    assert free  # a random model still writes something; its first character as the stop string ends it at once
    settings = {"max_gen_toks": 12, "until": [free[0]]}
    assert greedy_generate(runner, tokenizer, "Question: 1 + 1?\nAnswer:", settings, 256) == ""
    with pytest.raises(QuantforgeError, match="greedily"):
        greedy_generate(runner, tokenizer, "x", {"do_sample": True}, 256)
    runner.close()


@pytest.mark.slow
def test_a_generation_task_runs_for_gguf_and_a_torch_format(tiny_llama, gsm_data, short_gsm8k, tmp_path):
    args = ["--formats", "gguf-q8_0,gptq-int4", *FAST_EVAL, "--calib-samples", "8", "--calib-seqlen", "128"]
    args += ["--tasks", "gsm8k", "--tasks-data", str(gsm_data), "--limit", "3"]
    run = build_run(tiny_llama, tmp_path / "run", *args, env={"QUANTFORGE_PATH": str(short_gsm8k)})
    card = read_json(run / "card.json")
    reference = card["reference"]["tasks"]["gsm8k"]
    assert reference["metric"] == "exact_match" and reference["samples"] == 3 and 0 <= reference["value"] <= 1
    for entry in card["formats"]:
        task = entry["tasks"]["gsm8k"]
        assert task["samples"] == 3 and 0 <= task["value"] <= 1, entry["key"]
    runtimes = {e["key"]: e["how"]["runtime"] for e in card["formats"]}
    assert runtimes["gguf-q8_0"] == "llama.cpp" and "torch" in runtimes["gptq-int4"]
    assert "gsm8k (exact_match)" in (run / "card.md").read_text()
