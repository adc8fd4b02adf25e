"""Build settings come from one table (quantforge.settings.SETTINGS): every row is a command-line option, a recipe
key and a release key at once, and reaches the plan with the command line first, then the recipe, then the default."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import yaml
from conftest import TASKS_DATA, quantforge_cli

from quantforge.cli import build as build_command
from quantforge.pipeline import BuildRequest, make_plan
from quantforge.release import build_request, load_release
from quantforge.settings import SETTINGS

# A value for each setting that differs from its default and that planning accepts without any download.
SAMPLE = {
    "revision": "v1.0",
    "formats": ["gguf-q4km"],
    "backends": ["llamacpp"],
    "eval_text": "pydoc",
    "ppl_context": 256,
    "ppl_windows": 3,
    "ppl_scoring": "second-half",
    "threads": 1,
    "tasks": ["arc_easy"],
    "tasks_data": TASKS_DATA,
    "limit": 5,
    "kv_cache": ["q8_0"],
    "speed": False,
    "prompt_tokens": 32,
    "gen_tokens": 8,
    "calibration": "wikitext2-train",
    "calib_samples": 4,
    "calib_seqlen": 64,
    "calib_seed": 3,
    "group_size": "auto",
    "act_order": True,
    "layer_resume": True,
    "quantize_dtype": "float32",
    "allow_pickle": True,
    "trust_remote_code": True,
    "device": "cpu",
}


def test_the_samples_cover_every_setting():
    assert set(SAMPLE) == {s.name for s in SETTINGS}
    assert all(SAMPLE[s.name] != s.default for s in SETTINGS)


def test_every_setting_with_a_flag_is_a_build_option_named_after_it():
    options = {param.name: param for param in build_command.params}
    unset = build_command.make_context("build", ["some-model"]).params
    for setting in SETTINGS:
        if setting.flag:
            assert setting.name in options, setting.name
            assert setting.flag.split("/")[0] in options[setting.name].opts, setting.name
            assert unset[setting.name] is None, setting.name  # not given: the recipe's value or the default applies


def test_build_help_lists_every_option_under_a_section():
    from click.testing import CliRunner

    from quantforge.cli import HELP_SECTIONS

    sectioned = {name for names in HELP_SECTIONS.values() for name in names}
    options = {param.name for param in build_command.params if isinstance(param, click.Option)}
    assert options <= sectioned, options - sectioned
    shown = CliRunner().invoke(build_command, ["--help"]).output
    headings = [line.rstrip(":") for line in shown.splitlines() if line and not line.startswith(" ")]
    assert headings[-len(HELP_SECTIONS) :] == list(HELP_SECTIONS) and "Other options" not in shown


def _as_file_mapping(values: dict) -> dict:
    """The nested recipe/release form of name -> value, from the table's keys."""
    mapping: dict = {}
    for setting in SETTINGS:
        if setting.key is None or setting.name not in values:
            continue
        *sections, leaf = setting.key.split(".")
        node = mapping
        for section in sections:
            node = node.setdefault(section, {})
        value = values[setting.name]
        node[leaf] = str(value) if isinstance(value, Path) else value
    return mapping


def test_a_recipe_sets_every_file_setting_and_the_command_line_wins(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": "org/model", **_as_file_mapping(SAMPLE)}))
    plan = make_plan(BuildRequest(model=None, recipe_file=recipe, out=tmp_path / "run"))
    for setting in SETTINGS:
        expected = SAMPLE[setting.name] if setting.key else setting.default
        assert plan.settings[setting.name] == expected, setting.name
    assert plan.spec.revision == "v1.0" and plan.calibration.seed == 3 and plan.eval.context == 256
    assert plan.tasks["limit"] == 5 and plan.speed is None and plan.quantize["group_size"] == "auto"
    given = BuildRequest(model=None, recipe_file=recipe, out=tmp_path / "run", settings={"ppl_windows": 9})
    assert make_plan(given).eval.windows == 9
    assert make_plan(BuildRequest(model="org/model", out=tmp_path / "run")).settings["ppl_windows"] == 16


def test_a_release_sets_every_file_setting(tmp_path):
    release_file = tmp_path / "release.yaml"
    release_file.write_text(yaml.safe_dump({"models": [{"model": "org/model", **_as_file_mapping(SAMPLE)}]}))
    release = load_release(release_file)
    plan = make_plan(build_request(release, release.models[0]))
    for setting in SETTINGS:
        expected = SAMPLE[setting.name] if setting.key else setting.default
        assert plan.settings[setting.name] == expected, setting.name


@pytest.mark.parametrize("where", ["recipe", "release"])
def test_allow_pickle_cannot_come_from_a_file(tmp_path, where):
    bad = {"model": "org/model", "allow_pickle": True}
    path = tmp_path / f"{where}.yaml"
    path.write_text(yaml.safe_dump(bad if where == "recipe" else {"models": [bad]}))
    from quantforge.errors import QuantforgeError

    with pytest.raises(QuantforgeError, match=r"unknown key '(models\[0\]\.)?allow_pickle'"):
        make_plan(BuildRequest(model=None, recipe_file=path)) if where == "recipe" else load_release(path)


@pytest.mark.parametrize(
    "body, line",
    [
        ("eval:\n  scoring: half\n", "error: --ppl-scoring (eval.scoring in a recipe or release file) must be one of "
         "all, second-half, not 'half'"),
        ("calibration:\n  seqlen: 4\n", "error: --calib-seqlen (calibration.seqlen in a recipe or release file) must "
         "be at least 8, not 4"),
    ],
)  # fmt: skip
def test_a_recipe_value_outside_its_settings_row_is_one_line_before_any_work(tmp_path, body, line):
    """The settings table's choices and minimums hold for files as for the command line (where click.Choice
    refuses the value itself)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: bundled:smollm2-135m\n" + body)
    out = tmp_path / "run"
    result = quantforge_cli("build", "--recipe", str(recipe), "--out", str(out))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == line
    assert not out.exists()
