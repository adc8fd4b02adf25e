"""What we hand to runtimes: serve commands checked against the runtimes' own argument tables, chat templates
rendered in transformers' sandbox, Modelfiles, model cards with licence and base model."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import read_json

from quantforge.deploy import (
    GPU,
    chat_template_to_ollama,
    llama_cli_command,
    llama_server_command,
    memory_fit,
    serving,
    vllm_command,
)
from quantforge.errors import QuantforgeError

# ----------------------------------------------------------------------------------------------- vLLM


def _vllm_flags(vllm_source) -> set[str]:
    """Every option name vLLM's engine argument parser declares."""
    return set(re.findall(r'"(--[a-z0-9][a-z0-9-]*)"', vllm_source("vllm/engine/arg_utils.py")))


def _flags(command: str) -> list[str]:
    return [word for word in command.split() if word.startswith("-")]


@pytest.mark.parametrize("kv_cache", [None, "fp8"])
def test_vllm_command_uses_only_flags_vllm_declares_and_never_pins_the_kernel(vllm_source, kv_cache):
    command = vllm_command("tiny-gptq-int4", 4096, kv_cache)
    assert command.startswith("vllm serve ./tiny-gptq-int4 ")
    assert set(_flags(command)) <= _vllm_flags(vllm_source)
    assert "--quantization" not in command and "-q" not in _flags(command)
    if kv_cache:
        cache = vllm_source("vllm/config/cache.py")
        literal = cache[cache.index("CacheDType = Literal[") : cache.index("]", cache.index("CacheDType = Literal["))]
        assert '"fp8"' in literal


def test_vllm_upgrades_gptq_and_awq_checkpoints_itself(vllm_source):
    """The methods our checkpoints name are ones vLLM checks for a faster override (Marlin) when none is forced."""
    model_config = vllm_source("vllm/config/model.py")
    overrides = model_config[
        model_config.index("overrides = [") : model_config.index("]", model_config.index("overrides = ["))
    ]
    for method in ("gptq", "awq"):
        assert f'"{method}"' in overrides


def test_memory_fit_offers_an_fp8_kv_cache_when_fp16_does_not_fit():
    config = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "max_position_embeddings": 131072}
    gpu = GPU("24 GB GPU", 24.0, None)
    fit = memory_fit(int(17e9), config, gpu, context=32768, concurrency=1)  # KV: 4.3 GB fp16, 2.1 GB fp8
    assert not fit["fits"] and fit["fits_with_quantized_kv"] and fit["quantized_kv"] == "fp8"
    assert abs(fit["largest_context_quantized_kv"] - 2 * fit["largest_context"]) <= 1
    assert serving(fit, 32768) == (32768, "fp8")
    tight = memory_fit(int(19e9), config, gpu, context=32768, concurrency=1)
    assert not tight["fits_with_quantized_kv"]
    assert serving(tight, 32768) == (tight["largest_context"], None)
    assert serving(None, 4096) == (4096, None)


def test_memory_fit_of_a_gguf_falls_back_to_llama_cpps_q8_0_kv_cache():
    """llama.cpp's q8_0 cache: 34 bytes per 32 values (a one-byte quant each and a 16-bit scale per block)."""
    config = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "max_position_embeddings": 131072}
    gpu = GPU("24 GB GPU", 24.0, None)
    fit = memory_fit(int(17e9), config, gpu, context=32768, concurrency=1, quantized_kv=("q8_0", 34 / 32))
    assert fit["kv_bytes_per_token"] == 131072  # 32 layers x 8 heads x 128 x (K, V) x 2 bytes
    # 65,536 cached values per token at 34/32 bytes: 69,632 bytes; 3.6 GB left for the cache (24 x 0.9 - 1 - 17)
    assert fit["largest_context_quantized_kv"] == 3_600_000_000 // 69_632 == 51_700
    assert serving(fit, 32768) == (32768, "q8_0")


# ----------------------------------------------------------------------------------------------- llama.cpp


