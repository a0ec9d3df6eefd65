"""TrainConfig: one source of defaults for SharedTrainer, the gradshare.ml Params, the CLI and the
benchmarks, and one place that checks the options, with errors that name the option."""

import argparse
import ast
import dataclasses
import inspect
import math
import pathlib

import pytest

from gradshare.config import TrainConfig
from gradshare.config.grouping import GROUPS, grouped
from gradshare.config.options import (
    DEFAULT_WARMUP_EPOCHS,
    WORKER_OPTIONS,
    Compression,
    FaultTolerance,
    Network,
    Runtime,
    WorkerFlags,
)
from gradshare.driver.trainer import SharedTrainer
from gradshare.task.config import WorkerConfig
from gradshare.transport.protocol.wire import DEFAULT_DATAGRAM_SIZE, DEFAULT_PORT
from lab.flat_options import GROUP_OF

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "gradshare"
FLAT = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.init}
# every option's default by its name, the grouped ones' too (names are unique across the groups)
DEFAULTS = {**FLAT, **{f.name: f.default for g in GROUPS.values() for f in dataclasses.fields(g) if f.init}}


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


# ------------------------------------------------------------------------------------ one source of defaults
def test_shared_trainer_takes_every_option_and_default_from_train_config():
    params = inspect.signature(SharedTrainer).parameters
    assert list(params)[0] == "model" and params["model"].default is inspect.Parameter.empty
    options = {name: p.default for name, p in params.items() if name != "model"}
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params.values())  # every option is named
    assert list(options) == list(FLAT), "SharedTrainer's options and TrainConfig's fields differ (or their order)"
    drift = {k: (v, FLAT[k]) for k, v in options.items() if not _same(v, FLAT[k])}
    assert not drift, f"(signature, TrainConfig) defaults differ: {drift}"
    assert DEFAULTS["port"] == DEFAULT_PORT == 40123 and DEFAULTS["datagram_size"] == DEFAULT_DATAGRAM_SIZE == 1400
    assert len(options) + 1 <= 20, f"{len(params)} top-level options: the rest belong in a group"
    names = [f.name for g in GROUPS.values() for f in dataclasses.fields(g) if f.init]
    assert len(names) == len(set(names)) and not set(names) & set(FLAT), "an option is written twice"


def test_worker_config_holds_the_groups_as_they_are_in_twenty_typed_fields_at_most():
    import typing

    from gradshare.task import config as task_config

    hints = typing.get_type_hints(WorkerConfig, vars(task_config))
    assert len(hints) <= 20, sorted(hints)
    assert all(hint is not typing.Any for hint in hints.values()), [k for k, h in hints.items() if h is typing.Any]
    # the option groups travel as SharedTrainer holds them, not copied field by field
    for keyword, group in GROUPS.items():
        assert hints[keyword] is group
    # every worker option has its default, and the checked flags' TypedDict names the same keys
    assert set(task_config.WORKER_FLAG_DEFAULTS) == set(WORKER_OPTIONS) == set(WorkerFlags.__annotations__)
    runtime = WorkerConfig.__dataclass_fields__["runtime"].default_factory()
    assert runtime == Runtime()


def test_the_estimator_params_default_to_the_trainer_options():
    from gradshare.ml.params import NOT_OPTIONS, EstimatorParams, trainer_option_names

    params = EstimatorParams()
    pairs = {"epochs": "epochs", "batchSize": "batch_size", "seed": "seed", "numWorkers": "num_workers"}
    for param, option in pairs.items():
        assert _same(params.getOrDefault(param), DEFAULTS[option]), param
    assert trainer_option_names() == set(FLAT) - NOT_OPTIONS


# CLI and study options that mean a SharedTrainer option but default otherwise on purpose: (command, dest) -> why
CLI_OWN_DEFAULTS = {
    ("demo", "epochs"): "the demo trains until the digits MLP converges",
    ("benchmarks/train.py", "batch_size"): "the benchmark workloads' batch (DDP's baseline runs the same)",
    ("benchmarks/convergence.py", "batch_size"): "the benchmark workloads' batch",
    ("benchmarks/train.py", "epochs"): "None: each workload's own",
    ("benchmarks/convergence.py", "epochs"): "None: each workload's own",
    ("benchmarks/lm.py", "epochs"): "None: the benchmark's own (4; 1 with --quick)",
    ("benchmarks/lm.py", "batch_size"): "None: the benchmark's own (32 windows per worker)",
    ("benchmarks/scaling.py", "epochs"): "None: each workload's recipe",
    ("bench encoding", "density"): "synthetic updates: a share of entries, not threshold='auto'",
    ("bench device", "density"): "synthetic updates: a share of entries, not threshold='auto'",
    ("bench transport", "density"): "synthetic updates: a share of entries, not threshold='auto'",
    ("bench scale", "density"): "synthetic updates: a share of entries, not threshold='auto'",
    ("bench transport", "loss"): "another option of the same name: the fault proxy's loss rate",
    ("bench scale", "forwarding"): "the relay's modes: per-rank or aggregate, no 'auto'",
}


