"""Task accuracy through lm-evaluation-harness, with task definitions as YAML under ``evals/tasks/``.

Each definition is an lm-eval task config plus a ``quantforge`` section (the data file it reads, the fields every
row must have, the metric the card reports). Data comes from local files (``--tasks-data DIR``): lm-eval's built-in
tasks for some of these sets reach the Hub and fail offline.

Every format is scored through the same adapter: an lm-eval ``LM`` whose log-likelihoods come from the artifact's
own runtime (``LogitsRunner.logits``: llama.cpp for GGUF, the dequantized torch model for GPTQ/AWQ/INT8, the float
model for the reference). So a task's accuracy differs between formats only through the weights. Generation tasks
(``output_type: generate_until``, e.g. ``gsm8k``) decode greedily through the same runner and compare the extracted
answer with the reference answer; perplexity can hide what they show (a model that still predicts text well may
no longer carry a multi-step answer through).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
from pathlib import Path

import numpy as np
import yaml

from .errors import QuantforgeError
from .evaluate import last_logits, log_softmax
from .logs import capture_output
from .paths import find_definitions

DEFAULT_TASKS = ("arc_easy", "hellaswag", "piqa", "winogrande", "lambada")


def known_tasks() -> dict[str, Path]:
    return find_definitions("evals/tasks")


def task_definition(name: str) -> dict:
    tasks = known_tasks()
    if name not in tasks:
        raise QuantforgeError(f"unknown task '{name}'; known tasks: {', '.join(sorted(tasks))}")
    return yaml.safe_load(tasks[name].read_text())


def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def data_file(name: str, data_dir: Path | None) -> Path:
    """The task's data file, checked row by row (a malformed row is named by file and line)."""
    definition = task_definition(name)["quantforge"]
    if data_dir is None:
        raise QuantforgeError(
            f"task '{name}' reads a local file ({definition['data_file']}): pass --tasks-data DIR, the folder that "
            "holds it"
        )
    path = Path(data_dir) / definition["data_file"]
    if not path.exists():
        raise QuantforgeError(f"task '{name}' needs {path}, which does not exist")
    with _open(path) as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise QuantforgeError(f"{path}:{line_number} is not valid JSON") from None
            missing = [f for f in definition["fields"] if not isinstance(row, dict) or f not in row]
            if missing:
                raise QuantforgeError(f"{path}:{line_number} lacks the field '{missing[0]}' that task '{name}' reads")
    return path