def _llama_cpp_options() -> dict[str, tuple[set[str], set[str]]]:
    """Option name -> (examples it is declared for, examples it is excluded from), from llama.cpp's arg.cpp as
    vendored in the installed llama-cpp-python (kept beside the converter by `quantforge setup`)."""
    from quantforge.backends.llamacpp.convert import converter_dir

    arg_cpp = converter_dir() / "common" / "arg.cpp"
    assert arg_cpp.exists(), f"{arg_cpp} is missing: run 'quantforge setup' (scripts/install.sh does)"
    options = {}
    for block in arg_cpp.read_text().split("add_opt(common_arg(")[1:]:
        names = re.findall(r'"(-[-a-z0-9]+)"', block.split("\n", 2)[1] if block.startswith("\n") else block[:200])
        examples = re.search(r"\.set_examples\(\{([^}]*)\}\)", block)
        excludes = re.search(r"\.set_excludes\(\{([^}]*)\}\)", block)
        declared = set(re.findall(r"LLAMA_EXAMPLE_\w+", examples.group(1))) if examples else {"LLAMA_EXAMPLE_COMMON"}
        excluded = set(re.findall(r"LLAMA_EXAMPLE_\w+", excludes.group(1))) if excludes else set()
        for name in names:
            options.setdefault(name, (set(), set()))
            options[name][0].update(declared)
            options[name][1].update(excluded)
    return options


@pytest.mark.parametrize(
    "command, example",
    [
        (llama_server_command("model-Q4_K_M.gguf", 4096), "LLAMA_EXAMPLE_SERVER"),
        (llama_server_command("model-Q4_K_M.gguf", 4096, "q8_0"), "LLAMA_EXAMPLE_SERVER"),
        (llama_cli_command("model-Q4_K_M.gguf", 4096), "LLAMA_EXAMPLE_CLI"),
        (llama_cli_command("model-Q4_K_M.gguf", 4096, "q4_0"), "LLAMA_EXAMPLE_CLI"),
    ],
)
def test_llama_cpp_commands_use_options_of_that_program(command, example):
    options = _llama_cpp_options()
    assert len(options) > 100, "arg.cpp was not parsed"
    for flag in _flags(command):
        assert flag in options, f"{flag} is not an option of llama.cpp"
        declared, excluded = options[flag]
        assert (example in declared or "LLAMA_EXAMPLE_COMMON" in declared) and example not in excluded, flag


def test_the_kv_cache_types_we_offer_are_llama_cpps_and_take_flash_attention_on():
    """Each KV type quantforge measures (and writes after -ctk/-ctv) is in arg.cpp's list of cache types, and
    "on" is a value -fa declares."""
    from quantforge.backends.llamacpp import KV_CACHE_BYTES
    from quantforge.backends.llamacpp.convert import converter_dir

    arg_cpp = (converter_dir() / "common" / "arg.cpp").read_text()
    table = arg_cpp[arg_cpp.index("kv_cache_types = {") : arg_cpp.index("};", arg_cpp.index("kv_cache_types = {"))]
    assert {f"GGML_TYPE_{kv.upper()}" for kv in KV_CACHE_BYTES} <= set(re.findall(r"GGML_TYPE_\w+", table))
    values = re.search(r'\{ "-fa", "--flash-attn" \}, "\[([a-z|]+)\]"', arg_cpp)
    assert values and "on" in values.group(1).split("|")


# ----------------------------------------------------------------------------------------------- chat templates

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA3_SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


@pytest.mark.parametrize(
    "escape",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
        "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
        "{% set x = messages.append({'role': 'user', 'content': 'x'}) %}{{ x }}",
    ],
)
def test_a_template_that_tries_to_leave_the_sandbox_fails_in_one_line_and_runs_nothing(escape, tmp_path):
    marker = tmp_path / "escaped"
    template = escape.replace("{marker}", str(marker)) + CHATML
    with pytest.raises(QuantforgeError) as failure:
        chat_template_to_ollama(template, {"bos_token": None, "eos_token": "<|im_end|>"})
    message = str(failure.value)
    assert message.startswith("the chat template failed to render (") and "\n" not in message
    assert not marker.exists()


def test_a_bos_token_in_the_template_is_left_to_the_runtime():
    """llama.cpp adds BOS for a GGUF that asks for it; a TEMPLATE that writes it too would double it."""
    template, stops = chat_template_to_ollama(LLAMA3, {**LLAMA3_SPECIAL, "runtime_adds_bos": True})
    assert "<|begin_of_text|>" not in template
    assert template.startswith("{{ range .Messages }}")
    assert "<|eot_id|>" in stops
    kept, _ = chat_template_to_ollama(LLAMA3, {**LLAMA3_SPECIAL, "runtime_adds_bos": False})
    assert "<|begin_of_text|>" in kept


