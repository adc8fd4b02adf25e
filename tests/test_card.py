"""The card: decisions on measured runs, memory fit, HTML and plots, model cards and deployment files."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from conftest import FAST_EVAL, REPO, quantforge_cli, read_json

from quantforge.decide import Candidate, Targets, decide


def card_with(run: Path, *flags: str) -> dict:
    result = quantforge_cli("card", str(run), "--json", *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def candidates_of(card: dict) -> list[Candidate]:
    return [
        Candidate(e["key"], e["family"], tuple(e["runtimes"]), e["bits_per_weight"], e["size_bytes"], e["metrics"])
        for e in card["formats"]
    ]


def test_int8_wins_over_int4_when_both_meet_the_targets(mixed_run):
    card = card_with(mixed_run, "--max-ppl-increase", "1000", "--max-kld", "1000", "--runtime", "vllm")
    decision = card["decision"]
    assert decision["recommended"] in ("int8", "gptq-int8")
    outcome = {v["key"]: v for v in decision["verdicts"]}
    assert outcome["gptq-int4"]["outcome"] == "meets targets"
    assert "more aggressive than needed" in outcome["gptq-int4"]["reason"]
    assert outcome["gguf-q8_0"]["outcome"] == "excluded"  # not a vLLM format


def test_tightening_a_target_moves_the_recommendation_to_a_less_aggressive_format(mixed_run):
    card = card_with(mixed_run)
    kld = sorted(e["metrics"]["kld_mean"] for e in card["formats"])
    bits = {e["key"]: e["bits_per_weight"] for e in card["formats"]}
    loose = card_with(mixed_run, "--max-kld", str(kld[-1] * 1.01), "--max-ppl-increase", "1000")["decision"]
    # Only the least-damaged formats pass a tight KL limit.
    tight = card_with(mixed_run, "--max-kld", str(kld[1] * 1.0001), "--max-ppl-increase", "1000")["decision"]
    assert loose["recommended"] and tight["recommended"]
    # Every format meets the loose limit, so the least aggressive wins; under the tight one, the least aggressive
    # of the formats whose KL is within it, and every other names the missed target with both numbers.
    assert loose["recommended"] == min(card["formats"], key=lambda e: (-e["bits_per_weight"], e["key"]))["key"]
    within = [e for e in card["formats"] if e["metrics"]["kld_mean"] <= kld[1] * 1.0001]
    assert tight["recommended"] == min(within, key=lambda e: (-e["bits_per_weight"], e["key"]))["key"]
    assert bits[tight["recommended"]] <= bits[loose["recommended"]]
    for verdict in tight["verdicts"]:
        if verdict["outcome"] == "misses targets":
            assert re.search(r"missed kld_mean [0-9.e-]+ \(target <= [0-9.e-]+\)", verdict["reason"]), verdict


def test_min_size_target_pushes_towards_smaller_formats(mixed_run):
    card = card_with(mixed_run, "--max-ppl-increase", "1000", "--max-kld", "1000")
    sizes = sorted(e["size_bytes"] for e in card["formats"])
    limit_gb = (sizes[0] + 1) / 1e9
    decision = card_with(mixed_run, "--max-ppl-increase", "1000", "--max-kld", "1000", "--max-size", f"{limit_gb:.9f}")[
        "decision"
    ]
    smallest = min(card["formats"], key=lambda e: e["size_bytes"])["key"]
    assert decision["recommended"] == smallest


def test_a_target_that_was_not_measured_is_never_met(mixed_run):
    card = card_with(mixed_run, "--min-recovery", "50", "--max-ppl-increase", "1000")
    decision = card["decision"]
    assert decision["recommended"] is None  # no task was run: recovery is unverified everywhere
    assert all("unverified (not measured)" in v["reason"] for v in decision["verdicts"])
    assert decision["closest"] == "no format has every targeted metric measured"
    # The pure function agrees: a missing metric never counts as met.
    verdicts = decide(candidates_of(card), Targets(max_ppl_increase=None, min_decode_tps=1.0)).verdicts
    assert {v.outcome for v in verdicts} == {"misses targets"}


def test_nothing_meets_the_targets_names_the_closest(mixed_run):
    # A KL limit just below the best measured KL (from this run, not a constant): nothing meets it, and the closest
    # is the format with the least KL, by a margin the card can state.
    formats = card_with(mixed_run)["formats"]
    best = min(formats, key=lambda e: e["metrics"]["kld_mean"])
    limit = best["metrics"]["kld_mean"] * 0.999
    decision = card_with(mixed_run, "--max-kld", repr(limit), "--max-ppl-increase", "1000")["decision"]
    assert decision["recommended"] is None
    assert decision["closest"].startswith(best["key"] + " comes closest")
    verdict = next(v for v in decision["verdicts"] if v["key"] == best["key"])
    assert verdict["outcome"] == "misses targets" and "missed kld_mean" in verdict["reason"]


def test_equal_sizes_fall_to_the_closest_file():
    """The three Q4_K_M files of docs/design.md's SmolLM2 table (the same tensor bytes; KLD 0.0602 plain, 0.0383
    with an importance matrix, 0.0286 AutoRound) beside a Q8_0: with no size target the least aggressive wins and the
    closest Q4_K_M is the smallest that qualifies; under a size limit the closest Q4_K_M wins, not the first name."""

    def gguf(key, bits, kld):
        return Candidate(
            key, "gguf", ("llama.cpp",), bits, int(bits * 1e8), {"kld_mean": kld, "perplexity_increase_pct": 1.0}
        )

    candidates = [
        gguf("gguf-q4km", 4.85, 0.0602),
        gguf("gguf-q4km@imatrix", 4.85, 0.0383),
        gguf("gguf-q4km@autoround", 4.85, 0.0286),
        gguf("gguf-q8_0", 8.5, 0.001),
    ]
    free = decide(candidates, Targets())
    assert (free.recommended, free.smallest) == ("gguf-q8_0", "gguf-q4km@autoround")
    reasons = {v.key: v.reason for v in free.verdicts}
    assert (
        reasons["gguf-q4km"]
        == "same size as gguf-q4km@autoround, farther from the reference: KLD 0.0602 against 0.0286"
    )
    sized = decide(candidates, Targets(max_size_gb=0.6))
    assert (sized.recommended, sized.smallest) == ("gguf-q4km@autoround", "gguf-q4km@autoround")
    assert [v.key for v in sized.verdicts] == ["gguf-q8_0", "gguf-q4km@autoround", "gguf-q4km@imatrix", "gguf-q4km"]


def _kv_cache_bytes_per_token(model_dir: Path) -> int:
    """What transformers' own KV cache holds per token for this model in float16: a forward of 64 tokens, its
    cache's tensors measured (an independent count of what the card's memory fit assumes)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16).eval()
    with torch.inference_mode():
        cache = model(input_ids=torch.arange(3, 67)[None], use_cache=True).past_key_values
    layers = cache.layers
    held = sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in layers
    )
    return held // 64


