"""The resource plan (build --plan-only), the refusal of builds a host cannot hold, --device, and the manifest's
record of every stage's measured peak memory beside its prediction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import quantforge_cli, read_json

from quantforge.errors import QuantforgeError
from quantforge.resources import GB, LIBRARIES_RSS, HostSpeed, ModelSize, PlanInputs, make_resource_plan

QWEN_7B = ModelSize(7_615_616_512, 3584, 18944, 28, 152064)
HOST = HostSpeed(gemm_gflops=50.0, memory_available=int(24 * GB), threads=2)


def _inputs(formats=(("gguf-q4km", "gguf", 4.89),), device="cpu", calibration=0) -> PlanInputs:
    return PlanInputs(list(formats), 2048, 40, calibration, 0, [], device)


def _stage(plan: dict, key: str) -> dict:
    return next(s for s in plan["stages"] if s["key"] == key)


def test_a_7b_reference_is_planned_at_the_stored_weights_not_float32():
    plan = make_resource_plan(QWEN_7B, _inputs(), HOST)
    reference = _stage(plan, "reference")["peak_rss_bytes"] - LIBRARIES_RSS
    assert 0.8 * QWEN_7B.bf16_bytes < reference <= 1.5 * QWEN_7B.bf16_bytes  # float32 would be 2x and more
    assert plan["total"]["peak_over_bf16"] <= 1.5


def test_plan_grows_with_formats_windows_and_model():
    one = make_resource_plan(QWEN_7B, _inputs(), HOST)
    two = make_resource_plan(QWEN_7B, _inputs((("gguf-q4km", "gguf", 4.89), ("gguf-q8_0", "gguf", 8.5))), HOST)
    assert two["total"]["disk_bytes"] > one["total"]["disk_bytes"]
    assert two["total"]["seconds"] > one["total"]["seconds"]
    small = ModelSize(494_032_768, 896, 4864, 24, 151936, True)
    assert make_resource_plan(small, _inputs(), HOST)["total"]["seconds"] < one["total"]["seconds"]
    faster = HostSpeed(gemm_gflops=500.0, memory_available=HOST.memory_available, threads=2)
    assert (
        _stage(make_resource_plan(QWEN_7B, _inputs(), faster), "reference")["seconds"]
        < _stage(one, "reference")["seconds"]
    )


def test_second_half_scoring_plans_the_output_layer_on_half_the_positions():
    from dataclasses import replace

    every, half = (make_resource_plan(QWEN_7B, replace(_inputs(), first_scored=first), HOST) for first in (0, 1024))
    head = QWEN_7B.vocab_size * QWEN_7B.hidden_size / QWEN_7B.parameters  # the output layer's share, 0.07 at 7B
    for key in ("reference", "evaluate/gguf-q4km"):
        fixed = _stage(every, key)["seconds"] - _stage(half, key)["seconds"]
        assert 0 < fixed < _stage(every, key)["seconds"] * head  # at most the head's share of every position's work
        assert _stage(every, key)["peak_rss_bytes"] == _stage(half, key)["peak_rss_bytes"]


def test_llamacpp_evaluation_is_timed_at_ggmls_measured_rate_and_torch_stages_at_numpys():
    from dataclasses import replace

    measured = replace(HOST, ggml_gflops=25.0)

    def seconds(host: HostSpeed, key: str) -> float:
        return _stage(make_resource_plan(QWEN_7B, _inputs(), host), key)["seconds"]

    faster_ggml, faster_numpy = replace(measured, ggml_gflops=50.0), replace(measured, gemm_gflops=100.0)
    assert seconds(faster_ggml, "evaluate/gguf-q4km") < seconds(measured, "evaluate/gguf-q4km")
    assert seconds(faster_numpy, "evaluate/gguf-q4km") == seconds(measured, "evaluate/gguf-q4km")
    assert seconds(faster_numpy, "reference") < seconds(measured, "reference")
    assert seconds(faster_ggml, "reference") == seconds(measured, "reference")
    # Without llama.cpp's rate the evaluation falls back on numpy's.
    assert seconds(replace(HOST, gemm_gflops=100.0), "evaluate/gguf-q4km") < seconds(HOST, "evaluate/gguf-q4km")


def test_ggml_rate_is_measured_in_llamacpps_library_and_a_broken_library_gives_none(tmp_path, monkeypatch):
    from quantforge.backends.llamacpp import rate as ggml_rate

    # The child checks ggml's product against numpy's before it reports a rate.
    assert 1 < ggml_rate.measure_ggml_gflops(2) < 100_000
    broken = tmp_path / "lib"
    broken.mkdir()
    for name in ("libggml-base.so", "libggml-cpu.so"):
        (broken / name).write_bytes(b"not a shared library")
    monkeypatch.setattr(ggml_rate, "ggml_library_dir", lambda: broken)
    assert ggml_rate.measure_ggml_gflops(2) is None


def test_on_cuda_the_model_is_planned_in_gpu_memory():
    gptq = (("gptq-int4", "gptq", 4.0),)
    cpu = make_resource_plan(QWEN_7B, _inputs(gptq, "cpu", 128 * 512), HOST)
    cuda = make_resource_plan(QWEN_7B, _inputs(gptq, "cuda:0", 128 * 512), HOST)
    for key in ("reference", "quantize/gptq-int4", "evaluate/gptq-int4"):
        assert _stage(cuda, key)["vram_bytes"] > 0 and _stage(cpu, key)["vram_bytes"] == 0
        assert _stage(cuda, key)["peak_rss_bytes"] < _stage(cpu, key)["peak_rss_bytes"]


def test_on_cuda_each_process_that_computes_there_adds_a_cuda_context():
    """A child that quantizes or evaluates on the GPU holds a context of its own; the build's was made before the
    plan read the device's free memory. GGUF evaluation is on the GPU only with a CUDA build of llama.cpp."""
    from dataclasses import replace

    from quantforge.resources import CUDA_KERNEL_BYTES, CUDA_PROCESS_BYTES

    formats = (("gptq-int4", "gptq", 4.0), ("gguf-q4km", "gguf", 4.89))
    cpu_llamacpp = make_resource_plan(QWEN_7B, _inputs(formats, "cuda:0", 128 * 512), HOST)
    artifact = {"gptq-int4": QWEN_7B.parameters * 4.0 / 8, "gguf-q4km": QWEN_7B.parameters * 4.89 / 8}
    # packed weights and the untied embedding table and output layer in bf16
    held = artifact["gptq-int4"] + 2 * QWEN_7B.vocab_size * QWEN_7B.hidden_size * 2
    evaluate = _stage(cpu_llamacpp, "evaluate/gptq-int4")["vram_bytes"]
    assert held + CUDA_PROCESS_BYTES < evaluate < 1.2 * held + CUDA_PROCESS_BYTES
    assert _stage(cpu_llamacpp, "quantize/gptq-int4")["vram_bytes"] > QWEN_7B.bf16_bytes + CUDA_PROCESS_BYTES
    # the reference in the build's process: every weight, the untied embedding table too (copied to the GPU, where
    # host memory maps it and touches the rows it looks up), plus its kernels; activations of 2048 positions
    reference = _stage(cpu_llamacpp, "reference")["vram_bytes"]
    assert QWEN_7B.bf16_bytes + CUDA_KERNEL_BYTES < reference < 1.15 * QWEN_7B.bf16_bytes
    assert _stage(cpu_llamacpp, "evaluate/gguf-q4km")["vram_bytes"] == 0  # llama.cpp built for the CPU
    offloads = make_resource_plan(QWEN_7B, _inputs(formats, "cuda:0", 128 * 512), replace(HOST, llamacpp_offload=True))
    gguf = _stage(offloads, "evaluate/gguf-q4km")
    assert artifact["gguf-q4km"] + CUDA_PROCESS_BYTES < gguf["vram_bytes"] < 1.2 * artifact["gguf-q4km"] + 1 * GB
    # The host still holds the mapped file while llama.cpp loads it; evaluated on the CPU it also holds the copy of
    # the Q4_K weights llama.cpp repacks for its CPU kernels (measured at the 7B shape: docs/benchmarks.md).
    assert artifact["gguf-q4km"] < gguf["peak_rss_bytes"] < _stage(cpu_llamacpp, "evaluate/gguf-q4km")["peak_rss_bytes"]
    on_cpu = make_resource_plan(QWEN_7B, _inputs(formats, "cpu", 128 * 512), replace(HOST, llamacpp_offload=True))
    assert all(stage["vram_bytes"] == 0 for stage in on_cpu["stages"])


