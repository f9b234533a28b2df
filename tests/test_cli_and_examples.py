"""The README's entry points run as a user runs them: the `shardplus` command with the shipped configs, and
the example script with `strategy="shardplus"` (Lightning's popen launcher, which re-runs the command)."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _models import in_external_ranks
from lightning.pytorch.strategies import StrategyRegistry

from lightning_shardplus.cli import shardplus_names

ROOT = Path(__file__).resolve().parents[1]


def run(args, cwd, timeout=240):
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def shardplus(*args, cwd):
    return run([sys.executable, "-m", "lightning_shardplus.cli", *args], cwd=cwd)


def parse_only(capsys, monkeypatch, cwd, *args) -> tuple[int, str, str]:
    """The `shardplus` command in this process where it only parses (``--help``, ``--print_config``, a refused
    value): its exit code, standard output and standard error."""
    from lightning_shardplus import cli

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["shardplus"])  # as the command's own process has it (not pytest's arguments)
    with pytest.raises(SystemExit) as exited:
        cli.main(list(args))
    output = capsys.readouterr()
    return exited.value.code, output.out, output.err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config", ["digits.yaml", "synthetic.yaml", "large_batch.yaml"])  # stream.yaml: below
@pytest.mark.compat
def test_shipped_configs_fit_on_two_processes(tmp_path, config):
    shardplus(
        "fit",
        "--config",
        str(ROOT / "configs" / config),
        "--trainer.max_steps=6",
        "--trainer.log_every_n_steps=1",
        cwd=tmp_path,
    )
    metrics = list(tmp_path.glob("lightning_logs/*/version_0/metrics.csv"))
    assert metrics, "the config's CSVLogger wrote no metrics"


@pytest.mark.timeout(120)
def test_print_config_round_trips(tmp_path, capsys, monkeypatch):
    printed = parse_only(capsys, monkeypatch, tmp_path, "fit", "--config", str(ROOT / "configs" / "digits.yaml"),
                         "--print_config")[1]  # fmt: skip
    config = yaml.safe_load(printed)
    assert config["trainer"]["strategy"]["class_path"] == "lightning_shardplus.ShardPlusStrategy"
    assert config["trainer"]["strategy"]["init_args"]["shard_padding"] == "first"
    assert config["data"]["init_args"]["global_batch_size"] == 64
    (tmp_path / "printed.yaml").write_text(printed)
    again = parse_only(capsys, monkeypatch, tmp_path, "fit", "--config", "printed.yaml", "--print_config")[1]
    assert yaml.safe_load(again) == config


@pytest.mark.timeout(120)
def test_strategy_defaults_to_shardplus_and_strategy_options_parse(tmp_path, capsys, monkeypatch):
    _, printed, _ = parse_only(
        capsys, monkeypatch, tmp_path, "fit", "--model=lightning_shardplus.demo.ClassifierModule",
        "--data=lightning_shardplus.SyntheticDataModule", "--print_config",
    )  # fmt: skip
    strategy = yaml.safe_load(printed)["trainer"]["strategy"]  # the class, so that its options apply
    assert strategy["class_path"] == "lightning_shardplus.ShardPlusStrategy"
    assert strategy["init_args"]["start_method"] == "popen"  # what the name "shardplus" gives
    helped = parse_only(capsys, monkeypatch, tmp_path, "fit", "--help")[1]
    strategy_help = helped[helped.index("--trainer.strategy STRATEGY\n") :].split("--trainer.devices")[0]
    strategy_help = " ".join(strategy_help.split())
    default = "default: {'class_path': 'lightning_shardplus.ShardPlusStrategy'}"
    assert default in strategy_help and "auto" not in strategy_help  # one truthful default
    code, _, error = parse_only(
        capsys, monkeypatch, tmp_path, "fit", "--config", str(ROOT / "configs" / "digits.yaml"),
        "--trainer.strategy.init_args.shard_padding=zeros", "--print_config",
    )  # fmt: skip
    assert code != 0 and "shard_padding" in error


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("overrides", "message"), [
    (
        ["--trainer.strategy=lightning_shardplus.ShardPlusStrategy", "--trainer.strategy.aggregation_frequency=0"],
        "`aggregation_frequency`=0 is not valid",
    ),
    (["--data.init_args.global_batch_size=0"], "`global_batch_size`=0 is not valid"),
])
def test_a_value_our_classes_refuse_in_a_config_is_a_usage_error_naming_it(tmp_path, capsys, monkeypatch,
                                                                        overrides, message):
    from lightning_shardplus import cli

    monkeypatch.chdir(tmp_path)
    config = ["fit", "--config", str(ROOT / "configs" / "synthetic.yaml"), *overrides]
    with pytest.raises(SystemExit) as exited:
        cli.main(config)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"error: {message}" in error and "Traceback" not in error and "Union subtypes" not in error


def print_config(capsys, monkeypatch, tmp_path, *args):
    from lightning_shardplus import cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.main(["fit", *args, "--print_config"])
    output = capsys.readouterr()
    assert exited.value.code == 0, output.err
    return yaml.safe_load(output.out)["trainer"]["strategy"]


@pytest.mark.timeout(120)
def test_strategy_options_on_the_command_line_apply_over_the_default_and_a_config_naming_the_strategy(
    tmp_path, capsys, monkeypatch
):
    # jsonargparse took `--trainer.strategy.<option>` only on a class: "Expected a dot import path string: shardplus"
    option = "--trainer.strategy.aggregation_frequency=2"
    synthetic = ROOT / "configs" / "synthetic.yaml"
    configured = print_config(capsys, monkeypatch, tmp_path, "--config", str(synthetic), option)
    assert "strategy: shardplus\n" in synthetic.read_text()
    assert configured["class_path"] == "lightning_shardplus.ShardPlusStrategy"
    assert configured["init_args"]["aggregation_frequency"] == 2 and configured["init_args"]["start_method"] == "popen"
    default = print_config(
        capsys, monkeypatch, tmp_path, "--model=lightning_shardplus.demo.ClassifierModule",
        "--data=lightning_shardplus.SyntheticDataModule", option,
    )  # fmt: skip
    assert default == configured
    spawn = tmp_path / "spawn.yaml"  # each registered name is the class with that name's arguments
    spawn.write_text(synthetic.read_text().replace("strategy: shardplus", "strategy: shardplus_spawn"))
    named = print_config(capsys, monkeypatch, tmp_path, "--config", str(spawn), option)["init_args"]
    assert named["start_method"] == "spawn" and named["aggregation_frequency"] == 2
    # the name given on the command line, then an option under it: the error says what to give instead
    from lightning_shardplus import cli

    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", str(spawn), "--trainer.strategy=shardplus", option, "--print_config"])
    error = capsys.readouterr().err
    assert "is the name 'shardplus': options under it need its class" in error
    assert "--trainer.strategy=lightning_shardplus.ShardPlusStrategy" in error


@pytest.mark.timeout(120)
def test_the_strategy_help_starts_with_a_whole_sentence(tmp_path, capsys, monkeypatch):
    # jsonargparse titles the strategy's options with the docstring's first line: it was cut ("... Determined and:")
    from lightning_shardplus import ShardPlusStrategy, cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        cli.main(["fit", "--trainer.strategy.help", "lightning_shardplus.ShardPlusStrategy"])
    lines = capsys.readouterr().out.splitlines()
    title = lines[lines.index("Help for --trainer.strategy.help=lightning_shardplus.ShardPlusStrategy") + 2]
    first, second = ShardPlusStrategy.__doc__.splitlines()[:2]
    assert first.endswith(".") and not second.strip()  # the first paragraph: one line, one sentence
    assert title == f"{first[:-1]}:", title  # (jsonargparse drops the period)


def strategy_help(capsys, monkeypatch, tmp_path, *args):
    """What `shardplus fit <args>` prints, for a help that exits with status 0."""
    from lightning_shardplus import cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.main(["fit", *args])
    output = capsys.readouterr()
    assert exited.value.code == 0, output.err
    return output.out


def described_options(printed):
    """Each `--trainer.strategy.<option>` of a strategy's help, with its description (jsonargparse's text before the
    "(type: ...)" it adds)."""
    blocks = re.findall(r"^  --trainer\.strategy\.(\w+)(?= |$)[^\n]*\n((?: {10,}[^\n]*\n)*)", printed, re.MULTILINE)
    return {option: " ".join(block.split()).partition("(type:")[0].strip() for option, block in blocks}


def init_arguments(strategy):
    return [name for name, parameter in inspect.signature(strategy.__init__).parameters.items()
            if name != "self" and parameter.kind is not parameter.VAR_KEYWORD]  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", shardplus_names())
def test_the_strategy_help_of_each_registered_name_lists_its_options_with_descriptions(
    tmp_path, capsys, monkeypatch, name
):
    # jsonargparse knew class paths only: "--trainer.strategy.help: Expected a dot import path string: shardplus"
    printed = strategy_help(capsys, monkeypatch, tmp_path, "--trainer.strategy.help", name)
    entry = StrategyRegistry[name]
    header = f"Help for --trainer.strategy.help=lightning_shardplus.{entry['strategy'].__name__} "
    assert header in " ".join(printed.split())  # (the help wraps a long header)
    described = described_options(printed)
    undescribed = [argument for argument in init_arguments(entry["strategy"]) if not described.get(argument)]
    assert described and not undescribed, undescribed  # every argument listed, with a description
    settings = ", ".join(f"{key}={value!r}" for key, value in entry["init_params"].items())
    assert printed.startswith(f"{name!r} is {entry['strategy'].__name__} with {settings}.\n")
    assert printed == strategy_help(capsys, monkeypatch, tmp_path, f"--trainer.strategy.help={name}")


@pytest.mark.timeout(120)
def test_the_strategy_help_without_a_name_says_which_names_it_takes_and_shows_the_defaults(
    tmp_path, capsys, monkeypatch
):
    from lightning_shardplus import cli

    printed = strategy_help(capsys, monkeypatch, tmp_path, "--trainer.strategy.help")  # was Lightning's base Strategy
    pointer = " ".join(printed.split("usage:")[0].split())
    assert pointer.startswith("--trainer.strategy.help takes a registered strategy name (shardplus, shardplus_spawn")
    assert "shardplus_model_parallel" in pointer and pointer.endswith("The default strategy's options:")
    assert "Help for --trainer.strategy.help=lightning_shardplus.ShardPlusStrategy\n" in printed
    with pytest.raises(SystemExit):  # a name no strategy has: the error says what the option takes
        cli.main(["fit", "--trainer.strategy.help", "shardplus_ddp"])
    error = " ".join(capsys.readouterr().err.split())
    assert "--trainer.strategy.help takes a registered strategy name (shardplus," in error
    assert "options under it need its class" not in error


@pytest.mark.timeout(120)
def test_print_config_shows_the_autotune_defaults_the_reference_and_docstring_state(tmp_path, capsys, monkeypatch):
    from lightning_shardplus import ShardPlusStrategy, cli

    monkeypatch.chdir(tmp_path)
    strategy = [
        "--trainer.strategy=lightning_shardplus.ShardPlusStrategy",
        "--trainer.strategy.auto_tune_tensor_fusion=true",
    ]
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", str(ROOT / "configs" / "synthetic.yaml"), *strategy, "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]["init_args"]
    reference = (ROOT / "docs" / "arguments.md").read_text().splitlines()  # the one options reference
    rows = [line.split(" | ") for line in reference if line.startswith("| `auto")]
    readme = {name.strip("| `"): (default, meaning) for name, default, _, meaning, _ in rows}
    docstring = ShardPlusStrategy.__doc__
    for name in [name for name in printed if name.startswith("autotune_")]:
        default, meaning = readme[name]
        assert default == f"`{printed[name]!r}`", name  # the reference's default is the printed one, nothing else
        if printed[name] is None:  # and says what None means, as the docstring does
            assert "`None`:" in meaning, name
            assert re.search(rf"{name}: [^\n]*\n?[^\n]*None", docstring), name
    fusion_page = (ROOT / "docs" / "fusion-autotuning.md").read_text()
    assert "`autotune_candidates_mb: null`" in fusion_page
    assert "gradient bytes divided by 2, 4, 8 and 16" in fusion_page


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flag", [[], ["--instance"]])
def test_example_script_trains_with_the_strategy_string_or_instance(tmp_path, flag):
    result = run([sys.executable, str(ROOT / "examples" / "train_digits.py"), "--max-steps=8", *flag], cwd=tmp_path)
    assert "final metrics" in result.stdout


@pytest.mark.timeout(300)
def test_digits_config_reaches_90_percent_validation_accuracy(tmp_path):
    result = shardplus("fit", "--config", str(ROOT / "configs" / "digits.yaml"), cwd=tmp_path)
    # a person reads how the fit ended: the final metrics, on rank 0 only
    assert result.stdout.count("fit ended after 15 epochs") == 1
    printed = dict(line.split() for line in result.stdout.splitlines() if line.startswith(("val_acc ", "val_loss ")))
    assert float(printed["val_acc"]) >= 0.90
    rows = (tmp_path / "lightning_logs/digits/version_0/metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    accuracies = [
        float(r.split(",")[header.index("val_acc")]) for r in rows[1:] if r.split(",")[header.index("val_acc")]
    ]
    assert accuracies[-1] >= 0.90


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("policy", "steps"), [("join", 31)])  # "drop": tests/test_uneven.py
def test_stream_example_takes_the_same_steps_on_every_rank(tmp_path, policy, steps):
    pytest.importorskip("litdata")
    script = str(ROOT / "examples" / "train_stream.py")
    result = run([sys.executable, script, "--max-epochs=1", f"--uneven-inputs={policy}"], cwd=tmp_path)
    # the ranks print concurrently: their lines may run together
    reports = re.findall(r"rank (\d): (\d+) batches of its own in the last epoch; (\d+) steps in all", result.stdout)
    assert sorted(rank for rank, _, _ in reports) == ["0", "1", "2"], result.stdout
    assert {int(taken) for _, _, taken in reports} == {steps}
    own = sorted(int(count) for _, count, _ in reports)
    assert own == ([30, 30, 31] if policy == "join" else [30, 30, 30])  # litdata's uneven streams
    assert "final metrics" in result.stdout


def _validate_twice() -> None:
    from lightning_shardplus import cli

    sys.argv = ["shardplus"]  # this forked rank's own
    for _ in range(2):
        cli.main(["validate", "--config", str(ROOT / "configs" / "digits.yaml"), "--trainer.logger=false"])


@pytest.mark.timeout(180)
def test_a_second_run_without_a_logger_in_the_same_directory_runs(tmp_path):
    # without a logger the CLI saves its config.yaml in the working directory; Lightning's default refuses a second run.
    # Both runs in each of the config's 2 ranks (forks that Lightning finds started)
    in_external_ranks(_validate_twice, world_size=2, timeout=150, cwd=tmp_path)
    assert (tmp_path / "config.yaml").exists()


@pytest.mark.timeout(120)
def test_the_help_says_what_the_command_is_and_offers_the_user_facing_callbacks(tmp_path, capsys, monkeypatch):
    top = " ".join(parse_only(capsys, monkeypatch, tmp_path, "--help")[1].split())
    assert "`shardplus` strategy by default" in top and "`shardplus fit --trainer.strategy.help shardplus`" in top
    fit = " ".join(parse_only(capsys, monkeypatch, tmp_path, "fit", "--help")[1].split())
    strategy_help = fit[fit.index("--trainer.strategy STRATEGY Supports") :].split("--trainer.devices")[0]
    assert "The default strategy's options: --trainer.strategy.help shardplus." in strategy_help
    assert "Show the options of a strategy and exit: it takes a registered strategy name (shardplus," in fit
    callbacks = fit[fit.index("--trainer.callbacks CALLBACKS, --trainer.callbacks+") :].split("--trainer.fast_dev")[0]
    callbacks = callbacks.replace(" ", "")  # the help wraps long class paths
    assert "lightning_shardplus.ScaleLearningRate" in callbacks  # offered by its public path
    assert "CommunicationHookWrapper" not in callbacks  # a base class to subclass, not a callback to add
    assert "AverageTrainingMetrics" not in callbacks and "ExactEvaluation" not in callbacks  # the strategy adds them