def _subcommands(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*prefix, name))
    if prefix:
        yield " ".join(prefix), parser


def _study_parsers():
    """The parsers of the lab's studies (benchmarks/<name>.py), which take SharedTrainer's options too."""
    from lab import convergence, lm, scaling, train

    for module in (train, convergence, lm, scaling):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        yield f"benchmarks/{module.__name__.rpartition('.')[2]}.py", parser


def test_cli_defaults_are_the_trainer_defaults():
    from gradshare.cli import build_parser

    seen, own = set(), set()
    for command, parser in [*_subcommands(build_parser()), *_study_parsers()]:
        for action in parser._actions:
            if action.dest not in DEFAULTS or action.default is argparse.SUPPRESS:
                continue
            seen.add(command)
            if (command, action.dest) in CLI_OWN_DEFAULTS:
                own.add((command, action.dest))
                assert not _same(action.default, DEFAULTS[action.dest]), f"{command} --{action.dest} is no exception"
                continue
            assert _same(action.default, DEFAULTS[action.dest]), (
                f"gradshare {command} --{action.dest} defaults to {action.default!r}, SharedTrainer to "
                f"{DEFAULTS[action.dest]!r}: take it from TrainConfig, or list it in CLI_OWN_DEFAULTS with why"
            )
    assert {
        "demo",
        "relay",
        "benchmarks/train.py",
        "benchmarks/convergence.py",
        "bench transport",
        "bench scale",
    } <= seen
    assert own == set(CLI_OWN_DEFAULTS), f"stale CLI_OWN_DEFAULTS entries: {set(CLI_OWN_DEFAULTS) - own}"


def test_the_relay_and_the_benchmark_runner_default_like_the_trainer():
    from gradshare.transport.protocol.tuning import RelayTuning
    from gradshare.transport.sockets.relay import Relay
    from lab.systems import run_gradshare

    relay = inspect.signature(Relay).parameters
    for name in ("port", "bind", "datagram_size", "insecure"):
        assert _same(relay[name].default, DEFAULTS[name]), name
    assert _same(RelayTuning().liveness_timeout, DEFAULTS["liveness_timeout"])  # the relay's tunables
    runner = inspect.signature(run_gradshare).parameters
    own = {"timeout"}  # a benchmark run on a loaded machine waits longer than a user's fit
    for name, p in runner.items():
        if name in DEFAULTS and p.default is not inspect.Parameter.empty and name not in own:
            assert _same(p.default, DEFAULTS[name]), name