def test_a_gpu_generation_runs_only_the_formats_its_kernels_run():
    """Issue 37: vLLM has no INT8 W8A8 kernel on Blackwell, so --gpu B200 never recommends INT8 and FP8 takes its
    place before INT4; on an H100 FP8 wins over INT4 when it meets the targets; on an A100 FP8 runs weights-only."""
    from quantforge.backends.llmcompressor import FORMATS

    def candidate(key, bits, kld):
        fmt = FORMATS.get(key)
        generations = (fmt.gpu_generations, fmt.gpu_weight_only) if fmt else ((), ())
        return Candidate(
            key,
            "hf",
            ("vllm",),
            bits,
            int(bits * 1e8),
            {"kld_mean": kld, "perplexity_increase_pct": 0.5},
            {},
            *generations,
        )

    candidates = [candidate("int8", 8.2, 0.002), candidate("fp8", 8.1, 0.003), candidate("gptq-int4", 4.3, 0.05)]
    blackwell = decide(candidates, Targets(), gpu=("B200", "blackwell"))
    verdicts = {v.key: v for v in blackwell.verdicts}
    assert blackwell.recommended == "fp8"
    assert verdicts["int8"].outcome == "excluded" and "does not run on B200 (Blackwell)" in verdicts["int8"].reason
    hopper = decide(candidates, Targets(), gpu=("H100", "hopper"))
    assert hopper.recommended == "int8"  # both 8-bit formats run there; INT8's file is the larger here
    assert decide(candidates[1:], Targets(), gpu=("H100", "hopper")).recommended == "fp8"  # FP8 before INT4
    ampere = decide(candidates[1:], Targets(), gpu=("A100", "ampere"))
    assert ampere.recommended == "fp8" and "runs with its weights alone" in ampere.verdicts[0].reason
    assert decide(candidates[1:], Targets(), gpu=("T4", "turing")).recommended == "fp8"  # weight-only Marlin there too
    # FP4: NVFP4 W4A4 runs as made on Blackwell alone, its weights alone from Ampere; none of it on Turing
    fp4 = [candidate("nvfp4", 4.5, 0.03), candidate("mxfp4-a16", 4.25, 0.08)]
    on_b200 = decide(fp4, Targets(), gpu=("B200", "blackwell"))
    assert on_b200.recommended == "nvfp4" and "weights alone" not in on_b200.verdicts[0].reason
    on_h100 = decide(fp4, Targets(), gpu=("H100", "hopper"))
    assert on_h100.recommended == "nvfp4" and "runs with its weights alone" in on_h100.verdicts[0].reason
    on_t4 = {v.key: v for v in decide(fp4, Targets(), gpu=("T4", "turing")).verdicts}
    assert all(v.outcome == "excluded" and "Turing" in v.reason for v in on_t4.values())