def test_ggml_offload_is_read_from_llamacpps_libraries(tmp_path, monkeypatch):
    from quantforge.backends.llamacpp import rate as ggml_rate

    assert ggml_rate.ggml_offloads_to_cuda() is False  # this machine's llama.cpp is built for the CPU
    (tmp_path / "libggml-cuda.so").write_bytes(b"")
    monkeypatch.setattr(ggml_rate, "ggml_library_dir", lambda: tmp_path)
    assert ggml_rate.ggml_offloads_to_cuda() is True


def test_gpu_memory_of_each_stage_is_sampled_above_what_the_device_held_at_the_start():
    """memory.GpuWatch with a device reading that the test raises and lowers, as a stage's allocations and its
    children's move torch.cuda.mem_get_info on a GPU: each stage keeps its own highest reading above the first."""
    import time

    from quantforge import memory

    def wait_for(condition) -> None:
        """Until the watch's thread (a sample every 0.1 s) has acted: no fixed sleep a stalled host could outlast."""
        deadline = time.monotonic() + 30
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.02)

    used = [1000]
    memory.watch_gpu(lambda: used[0])
    try:
        with memory.StagePeak() as outer:
            used[0] = 5000
            wait_for(lambda: (outer.gpu_seen or 0) >= 5000)
            used[0] = 3000
            with memory.StagePeak() as inner:
                used[0] = 2000
            used[0] = 1000
        with memory.StagePeak() as broken:
            used[0] = None  # a reading that fails stops the watch, not the build
            wait_for(lambda: memory._gpu_watch.failed)
    finally:
        memory.watch_gpu(None)
    assert outer.to_json()["gpu_peak_bytes"] == 4000
    assert inner.to_json()["gpu_peak_bytes"] == 2000  # 3000 when it began
    assert broken.to_json()["gpu_peak_bytes"] == 0  # what it saw before the reading failed
    with memory.StagePeak() as unwatched:
        pass
    assert "gpu_peak_bytes" not in unwatched.to_json()


