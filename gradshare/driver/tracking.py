"""MLflow run logging for SharedTrainer: one run per fit, logged from the driver.

    SharedTrainer(model, runtime=Runtime(mlflow=True)).fit(rdd)                       # the active experiment
    SharedTrainer(model, runtime=Runtime(mlflow={"experiment": "digits", "run_name": "k0"})).fit(rdd)

Why a trainer option and not only a function called on the result: the run must exist before the
Spark job starts, so that a fit that fails is still recorded (status FAILED, with its params), and an
option is also reachable from `GradshareEstimator(trainerOptions={"runtime": {"mlflow": {...}}})`, where the user
never sees the FitResult (one run per fit under CrossValidator too). `log_result` is public for a
result obtained without the option.

What a run holds:
- params: every SharedTrainer option as the user gave it (defaults included; callables by qualified
  name, arrays by dtype and shape), the fit's keyword arguments, then the fit's facts (world_size,
  n_params, the loss chosen, label dtype, inputs);
- metrics per epoch (step = epoch): every numeric field of `FitResult.history` under its own name
  (loss, val_metric, tau, sparsity: the share of entries sent, i.e. the density, payload_bytes,
  bytes_sent, bytes_received, seconds, lr, silent_steps, steps), then fit_seconds, total_steps,
  traffic_ratio;
- artifacts: ``model/state_dict.pt`` (`torch.save` of the result model's state_dict, the relay's
  parameters: no pickled module, load it into your own architecture) and ``history.json``.

Only the driver talks to MLflow; the workers never import it. Nothing is logged while the workers
train: the per-epoch rows exist once every worker has reported (`history.merge_history`). The run
is RUNNING (params only) meanwhile.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

import torch

from gradshare.checks import import_mlflow


class _Options(Protocol):
    @property
    def options(self) -> Mapping[str, object]: ...  # SharedTrainer's options as given


_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")
_Trainer = TypeVar("_Trainer", bound=_Options)

if TYPE_CHECKING:
    from gradshare.driver.result import FitResult

MAX_PARAM_CHARS = 500  # MLflow's limit for a param value before 2.x's 6000; servers of either age take this
MAX_BATCH_METRICS, MAX_BATCH_PARAMS = 1000, 100  # MLflow's log_batch limits


def tracked(
    fit: Callable[Concatenate[_Trainer, _Params], _Result],
) -> Callable[Concatenate[_Trainer, _Params], _Result]:
    """Decorator for `SharedTrainer.fit`: with the trainer's `mlflow` option set, the fit runs inside
    one MLflow run (nested under the calling thread's active run, if any) that ends FINISHED with the
    result logged, or FAILED when the fit raises.

    MLflow failing before the fit (an unreachable server) raises before any Spark job. MLflow failing
    after a fit that succeeded does not throw the trained model away: the fit returns its result and a
    RuntimeWarning says what was not logged (the run is marked FAILED where the server still answers)."""

    @functools.wraps(fit)
    def wrapper(trainer: _Trainer, /, *args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        # the decorator keeps fit's signature for type checkers (SharedTrainer.fit's is public)
        runtime = getattr(trainer, "runtime", None)  # the Runtime group holds the mlflow option, checked
        config = None if runtime is None else runtime.mlflow_config
        if config is None:
            return fit(trainer, *args, **kwargs)
        mlflow = import_mlflow()
        bound = inspect.signature(fit).bind(trainer, *args, **kwargs)
        call = {k: v for k, v in list(bound.arguments.items())[2:] if v is not None}  # not self, not data
        client = mlflow.tracking.MlflowClient()
        run_id = _start_run(mlflow, client, config)
        try:
            _log_params(mlflow, client, run_id, {**_flattened(trainer.options), **call})
            result = fit(trainer, *args, **kwargs)
        except BaseException:
            _end_run(client, run_id, "FAILED")
            raise
        try:
            # `tracked` decorates SharedTrainer.fit, whose result is a FitResult
            log_result(cast("FitResult", result), run_id=run_id, log_model=config["log_model"])
        except Exception as e:  # noqa: BLE001 - the result matters more than its log; said below
            warnings.warn(
                f"the fit succeeded but logging it to MLflow run {run_id} failed: {type(e).__name__}: {e}",
                RuntimeWarning,
                stacklevel=2,
            )
            _end_run(client, run_id, "FAILED")
            return result
        _end_run(client, run_id, "FINISHED")
        return result

    return wrapper


def _end_run(client: Any, run_id: str, status: str) -> None:
    """Mark the run ended; a tracking server that fails here must not hide the fit's own outcome."""
    try:
        client.set_terminated(run_id, status)
    except Exception as e:  # noqa: BLE001 - reported, never silent
        warnings.warn(
            f"could not mark MLflow run {run_id} {status}: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3
        )


def _start_run(mlflow: Any, client: Any, config: dict[str, Any]) -> str:
    """Create the fit's run (its id) without making it the thread's active run: fits may run in parallel
    threads (CrossValidator(parallelism=k)) and the caller's own active run must stay theirs."""
    active = mlflow.active_run()
    if config["experiment"] is not None:
        found = client.get_experiment_by_name(config["experiment"])
        experiment_id = found.experiment_id if found is not None else client.create_experiment(config["experiment"])
    elif active is not None:
        experiment_id = active.info.experiment_id
    else:
        experiment_id = mlflow.tracking.fluent._get_experiment_id()  # honours set_experiment / MLFLOW_EXPERIMENT_*
    tags = {"mlflow.source.name": "gradshare.SharedTrainer.fit", **config["tags"]}
    if active is not None:
        tags["mlflow.parentRunId"] = active.info.run_id
    run_id: str = client.create_run(experiment_id, run_name=config["run_name"], tags=tags).info.run_id
    return run_id


def log_result(result: FitResult, run_id: str, log_model: bool = True) -> None:
    """Log a FitResult into the MLflow run `run_id`: per-epoch metrics, the fit's facts as params, and
    (log_model) the model's state_dict and the history as artifacts."""
    mlflow = import_mlflow()
    client = mlflow.tracking.MlflowClient()
    now = _now_ms()
    metrics = [
        mlflow.entities.Metric(key, float(value), now, int(row["epoch"]))
        for row in result.history
        for key, value in row.items()
        if key != "epoch" and _is_number(value)
    ]
    ratio = result.traffic_ratio
    summary = {
        "fit_seconds": result.seconds,
        "total_steps": result.steps,
        "traffic_ratio": ratio if math.isfinite(ratio) else None,
    }
    metrics += [
        mlflow.entities.Metric(key, float(value), now, 0) for key, value in summary.items() if value is not None
    ]
    facts = {
        "world_size": result.world_size,
        "n_params": result.n_params,
        "resumed_from": result.resumed_from,
        **{f"fit.{k}": v for k, v in result.extra.items() if k in ("loss", "label_dtype", "inputs") and v is not None},
    }  # None: a FitResult made by hand
    for i in range(0, len(metrics), MAX_BATCH_METRICS):
        client.log_batch(run_id, metrics=metrics[i : i + MAX_BATCH_METRICS])
    _log_params(mlflow, client, run_id, facts)
    with tempfile.TemporaryDirectory(prefix="gradshare-mlflow-") as tmp:
        history = os.path.join(tmp, "history.json")
        with open(history, "w") as f:
            json.dump(result.history, f, indent=1, default=_plain)
        client.log_artifact(run_id, history)
        if log_model:
            path = os.path.join(tmp, "state_dict.pt")
            torch.save(result.model.state_dict(), path)
            client.log_artifact(run_id, path, artifact_path="model")


def _now_ms() -> int:
    return int(time.time() * 1000)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or hasattr(value, "dtype")


def _flattened(options: Mapping[str, object]) -> dict[str, object]:
    """The options with each group's fields as params of their own, named ``group.option``."""
    out: dict[str, object] = {}
    for name, value in options.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update({f"{name}.{f.name}": getattr(value, f.name) for f in dataclasses.fields(value) if f.init})
        else:
            out[name] = value
    return out


def _log_params(mlflow: Any, client: Any, run_id: str, options: Mapping[str, object]) -> None:
    params = [mlflow.entities.Param(name, _describe(value)) for name, value in options.items()]
    for i in range(0, len(params), MAX_BATCH_PARAMS):
        client.log_batch(run_id, params=params[i : i + MAX_BATCH_PARAMS])


def _describe(value: Any) -> str:
    """One param value as text: MLflow params are strings."""
    if value is None or isinstance(value, (bool, int, float, str)):
        text = str(value)
    elif hasattr(value, "dtype") and hasattr(value, "shape"):  # an array: its values are data, not a param
        text = f"{value.dtype}{list(value.shape)}"
    elif isinstance(value, (tuple, list)):
        text = "(" + ", ".join(_describe(v) for v in value) + ")"
    elif isinstance(value, dict):
        text = json.dumps({str(k): _describe(v) for k, v in value.items()})
    elif inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value):
        text = f"{value.__module__}.{value.__qualname__}"
    elif isinstance(value, functools.partial):
        text = f"partial({_describe(value.func)})"
    else:  # an nn.Module, a threshold rule, a callable object: its class and what it prints as
        text = f"{type(value).__module__}.{type(value).__qualname__}: {value!r}"
    return text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 1] + "…"


def _plain(value: Any) -> Any:
    """json.dump's fallback for NumPy scalars in history rows."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"history holds a {type(value).__name__}, which JSON cannot hold")