def test_the_port_and_the_datagram_size_are_written_once():
    """No int literal 40123 or 1400 in gradshare's code outside wire.py (docstrings and comments may say them)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and type(node.value) is int and node.value in (40123, 1400):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == [
        "transport/protocol/wire.py:" + str(_line_of("DEFAULT_DATAGRAM_SIZE = 1400")),
        "transport/protocol/wire.py:" + str(_line_of("DEFAULT_PORT = 40123")),
    ], found


def _line_of(text: str) -> int:
    lines = (PACKAGE / "transport" / "protocol" / "wire.py").read_text(encoding="utf-8").splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.startswith(text))


# ------------------------------------------------------------------------------------ checked once, named
class _Rule:  # a threshold rule without .update
    threshold = 1e-3


BAD = [
    ({"port": -1}, ValueError, r"port must be an int in 0\.\.65535, got -1"),
    ({"port": "40123"}, ValueError, r"port must be an int"),
    ({"batch_size": 0}, ValueError, r"batch_size must be an int >= 1, got 0"),
    ({"epochs": 1.5}, ValueError, r"epochs must be an int >= 1, got 1\.5"),
    ({"num_workers": 0}, ValueError, r"num_workers must be None or an int >= 1"),
    ({"staleness": -1}, ValueError, r"staleness must be an int >= 0"),
    ({"residual_clip": 0}, ValueError, r"residual_clip must be None or > 0"),
    ({"label_dtype": "int32"}, ValueError, r"label_dtype must be None, 'int64' or 'float32'"),
    ({"timeout": 0}, ValueError, r"timeout and liveness_timeout must be > 0"),
    ({"liveness_timeout": -1.0}, ValueError, r"timeout and liveness_timeout must be > 0"),
    ({"on_rank_loss": "skip"}, ValueError, r"on_rank_loss must be 'wait', 'restart' or 'continue'"),
    ({"step_timeout": True}, ValueError, r"step_timeout must be a number of seconds > 0"),
    ({"checkpoint_every": 0}, ValueError, r"checkpoint_every must be an int >= 1"),
    ({"checkpoint_every": True}, ValueError, r"checkpoint_every must be an int >= 1"),
    ({"threshold": -1e-3}, ValueError, r"threshold must be 'auto' or a positive finite number"),
    ({"threshold": math.nan}, ValueError, r"threshold must be 'auto' or a positive finite number"),
    ({"threshold": True}, ValueError, r"threshold must be 'auto' or a positive finite number"),
    ({"threshold": 1e-3, "density": 1e-2}, ValueError, r"density tune threshold='auto'"),
    ({"warmup": -1}, ValueError, r"warmup must be a number of epochs >= 0"),
    ({"density": 2.0}, ValueError, r"density must be a share of entries in \(0, 1\]"),
    ({"warmup_density": 0.0}, ValueError, r"warmup_density must be"),
    ({"threshold_algorithm": "fixed"}, ValueError, r"threshold='auto' calibrates τ itself"),
    (
        {"threshold": 1e-3, "threshold_algorithm": "bogus"},
        ValueError,
        r"threshold_algorithm must be 'adaptive', 'fixed'",
    ),
    ({"threshold": 1e-3, "threshold_algorithm": _Rule()}, TypeError, r"threshold_algorithm object must have"),
    ({"drop_last": "yes"}, ValueError, r"drop_last must be 'auto', True or False"),
    ({"precision": "16"}, ValueError, r"precision must be one of"),
    ({"device": "tpu"}, ValueError, r"device must be 'cpu', 'cuda'"),
    ({"aggregate": "avg"}, ValueError, r"aggregate must be 'sum' or 'mean'"),
    ({"forwarding": "tree"}, ValueError, r"forwarding must be one of"),
    ({"scheduler_interval": "batch"}, ValueError, r"scheduler_interval must be 'step' or 'epoch'"),
    ({"loss": 3}, TypeError, r"loss must be callable, got int"),
    ({"train_step": "f"}, TypeError, r"train_step must be callable, got str"),
    ({"loss": abs, "train_step": abs}, ValueError, r"loss and train_step are exclusive"),
    ({"optimizer": 0.1}, TypeError, r"optimizer must be a factory taking the parameter list"),
    ({"lr_scheduler": 100}, TypeError, r"lr_scheduler must be a factory taking the optimizer"),
    ({"early_stopping": {"patience": 1, "when": 2}}, ValueError, r"early_stopping: unknown key\(s\) \['when'\]"),
    ({"early_stopping": {"monitor": "val_metric"}}, ValueError, r"early_stopping monitors 'val_metric' but no"),
    ({"on_epoch_end": [print, 1]}, ValueError, r"on_epoch_end\[1\] is int"),
    ({"worker_options": {"profil": True}}, ValueError, r"worker_options has unknown key\(s\) \['profil'\]"),
    ({"worker_options": {"profile": 1}}, ValueError, r"worker_options\['profile'\] must be True or False"),
    ({"mlflow": "yes"}, TypeError, r"mlflow must be None, True or a dict"),
]


def _in_groups(options):
    """`options` with each grouped option in a dict under its group's keyword (as JSON would give them)."""
    out = {k: v for k, v in options.items() if k not in GROUP_OF}
    for name, value in options.items():
        if name in GROUP_OF:
            out.setdefault(GROUP_OF[name], {})[name] = value
    return out


@pytest.mark.parametrize("options, error, message", BAD, ids=[", ".join(o) for o, _, _ in BAD])
def test_a_bad_option_fails_naming_it_in_train_config_and_in_shared_trainer(options, error, message):
    with pytest.raises(error, match=message):
        TrainConfig(**grouped(_in_groups(options)))
    with pytest.raises(error, match=message):  # the same class and message: the trainer's checks are these
        SharedTrainer(lambda: None, **_in_groups(options))