def test_model_size_without_a_parameter_count_is_refused():
    with pytest.raises(QuantforgeError, match="lacks parameters"):
        ModelSize.from_facts({"hidden_size": 8, "num_layers": 1, "vocab_size": 10})


def test_plan_only_of_a_7b_recipe_downloads_nothing(tmp_path):
    out = tmp_path / "run"
    result = quantforge_cli(
        "build", "qwen2.5-7b", "--plan-only", "--json", "--out", str(out), env={"HF_HUB_OFFLINE": "1"}
    )
    assert result.returncode in (0, 2), result.stderr
    plan = json.loads(result.stdout)
    assert plan["model"]["parameters"] == 7_615_616_512
    assert plan["fits"] == (result.returncode == 0)
    keys = [s["key"] for s in plan["stages"]]
    for fmt in ("gguf-q8_0", "gguf-q5km", "gguf-q4km"):  # the recipe's formats, each quantized and evaluated
        assert keys.index(f"quantize/{fmt}") < keys.index(f"evaluate/{fmt}")
    assert plan["total"]["peak_over_bf16"] <= 1.5
    assert not out.exists()


def test_plan_only_table_names_every_stage(tiny_llama):
    result = quantforge_cli("build", str(tiny_llama), "--formats", "gguf-q8_0", "--plan-only")
    assert result.returncode == 0, result.stderr
    for key in ("reference", "intermediate/gguf-f16", "quantize/gguf-q8_0", "evaluate/gguf-q8_0", "total: about"):
        assert key in result.stdout


def test_a_model_too_large_for_the_host_is_refused_before_download(tmp_path):
    recipe = tmp_path / "huge.yaml"
    recipe.write_text(
        "model: example-org/huge-model\nformats: [gguf-q4km]\nsize:\n  parameters: 400000000000\n"
        "  hidden_size: 16384\n  intermediate_size: 53248\n  num_layers: 126\n  vocab_size: 128256\n"
    )
    out = tmp_path / "run"
    result = quantforge_cli("build", "--recipe", str(recipe), "--out", str(out), env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    # The stage that needs most: the reference, or its speed probe (the whole checkpoint in transformers).
    assert line.startswith("error: not enough memory: stage ") and "reference needs about" in line
    assert "GB is available" in line
    assert not (out / "artifacts").exists() and not any(Path(out).glob("**/*.safetensors"))


@pytest.mark.parametrize(
    "device, message",
    [("cuda", "--device cuda: torch"), ("cuda:1", "sees no CUDA device"), ("tpu", "--device must be auto, cpu")],
)
def test_device_that_cannot_be_had_is_one_line(tiny_llama, tmp_path, device, message):
    out = tmp_path / "run"
    result = quantforge_cli("build", str(tiny_llama), "--formats", "gguf-q8_0", "--device", device, "--out", str(out))
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]
    assert not out.exists()


