"""``kvcanary simulate``'s options against the engines and modes: every option of the parser is either applied
(it changes what the run would do) or refused with a reason naming it (exit status 2, before anything is written)
in every mode; ``--inject`` rates checked alike everywhere; the help grouped with every default stated; each
engine's model sizes named alike in the help, the docs and the report's config; ``kvcanary info``'s CUDA reason."""

from __future__ import annotations

import argparse
import ctypes
import re
from pathlib import Path

import pytest

from kvcanary_cupy import cli
from kvcanary_cupy.option_scope import MODES, SCOPE, refusals

ROOT = Path(__file__).resolve().parents[1]

#: The arguments that put a run in each mode.
MODE_ARGV = {"synthetic": [], "disaggregated": ["--disaggregated"], "transformers": ["--engine", "transformers"],
             "vllm": ["--engine", "vllm"], "vllm-connector": ["--engine", "vllm", "--connector", "example"]}
#: Options that choose the mode rather than change a run within it.
MODE_OPTIONS = ("--engine", "--disaggregated", "--connector")


def sample(option: str, mode: str, tmp: Path) -> tuple[list[str], list[str]]:
    """(context, argv): arguments that the option needs next to it, and the option with a value other than its
    default. A new option without a sample here fails the walk below."""
    context: list[str] = []
    if option in ("--block-size", "--block-stride"):
        context = ["--layout", "block"]
    if option == "--tier-dir":
        context = ["--tiers", "host,disk"]
    values: dict[str, list[str]] = {
        "--model-size": ["medium"], "--backend": ["numpy"], "--model-arch": ["gemma3"], "--dtype": ["fp16"],
        "--speculative": ["ngram"], "--tensor-parallel": ["2"],
        "--preset": ["prefill" if mode == "disaggregated" else "decode"], "--steps": ["100"],
        "--requests": ["20"], "--seed": ["5"], "--warmup": ["2"], "--cooldown": ["3"], "--layout": ["block"],
        "--block-size": ["8"], "--block-stride": ["32"],
        "--inject": [{"disaggregated": "page-swap", "vllm-connector": "records-missing"}.get(mode, "kv-bitflip")],
        "--sweep-interval": ["3"], "--max-verify-entries": ["4"], "--with-v": [], "--real-kv-hash": ["partial"],
        "--ring-capacity": ["1000"], "--tiers": ["host"], "--tier-dir": [str(tmp)], "--decode-workers": ["3"],
        "--transfer-timeout": ["5"], "--kill-decode-worker": ["1@3"], "--json": [str(tmp / "r.json")],
        "--html": [str(tmp / "r.html")], "--dump-failures": [str(tmp / "dumps")], "--quiet": [], "--plain": []}
    return context, [option, *values[option]]


def simulate_options() -> list[str]:
    sim = cli._subparser(cli.build_parser(), "simulate")
    return [a.option_strings[-1] for a in sim._actions if a.option_strings and a.dest != "help"]


@pytest.fixture
def vllm_version_gate_open(monkeypatch):
    """Lets the vLLM config validate where vLLM is not installed: the walk is about options, not the engine."""
    import kvcanary_cupy.integrations.vllm._version as version

    monkeypatch.setattr(version, "check_version", lambda v=None: "0.32.0")


def plan(argv: list[str]) -> cli.SimulatePlan:
    return cli.plan_simulate(cli.parse(["simulate", *argv]))


def test_every_simulate_option_has_a_scope_entry_with_a_reason_for_every_mode_it_skips():
    options = simulate_options()
    assert sorted(options) == sorted(SCOPE), set(options) ^ set(SCOPE)
    for option, scope in SCOPE.items():
        assert scope.applies, option
        for mode in MODES:
            assert (mode in scope.applies) != bool(scope.why_not.get(mode)), (option, mode)


def test_an_option_missing_from_the_table_is_refused_not_applied():
    assert refusals("synthetic", ["--steps", "--brand-new"]) == [
        "--brand-new has no entry in the option table, so it cannot be applied"]