def test_gpu_b200_excludes_the_int8_file_of_a_real_run(mixed_run):
    decision = card_with(mixed_run, "--gpu", "B200", "--max-ppl-increase", "1000", "--max-kld", "1000")["decision"]
    outcomes = {v["key"]: v for v in decision["verdicts"]}
    assert outcomes["int8"]["outcome"] == "excluded" and "Blackwell" in outcomes["int8"]["reason"]
    assert decision["recommended"] != "int8"
    assert outcomes["gptq-int8"]["outcome"] != "excluded"  # weight-only INT8 (Marlin) runs there


def test_memory_fit_on_a_gpu(mixed_run, tiny_llama):
    card = card_with(mixed_run, "--gpu", "RTX 4090", "--context", "2048", "--concurrency", "4")
    per_token = _kv_cache_bytes_per_token(tiny_llama)
    for entry in card["formats"]:
        fit = entry["memory_fit"]["RTX 4090"]
        assert fit["kv_bytes_per_token"] == per_token
        assert fit["needed_gb"] == pytest.approx((entry["quantize"]["tensor_bytes"] + per_token * 2048 * 4) / 1e9)
        assert fit["fits"]
    tiny = card_with(mixed_run, "--gpu", "0.0011GB", "--max-ppl-increase", "1000")["decision"]
    assert tiny["recommended"] is None and "missed gpu_needed_gb" in tiny["verdicts"][0]["reason"]