def test_a_template_using_strftime_now_renders_with_today():
    from datetime import datetime

    template = (
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nToday is ' + strftime_now('%d %b %Y') "
        "+ '<|im_end|>\\n' }}{% endif %}" + CHATML
    )
    ollama, _ = chat_template_to_ollama(template, {"bos_token": None, "eos_token": "<|im_end|>"})
    assert f"Today is {datetime.now().strftime('%d %b %Y')}" in ollama


def test_raise_exception_in_a_template_is_one_line():
    template = "{{ raise_exception('System role not supported') }}"
    with pytest.raises(QuantforgeError, match=r"TemplateError: System role not supported\)$"):
        chat_template_to_ollama(template, {"bos_token": None, "eos_token": None})


# ----------------------------------------------------------------------------------------------- written files


@pytest.fixture
def run_copy(tiny_run, tiny_llama, tmp_path) -> tuple[Path, Path, dict]:
    """A copy of the tiny run and of its source, and the run's card pointing at the source copy."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("work", "logs"))
    source = tmp_path / "source"
    shutil.copytree(tiny_llama, source)
    card = read_json(run / "card.json")
    card["model"]["path"] = str(source)
    return run, source, card


def test_a_template_that_fails_leaves_a_modelfile_without_template_and_says_why(run_copy):
    from quantforge.modelcard import write_deployment_files

    run, source, card = run_copy
    (source / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}" + CHATML)
    config = read_json(source / "tokenizer_config.json")
    config.pop("chat_template", None)
    (source / "tokenizer_config.json").write_text(__import__("json").dumps(config))
    write_deployment_files(run, card)
    folder = run / "artifacts" / "gguf-q8_0"
    modelfile = (folder / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./") and "TEMPLATE" not in modelfile and "PARAMETER num_ctx 4096" in modelfile
    readme = (folder / "README.md").read_text()
    assert "The Modelfile has no TEMPLATE (the chat template failed to render (SecurityError" in readme


def test_model_card_takes_licence_and_base_model_from_the_source_card(run_copy):
    from quantforge.modelcard import write_deployment_files

    run, source, card = run_copy
    (source / "README.md").write_text(
        "---\nlicense: other\nlicense_name: llama3.1\nlicense_link: LICENSE\nbase_model: acme/base-8b\n---\n# A model\n"
    )
    (source / "LICENSE").write_text("Terms that travel with every copy.\n")
    write_deployment_files(run, card)
    folder = run / "artifacts" / "gguf-q4km"
    readme = (folder / "README.md").read_text()
    front = yaml.safe_load(readme.split("---")[1])
    assert front["base_model"] == "acme/base-8b" and front["base_model_relation"] == "quantized"
    assert (front["license"], front["license_name"], front["license_link"]) == ("other", "llama3.1", "LICENSE")
    assert (folder / "LICENSE").read_text() == "Terms that travel with every copy.\n"
    card["model"]["hub_id"] = "acme/published"
    write_deployment_files(run, card)
    front = yaml.safe_load((folder / "README.md").read_text().split("---")[1])
    assert front["base_model"] == "acme/published"


def test_a_backend_whose_deployment_hook_raises_is_one_line_naming_format_and_backend(tmp_path):
    from quantforge.backends.llamacpp import LlamaCppBackend
    from quantforge.errors import QuantforgeError
    from quantforge.modelcard import _deployment

    class Broken(LlamaCppBackend):
        name = "broken-demo"

        def deployment(self, folder, card, entry, chat):
            raise RuntimeError("template engine exploded\nsecond line")

    entry = {"key": "gguf-q4km@broken-demo", "backend": "broken-demo", "family": "gguf", "runtimes": ["llama.cpp"]}
    with pytest.raises(QuantforgeError) as caught:
        _deployment(tmp_path, {}, entry, (None, {}), {"broken-demo": Broken()})
    assert str(caught.value) == (
        "gguf-q4km@broken-demo: backend broken-demo failed to write its model card's usage "
        "(RuntimeError: template engine exploded)"
    )