def test_a_grouped_option_is_taken_in_its_group_only():
    # a grouped option named flat is an unknown keyword: Python's TypeError names it
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'density'"):
        SharedTrainer(lambda: None, density=0.01)
    trainer = SharedTrainer(lambda: None, compression={"density": 0.01})  # a dict, as JSON gives it
    assert trainer.config.compression == Compression(density=0.01) == trainer.compression
    with pytest.raises(AttributeError, match=r"has no attribute 'density'"):
        trainer.density
    with pytest.raises(ValueError, match=r"network has no option\(s\) \['prot'\]; Network's are"):
        SharedTrainer(lambda: None, network={"prot": 1})
    with pytest.raises(AttributeError, match="fixed when it is made"):  # nor set as an attribute
        trainer.epochs = 5
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'epoch'"):
        SharedTrainer(lambda: None, epoch=3)
    with pytest.raises(TypeError, match=r"network must be gradshare\.Network\(\.\.\.\), got int"):
        TrainConfig(network=3)


def test_checkpoint_options_are_checked_against_staleness_and_forwarding(tmp_path):
    saving = FaultTolerance(checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"checkpoint_dir needs staleness=0"):
        TrainConfig(fault_tolerance=saving, compression=Compression(staleness=1))
    with pytest.raises(ValueError, match=r"forwarding='aggregate' cannot be checkpointed"):
        TrainConfig(fault_tolerance=saving, network=Network(forwarding="aggregate"))
    assert TrainConfig(fault_tolerance=saving).fault_tolerance.checkpoint_root == str(tmp_path)


def test_a_config_is_frozen_and_keeps_the_options_as_given_beside_their_checked_forms():
    rule = {"patience": 2, "monitor": "loss"}
    config = TrainConfig(
        early_stopping=rule,
        threshold=1e-3,
        runtime=Runtime(on_epoch_end=print, worker_options={"profile": True}, device="CPU"),
    )
    assert config.early_stopping is rule and config.stopping.patience == 2 and config.stopping.monitor == "loss"
    run = config.runtime
    assert run.on_epoch_end is print and run.callbacks == (print,)
    assert run.worker_flags == {"profile": True} and run.device == "CPU" and run.device_name == "cpu"
    assert not config.auto and config.compression.warmup_epochs == DEFAULT_WARMUP_EPOCHS
    assert Compression(warmup=0).warmup_epochs == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.device = "cuda"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.epochs = 3
    with pytest.raises(ValueError, match="epochs must be an int >= 1"):  # replace() checks again
        dataclasses.replace(config, epochs=0)
    assert dataclasses.replace(config, epochs=3).epochs == 3


def test_the_trainer_keeps_its_attributes_and_the_options_as_given():
    runtime = Runtime(on_epoch_end=[print], worker_options={"direct_update": False})
    trainer = SharedTrainer(
        lambda: None, threshold=2e-3, compression=Compression(threshold_algorithm="fixed"), runtime=runtime, epochs=3
    )
    assert trainer.options["runtime"] is runtime and trainer.runtime.on_epoch_end == [print]
    assert trainer.config.epochs == trainer.epochs == 3 and trainer.threshold == 2e-3 and not trainer.auto
    assert trainer.runtime.callbacks == (print,) and trainer.runtime.worker_flags == {"direct_update": False}
    assert trainer.compression.warmup is None and trainer.runtime.device_name == "auto"
    assert trainer.port == DEFAULT_PORT and trainer.fault_tolerance.checkpoint_dir is None
    assert trainer.early_stopping is None


def test_every_option_reads_through_the_trainer_from_its_config_and_none_is_set_after_construction():
    from gradshare.driver.trainer import CHECKED, default_optimizer

    trainer = SharedTrainer(lambda: None, epochs=2)
    for f in dataclasses.fields(TrainConfig):
        if f.init and f.name != "optimizer":  # a new option reads as trainer.<name> with no trainer code
            assert getattr(trainer, f.name) is getattr(trainer.config, CHECKED.get(f.name, f.name)), f.name
    assert trainer.optimizer is default_optimizer and SharedTrainer(lambda: None, optimizer=print).optimizer is print
    assert set(vars(trainer)) == {"options", "config", "model"}  # no copies of the options
    with pytest.raises(AttributeError, match="fixed when it is made"):
        trainer.epochs = 3
    with pytest.raises(AttributeError, match="no attribute 'epoch'"):
        trainer.epoch