def test_manifest_holds_each_stages_peak_memory_beside_the_plan(tiny_run):
    from quantforge.resources import plan_versus_actual

    manifest = read_json(tiny_run / "run.json")
    assert manifest["plan"]["device"] == "cpu"
    assert manifest["resource_plan"]["host"]["ggml_gflops"] > 1  # a GGUF build measures llama.cpp's own rate
    predicted = {s["key"] for s in manifest["resource_plan"]["stages"]}
    rows = plan_versus_actual(manifest["resource_plan"], manifest["stages"])
    measured = {row["key"] for row in rows}
    assert {"reference", "quantize/gguf-q8_0", "evaluate/gguf-q4km"} <= measured <= predicted
    for row in rows:
        assert row["peak_rss_bytes"] and row["peak_rss_bytes"] > 50e6  # at least the interpreter itself
    # The reference's peak is the largest this process reached while evaluating it, so at least its weights.
    reference = manifest["stages"]["reference"]["memory"]["peak_rss_bytes"]
    assert reference > manifest["stages"]["tokens"]["memory"]["peak_rss_bytes"]


def test_auto_device_is_the_cpu_on_a_machine_without_a_gpu():
    from quantforge.device import _nvidia_driver_present, resolve_device

    if _nvidia_driver_present():
        pytest.skip("this machine has an NVIDIA driver")
    assert resolve_device("auto") == "cpu" and resolve_device(None) == "cpu" and resolve_device("CPU") == "cpu"


def test_speed_probe_of_hf_formats_names_vllm_when_it_is_missing(tmp_path):
    import importlib.util

    from quantforge.backends import load_backends

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    backends = load_backends()
    assert "not measured here: vLLM not installed" in backends["llmcompressor"].probe_target(tmp_path)
    assert backends["gptqmodel"].probe_target(tmp_path) == ("transformers", tmp_path)  # its CPU kernels


def test_a_gpu_too_small_is_refused_with_the_numbers(tmp_path):
    from quantforge.resources import check_plan

    gpu = HostSpeed(gemm_gflops=50.0, memory_available=int(64 * GB), threads=2, gpu_memory_free=int(8 * GB))
    plan = make_resource_plan(QWEN_7B, _inputs((("gptq-int4", "gptq", 4.0),), "cuda:0", 128 * 512), gpu)
    with pytest.raises(QuantforgeError, match=r"not enough GPU memory on cuda:0: stage .* needs about [0-9.]+ GB"):
        check_plan(plan, tmp_path)
    roomy = HostSpeed(gemm_gflops=50.0, memory_available=int(64 * GB), threads=2, gpu_memory_free=int(141 * GB))
    check_plan(make_resource_plan(QWEN_7B, _inputs((("gptq-int4", "gptq", 4.0),), "cuda:0", 128 * 512), roomy),
               tmp_path)  # fmt: skip