@pytest.mark.parametrize(
    "key, kv_cache, flags",
    [("gguf-q8_0", "q8_0", "-fa on -ctk q8_0 -ctv q8_0"), ("int8", "fp8", "--kv-cache-dtype fp8")],
)
def test_where_only_a_quantized_kv_cache_fits_the_fit_and_commands_take_the_runtimes_own(
    mixed_run, key, kv_cache, flags
):
    """A GPU whose memory holds the file and 3/4 of a 16-bit KV cache: llama.cpp's q8_0 cache (34/32 bytes a value)
    and vLLM's fp8 one fit, the memory-fit cell and the serve command say so, and (not measured in this run) the
    GGUF's model card says its KL cost was not measured."""
    context, concurrency = "8192", "64"
    entry = next(
        e
        for e in card_with(mixed_run, "--gpu", "H100", "--context", context, "--concurrency", concurrency)["formats"]
        if e["key"] == key
    )
    fit = entry["memory_fit"]["H100"]
    usable = entry["quantize"]["tensor_bytes"] + 0.75 * fit["kv_bytes_per_token"] * int(context) * int(concurrency)
    gpu = f"{(usable + 1e9) / 0.9e9:.9f}GB"  # the card's GPU_UTILIZATION and RUNTIME_OVERHEAD_GB, as it states them
    card = card_with(
        mixed_run, "--gpu", gpu, "--context", context, "--concurrency", concurrency, "--max-ppl-increase", "1000"
    )
    [fit] = next(e for e in card["formats"] if e["key"] == key)["memory_fit"].values()
    assert not fit["fits"] and fit["fits_with_quantized_kv"] and fit["quantized_kv"] == kv_cache
    assert f"yes with {kv_cache} KV" in (mixed_run / "card.md").read_text()
    usage = (mixed_run / "artifacts" / key / "README.md").read_text()
    assert flags in usage
    if key.startswith("gguf"):
        assert "its cost in KL was not measured (build with --kv-cache q8_0)" in usage


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-size", "-1"], "--max-size must not be negative"),
        (["--gpu", "Voodoo 2"], "unknown GPU 'Voodoo 2'"),
        (["--min-top1-agreement", "1.5"], "between 0 and 1"),
        (["--min-task-recovery", "arc_easy"], "TASK=PCT pairs"),
    ],
)
def test_impossible_targets(mixed_run, flags, message):
    result = quantforge_cli("card", str(mixed_run), *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_runtime_counts_only_the_formats_that_run_in_it(mixed_run):
    decision = card_with(mixed_run, "--runtime", "ollama", "--max-ppl-increase", "1000")["decision"]
    outcomes = {v["key"]: v["outcome"] for v in decision["verdicts"]}
    assert {k for k, o in outcomes.items() if o == "excluded"} == {"int8", "gptq-int8", "gptq-int4", "awq"}
    assert decision["recommended"] == "gguf-q8_0"  # the least aggressive of the two GGUF files, both within 1000%


def test_a_runtime_no_format_serves(tiny_run):
    result = quantforge_cli("card", str(tiny_run), "--runtime", "vllm")
    assert result.returncode == 2
    assert "no format of this run runs in vllm" in result.stderr


def test_unfinished_run_says_which_command_completes_it(tiny_llama, tmp_path):
    import os
    import signal
    import sys
    import time

    run = tmp_path / "unfinished"
    # The evaluation text is a FIFO nobody writes to: the build records its start in run.json, then blocks reading
    # the text before the reference can be evaluated, so the kill always finds it there (no race, no skip).
    text = tmp_path / "eval-text.fifo"
    os.mkfifo(text)
    process = subprocess.Popen(
        [sys.executable, "-m", "quantforge.cli", "build", str(tiny_llama), "--formats", "gguf-q8_0", "--out", str(run)]
        + [*FAST_EVAL[:1], str(text), *FAST_EVAL[2:]],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while process.poll() is None and not (run / "run.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not {"tokens", "reference"} & set(read_json(run / "run.json")["stages"])
    result = quantforge_cli("card", str(run))
    assert result.returncode == 2
    assert "is unfinished: the reference was not evaluated; rerun: quantforge build" in result.stderr


class _Parser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.tables, self.headings = [], 0, []
        self._in_heading = False

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        self.tables += tag == "table"
        self._in_heading = tag in ("h1", "h2")

    def handle_data(self, data):
        if self._in_heading:
            self.headings.append(data)
            self._in_heading = False


def test_html_renders_with_plots(tiny_run):
    parser = _Parser()
    parser.feed((tiny_run / "card.html").read_text())
    assert parser.tables >= 4
    assert any("Recommendation" in h for h in parser.headings)
    assert set(parser.images) == {"card-quality.png", "card-speed.png"}
    for image in parser.images:
        data = (tiny_run / image).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    front = read_json(tiny_run / "card.json")["pareto_front"]
    assert front and set(front) <= {"gguf-f16", "gguf-q8_0", "gguf-q4km"}


def test_model_cards_and_deployment_files(mixed_run, vllm_source):
    import yaml
    from conftest import vllm_quantization_methods

    vllm_methods = vllm_quantization_methods(vllm_source)
    card = card_with(mixed_run, "--gpu", "L40S")
    for entry in card["formats"]:
        folder = mixed_run / entry["artifact"]
        readme = (folder / "README.md").read_text()
        front = yaml.safe_load(readme.split("---")[1])
        assert front["pipeline_tag"] == "text-generation" and front["quantized_by"] == "quantforge"
        assert "base_model" not in front, "a local folder's name is not a Hub id"
        assert front["library_name"] == ("gguf" if entry["family"] == "gguf" else "transformers")
        assert "quantforge" in front["tags"] and entry["format"] in front["tags"]
        assert "| mean KL divergence | 0 |" in readme and "## Recommendation" in readme
        if entry["family"] == "gguf":
            gguf = next(folder.glob("*.gguf")).name
            assert f"llama-server -m {gguf} -c 4096 --jinja" in readme
            assert (folder / "Modelfile").read_text().startswith(f"FROM ./{gguf}")
            assert "| calibration | none" in readme
        else:
            quant = read_json(folder / "config.json")["quantization_config"]
            assert quant["quant_method"] in vllm_methods
            assert f"vllm serve ./{folder.name} --max-model-len" in readme and "--quantization" not in readme
            assert f"{entry['quantize']['calibration_samples']} sequences x 128 tokens" in readme
            if entry["key"].startswith("gptq"):
                assert f"| group size | {quant['group_size']} |" in readme and "| act-order (desc_act) | no |" in readme
                assert f"| calibration arithmetic | {entry['quantize']['calibration_dtype']} |" in readme


def _go_render(template: str, messages: list[dict]) -> str:
    result = subprocess.run(
        ["go", "run", str(REPO / "tests" / "go" / "render_template.go")],
        input=json.dumps({"template": template, "messages": messages}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("with_system", [False, True])
def test_modelfile_template_matches_the_chat_template(tiny_run, tiny_llama, with_system):
    """Go's text/template (Ollama's engine) on our TEMPLATE gives the tokenizer's own chat-template prompt."""
    if shutil.which("go") is None:
        pytest.fail("the Go toolchain is needed for this test: run ./scripts/install.sh test")
    from transformers import AutoTokenizer

    modelfile = next((tiny_run / "artifacts").glob("gguf-q8_0/Modelfile")).read_text()
    template = re.search(r'TEMPLATE """(.*?)"""', modelfile, re.S).group(1)
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ]
    if with_system:
        messages.insert(0, {"role": "system", "content": "Answer briefly."})
    expected = AutoTokenizer.from_pretrained(tiny_llama).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert _go_render(template, messages) == expected
    assert 'PARAMETER stop "<|im_end|>"' in modelfile


def test_a_model_card_gives_task_recovery_and_the_command_that_made_the_run(tiny_run):
    """Issue 39: the recovery table quantized model cards show (task, reference, this file, recovery), and the
    command that made the files, without where the run was written."""
    card = read_json(tiny_run / "card.json")
    entry = next(e for e in card["formats"] if e["key"] == "gguf-q8_0")
    readme = (tiny_run / entry["artifact"] / "README.md").read_text()
    assert "| task | metric | examples | reference | this model | recovery |" in readme
    for name, task in entry["tasks"].items():
        base = card["reference"]["tasks"][name]["value"]
        # recovery is n/a where the reference scored 0 (the tiny model's lambada)
        kept = "n/a" if task["recovery_pct"] is None else f"{task['recovery_pct']:.1f}%"
        row = f"| {name} | {task['metric']} | {task['samples']} | {base:.3f} | {task['value']:.3f} | {kept} |"
        assert row in readme, row
    assert ("| mean |" in readme) == ("task_recovery_pct" in entry["metrics"])
    command = readme.split("Made by quantforge", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert command.startswith("quantforge build ") and "--formats gguf-f16,gguf-q8_0,gguf-q4km" in command
    assert "--out" not in command and str(tiny_run) not in readme