@pytest.mark.parametrize("mode", MODES)
def test_every_option_is_applied_or_refused_with_a_reason_in_every_mode(mode, tmp_path, capsys,
                                                                        vllm_version_gate_open):
    base = MODE_ARGV[mode]
    assert plan(base).mode == mode
    for option in simulate_options():
        if option in MODE_OPTIONS:
            continue
        context, given = sample(option, mode, tmp_path / "out")
        scope = SCOPE[option]
        if mode in scope.applies:
            before, after = plan([*base, *context]), plan([*base, *context, *given])
            assert after.mode == mode
            assert (after.config, after.output) != (before.config, before.output), f"{option} dropped in {mode}"
        else:
            never = tmp_path / "never.json"
            assert cli.main(["simulate", *base, *context, *given, "--json", str(never)]) == 2, (option, mode)
            err = capsys.readouterr().err
            assert f"{option} " in err and scope.why_not[mode] in err and "Traceback" not in err, err
            assert not never.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--model-arch", "gemma3", "--model-size", "medium"],
     "--model-size medium applies to --model-arch llama only"),
    (["--model-arch", "qwen3-next", "--dtype", "fp32"],
     "--dtype fp32 does not run --model-arch qwen3-next: vLLM's CPU build runs that model kind in bf16 only"),
    (["--model-arch", "gemma3", "--speculative", "draft"],
     "--speculative draft does not run --model-arch gemma3 on vLLM's CPU build: vLLM asserts that all drafting "
     "layers belong to one KV cache group"),
    (["--model-arch", "qwen3-next", "--speculative", "ngram"],
     "--speculative ngram does not run --model-arch qwen3-next on vLLM's CPU build"),
    (["--model-arch", "deepseek-mla", "--speculative", "draft"],
     "--speculative draft does not run --model-arch deepseek-mla on vLLM's CPU build"),
])
def test_vllm_model_options_that_cannot_run_together_are_refused_before_any_engine(argv, message, capsys,
                                                                                   vllm_version_gate_open):
    assert cli.main(["simulate", "--engine", "vllm", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_vllm_model_options_reach_the_run_configuration(vllm_version_gate_open):
    cfg = plan(["--engine", "vllm", "--model-arch", "mistral-sw", "--dtype", "bf16", "--speculative", "draft",
                "--tensor-parallel", "2"]).config
    assert (cfg.model_arch, cfg.dtype, cfg.speculative, cfg.tensor_parallel) == ("mistral-sw", "bf16", "draft", 2)
    assert (plan(["--engine", "vllm"]).config.model_arch, plan(["--engine", "vllm"]).config.dtype) == ("llama", None)


@pytest.mark.parametrize(("argv", "message"), [
    (["--engine", "vllm", "--tiers", "host"], "--tiers does not apply to --engine vllm"),
    (["--engine", "transformers", "--tensor-parallel", "2"], "--tensor-parallel does not apply to --engine "
                                                             "transformers"),
    (["--model-arch", "llama"], "--model-arch does not apply to the synthetic engine"),
    (["--engine", "vllm", "--tier-dir", "x"], "--tier-dir does not apply to --engine vllm"),
    (["--engine", "vllm", "--max-verify-entries", "4"], "--max-verify-entries does not apply to --engine vllm"),
    (["--engine", "vllm", "--kill-decode-worker", "1@2"], "--kill-decode-worker does not apply to --engine vllm"),
    (["--engine", "vllm", "--inject", "kv-bitflip:lots"], "the rate must be a number in (0, 1]"),
    (["--disaggregated", "--max-verify-entries", "4"], "--max-verify-entries does not apply to --disaggregated"),
    (["--engine", "transformers", "--steps", "200"], "--steps does not apply to --engine transformers"),
    (["--engine", "transformers", "--layout", "token"], "--layout does not apply to --engine transformers"),
    (["--decode-workers", "2"], "--decode-workers needs --disaggregated"),
    (["--transfer-timeout", "30"], "--transfer-timeout needs --disaggregated"),
    (["--model-size", "small"], "--model-size does not apply to the synthetic engine"),
])
def test_options_an_engine_or_mode_cannot_apply_are_refused_even_at_their_default_value(argv, message, capsys):
    assert cli.main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("rate", "message"), [
    ("often", "the rate must be a number in (0, 1]"), ("", "the rate must be a number in (0, 1]"),
    ("2", "the rate must be in (0, 1], got 2"), ("0", "the rate must be in (0, 1], got 0"),
    ("-0.5", "the rate must be in (0, 1], got -0.5"), ("nan", "the rate must be in (0, 1], got nan"),
    ("inf", "the rate must be in (0, 1], got inf"), ("1e-320", "the rate must lie in [1e-06, 1]"),
])
def test_a_bad_fault_rate_gets_the_same_message_in_every_mode(mode, rate, message, capsys):
    kind = "page-swap" if mode == "disaggregated" else "kv-bitflip"
    assert cli.main(["simulate", *MODE_ARGV[mode], "--inject", f"{kind}:{rate}"]) == 2
    err = capsys.readouterr().err
    assert f"--inject '{kind}:{rate}': {message}" in err and "Traceback" not in err, err


@pytest.mark.parametrize("mode", ["transformers", "vllm", "vllm-connector"])
def test_an_engine_that_arms_each_kind_once_refuses_a_rate_instead_of_ignoring_it(mode, capsys):
    assert cli.main(["simulate", *MODE_ARGV[mode], "--inject", "wrong-token,kv-bitflip:0.5"]) == 2
    err = capsys.readouterr().err
    name = " ".join(MODE_ARGV[mode][:3])
    assert f"--inject 'kv-bitflip:0.5': a rate does not apply to {name}" in err, err


@pytest.mark.parametrize(("argv", "message"), [
    (["--engine", "vllm", "--disaggregated"],
     "--disaggregated does not apply to --engine vllm: in vLLM it runs through a KV connector: add --connector"),
    (["--connector", "example"], "--connector does not apply to the synthetic engine"),
    (["--disaggregated", "--connector", "example"], "--connector does not apply to --disaggregated"),
    (["--engine", "transformers", "--connector", "example"], "--connector does not apply to --engine transformers"),
    (["--engine", "vllm", "--connector", "example", "--tensor-parallel", "2"],
     "--tensor-parallel does not apply to --engine vllm --connector"),
    (["--engine", "vllm", "--connector", "example", "--model-arch", "llama"],
     "--model-arch does not apply to --engine vllm --connector"),
    (["--engine", "vllm", "--connector", "example", "--disaggregated", "--decode-workers", "1"],
     "--decode-workers does not apply to --engine vllm --connector"),
    (["--engine", "vllm", "--connector", "example", "--tiers", "host"],
     "--tiers does not apply to --engine vllm --connector"),
    (["--engine", "vllm", "--connector", "example", "--inject", "kv-bitflip"],
     "unknown fault kind 'kv-bitflip' for --engine vllm --connector; choose from kv-layout"),
    (["--engine", "vllm", "--connector", "lmcache"], "argument --connector: invalid choice: 'lmcache'"),
])
def test_connector_options_are_refused_outside_a_vllm_connector_run_and_its_misfits_inside(
        argv, message, capsys, tmp_path, vllm_version_gate_open):
    never = tmp_path / "never.json"
    assert cli.main(["simulate", *argv, "--json", str(never)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not never.exists()


def test_a_connector_run_takes_the_producer_consumer_workload_with_disaggregated_and_every_connector_fault_with_all(
        vllm_version_gate_open):
    from kvcanary_cupy.integrations.vllm.simulate_connector import CONNECTOR_FAULT_KINDS

    plain = plan(MODE_ARGV["vllm-connector"])
    split = plan([*MODE_ARGV["vllm-connector"], "--disaggregated", "--inject", "all"])
    assert plain.mode == split.mode == "vllm-connector"
    assert (plain.config.workload.save_role, plain.config.workload.load_role) == ("kv_both", "kv_both")
    assert (split.config.workload.save_role, split.config.workload.load_role) == ("kv_producer", "kv_consumer")
    assert plain.config.inject == () and split.config.inject == tuple(CONNECTOR_FAULT_KINDS) and \
        len(split.config.inject) == 10


def test_a_connector_run_hands_the_canary_options_to_every_engine_process(vllm_version_gate_open):
    cfg = plan([*MODE_ARGV["vllm-connector"], "--ring-capacity", "777", "--sweep-interval", "5",
                "--real-kv-hash", "partial", "--backend", "numpy"]).config
    assert cfg.canary_env() == {"KVCANARY_VLLM_REAL_KV_HASH": "partial", "KVCANARY_VLLM_BACKEND": "numpy",
                                "KVCANARY_VLLM_SWEEP_INTERVAL": "5", "KVCANARY_VLLM_RING_CAPACITY": "777"}
    from kvcanary_cupy import settings

    for name, value in cfg.canary_env().items():  # each one a value the plugin takes
        assert not settings.problems({name: value}), name


def test_rates_and_comma_lists_reach_the_synthetic_and_disaggregated_configs():
    assert plan(["--inject", "kv-bitflip:0.5,wrong-token", "--inject", "double-alloc:1"]).config.inject == {
        "kv-bitflip": 0.5, "wrong-token": 0.03, "double-alloc": 1.0}
    assert plan(["--disaggregated", "--inject", "page-swap:0.25,page-drop"]).config.inject == {
        "page-swap": 0.25, "page-drop": 0.03}


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_engine_runs_hand_the_canary_options_to_install(engine, monkeypatch, vllm_version_gate_open):
    import importlib

    simulate = importlib.import_module(f"kvcanary_cupy.integrations.{engine}.simulate")
    seen = []

    class Installed(Exception):
        pass

    def install(target, opts):
        seen.append(opts)
        raise Installed

    monkeypatch.setattr(simulate, "install", install)
    extra = ["--max-verify-entries", "6"] if engine == "transformers" else []
    cfg = plan(["--engine", engine, "--ring-capacity", "777", "--sweep-interval", "5", "--real-kv-hash", "partial",
                "--backend", "numpy", *extra]).config
    sim_class = simulate.TransformersSimulation if engine == "transformers" else simulate.VllmSimulation
    with pytest.raises(Installed):
        sim_class(cfg)._run(None, None, None, 0, None)
    (opts,) = seen
    assert (opts.ring_capacity, opts.sweep_interval, opts.real_kv_hash, opts.backend) == (777, 5, "partial", "numpy")
    if engine == "transformers":
        assert opts.max_verify_entries_per_step == 6


def test_the_help_is_grouped_and_every_option_states_its_default():
    sim = cli._subparser(cli.build_parser(), "simulate")
    groups = {g.title: [a.option_strings[-1] for a in g._group_actions] for g in sim._action_groups}
    assert groups.pop("options") == ["--help"] and groups.pop("positional arguments") == []
    assert [title.split(" ")[0] for title in groups] == ["engine", "workload", "faults", "canary", "tiers",
                                                        "disaggregated", "output"]
    assert sorted(o for options in groups.values() for o in options) == sorted(SCOPE)
    text = sim.format_help()
    for action in sim._actions:
        if action.dest == "help":
            continue
        shown = " ".join(((action.help or "") % {"default": action.default}).split())
        assert re.search(r"\(default: [^)]", shown) or "; default: " in shown, (action.option_strings, shown)
        label = SCOPE[action.option_strings[-1]].label().strip()
        assert shown.endswith(label), (action.option_strings, shown)
    engine_help = next(a.help for a in sim._actions if a.dest == "engine")
    assert all(name in engine_help for name in ("synthetic", "transformers", "vllm"))
    assert "(default: %(default)s)" not in text and "default: 200)" in text


def test_each_engines_model_sizes_are_named_alike_in_the_help_the_config_and_the_docs(vllm_version_gate_open):
    from kvcanary_cupy.integrations.transformers.workloads import MODEL_SIZES as TRANSFORMERS
    from kvcanary_cupy.integrations.vllm.workloads import MODEL_SIZES as VLLM

    sim = cli._subparser(cli.build_parser(), "simulate")
    action = next(a for a in sim._actions if a.dest == "model_size")
    assert list(TRANSFORMERS) == list(VLLM) == list(action.choices)
    shown = " ".join(action.help.split())
    for engine, sizes in (("transformers", TRANSFORMERS), ("vllm", VLLM)):
        for name, dims in sizes.items():
            assert f"{name} (hidden {dims['hidden_size']}, {dims['num_hidden_layers']} layers)" in shown
            # the report's config (and its headline "model <size>") carries the configuration's name
            assert plan(["--engine", engine, "--model-size", name]).config.model_size == name
    for page in ("vllm.md", "transformers.md"):
        text = (ROOT / "docs" / page).read_text()
        named = re.findall(r"--model-size (\w+)", text) + re.findall(r"model (\w+) \([\d.]+M params", text)
        assert named and set(named) <= set(action.choices), (page, named)


def _driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_info_says_plainly_when_there_is_no_nvidia_driver(capsys):
    assert cli.main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("cuda "))
    if _driver_loads():
        assert "no NVIDIA driver" not in line, line
    else:
        assert line.split(None, 1)[1] == "unavailable: no NVIDIA driver found (libcuda.so.1 not loadable)", line


def test_given_options_are_the_typed_ones_not_the_defaults():
    args = cli.parse(["simulate", "--steps", "200", "--with-v", "--inject", "a", "--inject", "b"])
    assert args.given_options == ["--steps", "--inject", "--with-v"]
    assert args.engine == "synthetic" and args.requests == 48  # the defaults are still filled in
    assert isinstance(cli.parse(["info"]), argparse.Namespace)


def test_the_cli_page_lists_every_option_with_the_modes_the_table_applies_it_to():
    rows = {}
    for line in (ROOT / "docs" / "cli.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 + len(MODES) and cells[0].startswith("`--"):
            rows[cells[0].strip("`")] = tuple(mode for mode, cell in zip(MODES, cells[2:], strict=True) if cell == "✓")
    assert rows == {option: scope.applies for option, scope in SCOPE.items()}


JUNK = ["0", "-1", "nan", "inf", "1e300", "", "abc", "99999999999", "1@", "host,tape", "kv-bitflip:0", "all:2"]


@pytest.mark.parametrize("seed", range(8))
def test_random_option_mixes_either_plan_a_run_with_only_applicable_options_or_are_refused_cleanly(
        seed, tmp_path, vllm_version_gate_open):
    import random

    rng = random.Random(seed)
    options = [o for o in simulate_options() if o not in MODE_OPTIONS]
    for _ in range(25):
        mode = rng.choice(MODES)
        argv = list(MODE_ARGV[mode])
        for option in rng.sample(options, rng.randint(1, 4)):
            context, given = sample(option, mode, tmp_path / "out")
            if rng.random() < 0.3 and len(given) == 2:
                given = [option, rng.choice(JUNK)]
            argv += context + given
        try:
            built = plan(argv)
        except cli._UsageError:  # argparse's refusal of a value (status 2 in main)
            continue
        except cli.BadArguments as exc:  # a refusal with its reason (status 2 in main); nothing else escapes
            assert str(exc).strip(), argv
            continue
        typed = cli.parse(["simulate", *argv]).given_options
        assert built.mode == mode and all(mode in SCOPE[o].applies for o in typed), argv
        assert not (tmp_path / "out").exists(), argv  # planning writes nothing


def test_a_connector_run_whose_engine_process_fails_exits_1_saying_why_and_writes_no_report(
        monkeypatch, tmp_path, capsys, vllm_version_gate_open):
    from kvcanary_cupy.integrations.vllm import simulate_connector as sc

    def spawn(spec, timeout=sc.RUN_TIMEOUT_S):
        raise sc.EngineProcessError(f"an engine process ran past {timeout:g} s and was killed")

    monkeypatch.setattr(sc, "spawn_engine", spawn)
    monkeypatch.setattr("kvcanary_cupy.integrations.vllm.workloads.save_llama", lambda folder, size, seed: folder)
    out = tmp_path / "r.json"
    assert cli.main(["simulate", *MODE_ARGV["vllm-connector"], "--quiet", "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert "the connector run failed: an engine process ran past 600 s and was killed" in err, err
    assert "Traceback" not in err and not out.exists()