def test_gptq_calibrates_in_float32_on_a_cpu_without_bf16_when_it_fits():
    """bf16 multiplies are emulated on such a CPU (about 4x slower a calibration token): float32 when the model fits
    at 4 bytes a weight, bf16 when it does not; AWQ stays in bf16 (GPTQModel packs it only from 16 bits)."""
    from dataclasses import replace

    from quantforge.resources import quantize_dtype

    formats = (("gptq-int4", "gptq", 4.0), ("awq", "awq", 4.25))

    def plan(host: HostSpeed, asked: str = "auto") -> dict:
        inputs = replace(
            _inputs(formats, "cpu", 128 * 512), quantize_dtype=asked, follows_dtype=frozenset({"gptq-int4"})
        )
        return make_resource_plan(QWEN_7B, inputs, host)

    no_bf16 = replace(HOST, memory_available=int(64 * GB), cpu_bf16=False)
    roomy = plan(no_bf16)
    assert roomy["quantize_dtype"]["dtype"] == "float32"
    gptq, awq = _stage(roomy, "quantize/gptq-int4"), _stage(roomy, "quantize/awq")
    assert gptq["note"].startswith("float32 arithmetic") and awq["note"].startswith("bfloat16 arithmetic")
    asked_bf16 = plan(no_bf16, "bfloat16")
    assert asked_bf16["quantize_dtype"] == {"dtype": "bfloat16", "why": "asked for", "formats": ["gptq-int4"]}
    gptq_bf16 = _stage(asked_bf16, "quantize/gptq-int4")
    assert gptq_bf16["seconds"] > 3 * gptq["seconds"]
    # float32 weights and the mapped bf16 checkpoint partly resident beside them (5 bytes a weight), against bf16
    # quantized from GPTQModel's disk offload, which never holds the whole model (all of it would be 2 bytes a weight)
    difference = gptq["peak_rss_bytes"] - gptq_bf16["peak_rss_bytes"]
    assert 3 * QWEN_7B.parameters < difference < 5 * QWEN_7B.parameters
    # 32 GB holds GPTQ of the 7B model in bf16 (15 GB of weights) but not in float32 (30 GB): bf16, and it fits.
    tight = plan(replace(no_bf16, memory_available=int(32 * GB)))
    assert tight["quantize_dtype"]["dtype"] == "bfloat16" and "not fit" in tight["quantize_dtype"]["why"]
    assert _stage(tight, "quantize/gptq-int4")["peak_rss_bytes"] < 32 * GB
    # A CPU with bf16 instructions and a GPU keep bf16, at the float32 rate of a token.
    native = plan(replace(no_bf16, cpu_bf16=True))
    assert native["quantize_dtype"]["dtype"] == "bfloat16"
    assert _stage(native, "quantize/gptq-int4")["seconds"] == pytest.approx(gptq["seconds"])
    # The quantizer runs in a child beside the build process: the host holds both while it runs, and nothing of
    # the quantizer's library is left in the build process for later stages.
    base = _stage(roomy, "tokens")["peak_rss_bytes"]
    assert gptq["peak_rss_bytes"] == base + gptq["child_rss_bytes"] and gptq["note"].endswith("child process")
    gguf_only = make_resource_plan(QWEN_7B, _inputs(), HOST)
    assert _stage(roomy, "card")["peak_rss_bytes"] == _stage(gguf_only, "card")["peak_rss_bytes"]
    cuda_inputs = replace(_inputs(formats, "cuda:0", 128 * 512), follows_dtype=frozenset({"gptq-int4"}))
    assert quantize_dtype(QWEN_7B, cuda_inputs, no_bf16)[0] == "bfloat16"


def test_cpu_bf16_instructions_are_read_from_the_cpu_flags(tmp_path):
    from quantforge.device import cpu_multiplies_bf16

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    assert cpu_multiplies_bf16(cpuinfo) is False
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n")
    assert cpu_multiplies_bf16(cpuinfo) is True
    assert cpu_multiplies_bf16(tmp_path / "absent") is None


def test_a_quantize_dtype_that_is_not_one_of_the_three_is_one_line(tiny_llama, tmp_path):
    out = tmp_path / "run"
    result = quantforge_cli("build", str(tiny_llama), "--formats", "gptq-int4", "--quantize-dtype", "fp8", "--out",
                            str(out))  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (  # click.Choice's own line
        "Error: Invalid value for '--quantize-dtype': 'fp8' is not one of 'auto', 'bfloat16', 'float32'."
    )
    assert not out.exists()


def test_mlx_formats_are_planned_on_the_cpu_even_when_the_build_uses_a_gpu():
    """mlx runs on no NVIDIA GPU (its Linux build is the CPU's): a --device cuda build plans its converter and its
    evaluation in host memory, and a 7B's evaluation in mlx's slow CPU products takes far longer than llama.cpp's."""
    formats = (("mlx-4bit", "mlx", 4.5), ("gguf-q4km", "gguf", 4.89))
    plan = make_resource_plan(QWEN_7B, _inputs(formats, "cuda:0"), HOST)
    for key in ("quantize/mlx-4bit", "evaluate/mlx-4bit"):
        assert _stage(plan, key)["vram_bytes"] == 0
        assert _stage(plan, key)["child_rss_bytes"] > QWEN_7B.parameters * 4.5 / 8  # the folder's weights, in RAM
    assert _stage(plan, "evaluate/mlx-4bit")["seconds"] > 10 * _stage(plan, "evaluate/gguf-q4km")["seconds"]