def write_task_configs(names: list[str], data_dir: Path | None, out_dir: Path) -> dict[str, str]:
    """lm-eval YAML files for ``names`` with their data paths filled in; returns task name -> lm-eval task name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    mapping = {}
    for name in names:
        config = task_definition(name)
        config.pop("quantforge")
        config["dataset_kwargs"] = {"data_files": {"test": str(data_file(name, data_dir).resolve())}}
        (out_dir / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        mapping[name] = config["task"]
    return mapping


def make_runner_lm(runner, tokenizer, max_length: int, on_request=None):
    """An lm-eval LM over a quantforge LogitsRunner (log-likelihood requests only); ``on_request(done, total)``
    follows its progress."""
    from lm_eval.api.model import LM

    class RunnerLM(LM):
        def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
            # As lm-eval's HF model does: encode the whole string, then split off the continuation, so that
            # tokens that straddle the boundary are tokenized as the model would see them.
            spaces = len(context) - len(context.rstrip())
            if spaces:
                continuation, context = context[-spaces:] + continuation, context[:-spaces]
            whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
            context_ids = tokenizer(context, add_special_tokens=False)["input_ids"] if context else []
            if not context_ids:
                prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
                return [prefix], whole
            return whole[: len(context_ids)], whole[len(context_ids) :]

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            results = []
            for index, request in enumerate(requests):
                if on_request:
                    on_request(index, len(requests))
                context_ids, continuation_ids = self._encode_pair(*request.args)
                tokens = (context_ids + continuation_ids)[-(max_length + 1) :]
                scored = last_logits(runner, np.asarray(tokens[:-1], dtype=np.int32), len(continuation_ids))
                logp = log_softmax(scored)
                targets = np.asarray(continuation_ids)
                total = float(logp[np.arange(len(targets)), targets].sum())
                greedy = bool((scored.argmax(axis=-1) == targets).all())
                results.append((total, greedy))
            return results

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise QuantforgeError("rolling log-likelihood tasks are not supported; use the perplexity stage")

        def generate_until(self, requests, disable_tqdm: bool = False):
            outputs = []
            for index, request in enumerate(requests):
                if on_request:
                    on_request(index, len(requests))
                context, settings = request.args
                outputs.append(greedy_generate(runner, tokenizer, context, settings, max_length))
            return outputs

    return RunnerLM()


def greedy_generate(runner, tokenizer, context: str, settings: dict, max_length: int) -> str:
    """Greedy continuation of ``context`` in the runner's own runtime until a stop string, EOS or
    ``max_gen_toks``. Each step scores the whole sequence again (no KV cache: the same LogitsRunner every format
    has), which is slow for long generations but identical in every runtime. The text is only compared with the
    answer; nothing generated is ever executed."""
    if settings.get("do_sample"):
        raise QuantforgeError("generation tasks are scored greedily: set do_sample: false in the task")
    until = settings.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    prompt = tokenizer(context)["input_ids"]  # with BOS where the model's tokenizer adds it, as a user's prompt
    generated: list[int] = []
    for _ in range(int(settings.get("max_gen_toks", 256))):
        window = (prompt + generated)[-max_length:]
        next_id = int(last_logits(runner, np.asarray(window, dtype=np.int32), 1)[-1].argmax())
        if next_id == tokenizer.eos_token_id:
            break
        generated.append(next_id)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        stops = [text.index(stop) for stop in until if stop and stop in text]
        if stops:
            return text[: min(stops)]
    return tokenizer.decode(generated, skip_special_tokens=True)


def run_task(
    runner,
    tokenizer_dir: Path,
    name: str,
    data_dir: Path | None,
    limit: int | None,
    work_dir: Path,
    max_length: int = 2048,
    log_path: Path | None = None,
    on_request=None,
) -> dict:
    """Score one task; return accuracy, its standard error and how it was measured.

    lm-eval's own logging and tqdm bars go to ``log_path``; ``on_request(done, total)`` reports progress.
    """
    import lm_eval
    from transformers import AutoTokenizer

    definition = task_definition(name)["quantforge"]
    configs = work_dir / "lm-eval-tasks" / name
    mapping = write_task_configs([name], data_dir, configs)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = make_runner_lm(runner, tokenizer, max_length, on_request)
    with capture_output(log_path) if log_path else contextlib.nullcontext():
        results = _evaluate(model, mapping[name], configs, limit)
    scores = results["results"][mapping[name]]
    metric = definition["metric"]
    keep = definition.get("filter", "none")  # generation tasks name the filter that extracts the answer
    value = scores[f"{metric},{keep}"]
    stderr = scores.get(f"{metric}_stderr,{keep}")
    samples = results.get("n-samples", {}).get(mapping[name], {}).get("effective")
    return {
        "task": name,
        "metric": metric,
        "value": float(value),
        "stderr": float(stderr) if isinstance(stderr, (int, float)) and not math.isnan(stderr) else None,
        "samples": samples,
        "limit": limit,
        "data": definition["data_file"],
        "lm_eval_version": lm_eval.__version__ if hasattr(lm_eval, "__version__") else None,
    }


def _evaluate(model, task: str, configs: Path, limit: int | None) -> dict:
    """lm-eval on one task from quantforge's generated configs, seeded, without its built-in tasks."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        tasks=[task],
        task_manager=TaskManager(include_path=str(configs), include_defaults=False),
        limit=limit,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
        log_samples=False,
    )
