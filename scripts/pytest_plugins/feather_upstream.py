"""pytest plugin: run vLLM's own scheduler unit tests (tests/v1/core) here, offline,
against vLLM's Scheduler or Feather's, without editing a line of the tests.

Environment:
  FEATHER_UPSTREAM_SCHEDULER  "feather" (default) or "vllm" (the baseline)
  FEATHER_UPSTREAM_OPTIONS    JSON object of Feather options, put into each
                              VllmConfig's additional_config["feather"]
  FEATHER_UPSTREAM_MODEL      local model directory (config.json + tokenizer) used in
                              place of the Hub's text model the tests name (opt-125m)
  FEATHER_UPSTREAM_RECORD     a file to write each test's outcome to (JSON: node id ->
                              "passed", "failed", "error" or "skipped")

The other Hub models the tests name run from their Hub config.json (hub_configs/), and
vLLM's conftest fixture ``caplog_vllm`` is defined here as there.

Version skew: a keyword argument that the installed vLLM's config classes no longer
accept (e.g. CacheConfig(swap_space=...)) is dropped, and listed at the end of the run.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

TEXT_MODELS = {"facebook/opt-125m"}
"""Hub text models the tests name, run on FEATHER_UPSTREAM_MODEL."""

HUB_CONFIGS = Path(__file__).with_name("hub_configs")
"""The other Hub models the tests name (multimodal llava, Qwen3 for the Mamba spec tests,
hybrid Qwen3-Next), in ``hub_configs/ORG--NAME``: their Hub ``config.json`` (llava's also
its image preprocessor and tokenizer configs); the tests build configs and a scheduler,
never weights. Each is run from a copy that gets the embedded model's tokenizer, with the
added tokens its ``tokenizer_config.json`` lists (llava's ``<image>``) at their ids."""

STAND_IN_TORCHVISION = False
"""Whether torchvision is SGLang's import-only stand-in (``_torchvision_for_import_only``)."""

LOCAL_MODELS: dict[str, str] = {}
"""Hub name -> the directory made for it this session (``_prepare_hub_models``)."""

PATCHED_MODULE_PREFIXES = ("tests.v1.core",)

CONFIG_CLASSES = ("ModelConfig", "CacheConfig", "SchedulerConfig", "KVTransferConfig",
                  "ECTransferConfig", "ParallelConfig", "SpeculativeConfig", "Request")

DROPPED: set[str] = set()
"""Keyword arguments dropped for version skew, as Class.argument."""

OUTCOMES: dict[str, str] = {}
"""Each test's outcome by node id (the worst of its phases)."""

RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


class _Compat:
    """A vLLM config class that drops keyword arguments the installed version does not
    take (and rewrites the model name); attributes read through to the class."""

    def __init__(self, real, rewrite=None) -> None:
        self._real = real
        self._params = set(inspect.signature(real).parameters)
        self._rewrite = rewrite
        self.__wrapped__ = real

    def __call__(self, *args, **kwargs):
        if self._rewrite is not None:
            self._rewrite(self, kwargs)
        for name in [k for k in kwargs if k not in self._params]:
            kwargs.pop(name)
            DROPPED.add(f"{self._real.__name__}.{name}")
        return self._real(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _model_dir() -> str:
    configured = os.environ.get("FEATHER_UPSTREAM_MODEL")
    if configured:
        return configured
    import feather_sched

    return str(Path(feather_sched.__file__).parent / "models" / "tiny-llama")


def _mode() -> str:
    mode = os.environ.get("FEATHER_UPSTREAM_SCHEDULER", "feather")
    if mode not in ("feather", "vllm"):
        raise ValueError(f"FEATHER_UPSTREAM_SCHEDULER must be feather or vllm, got {mode!r}")
    return mode


def _prepare_hub_models(target: Path) -> None:
    """Each HUB_CONFIGS directory copied under ``target``, with a tokenizer: the embedded
    model's, plus the added tokens of the directory's tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer

    embedded = Path(_model_dir())
    for source in sorted(p for p in HUB_CONFIGS.iterdir() if p.is_dir()):
        directory = target / source.name
        shutil.copytree(source, directory)
        tokenizer = Tokenizer.from_file(str(embedded / "tokenizer.json"))
        config = directory / "tokenizer_config.json"
        if not config.exists():
            shutil.copy(embedded / "tokenizer_config.json", config)
        added = json.loads(config.read_text()).get("added_tokens_decoder", {})
        for token_id, token in sorted(added.items(), key=lambda item: int(item[0])):
            if tokenizer.token_to_id(token["content"]) is None:
                tokenizer.add_special_tokens([AddedToken(token["content"], special=True)])
            if tokenizer.token_to_id(token["content"]) != int(token_id):
                raise ValueError(f"{source.name}: {token['content']} is not id {token_id}")
        tokenizer.save(str(directory / "tokenizer.json"))
        LOCAL_MODELS[source.name.replace("--", "/", 1)] = str(directory)


def _torchvision_for_import_only() -> bool:
    """Where no torchvision is installed (PyPI's Linux wheels need CUDA torch; here torch
    is CPU), put SGLang's import-only stand-in on the path, for this process and vLLM's
    model-inspection subprocess: vLLM's llava imports transformers' pixtral image
    processor, which imports torchvision at module level. Any call into it raises; the
    multimodal models' images are then processed by transformers' PIL backend
    (``_local_model``). True if the stand-in is in use."""
    import feather_sched

    stand_ins = (Path(feather_sched.__file__).parent / "integrations" / "sglang"
                 / "stand_ins").resolve()
    found = importlib.util.find_spec("torchvision")
    if found is not None and not Path(found.origin or "").resolve().is_relative_to(stand_ins):
        return False  # a real torchvision (the stand-in may be on the path already)
    sys.path.insert(0, str(stand_ins))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(stand_ins), *filter(None, [os.environ.get("PYTHONPATH")])])
    return True


def _local_model(compat, kwargs) -> None:
    model = kwargs.get("model")
    if model in TEXT_MODELS:
        kwargs["model"] = _model_dir()
    elif model in LOCAL_MODELS:
        kwargs["model"] = LOCAL_MODELS[model]
        if STAND_IN_TORCHVISION and (Path(kwargs["model"]) / "preprocessor_config.json").exists():
            kwargs["mm_processor_kwargs"] = {"backend": "pil",
                                             **(kwargs.get("mm_processor_kwargs") or {})}


def _eos_into_sampling_params(compat, kwargs) -> None:
    """Newer vLLM takes the EOS token from the sampling parameters, not the Request."""
    if "eos_token_id" in kwargs and "eos_token_id" not in compat._params:
        eos = kwargs.pop("eos_token_id")
        DROPPED.add("Request.eos_token_id (moved to SamplingParams)")
        params = kwargs.get("sampling_params")
        if eos is not None and params is not None:
            params.update_from_generation_config({}, eos)


REWRITES = {"ModelConfig": _local_model, "Request": _eos_into_sampling_params}


def _feather_scheduler(real):
    """A stand-in for ``real`` (vLLM's Scheduler or AsyncScheduler) whose calls build
    FeatherScheduler: its async variant for AsyncScheduler, its sync one for Scheduler. The
    variant follows the config, so while it is built the config says what the test's class
    is (the CPU platform turns async scheduling off in every config, where a GPU one keeps
    what the test asked for); then the config is as vLLM's scheduler sees it. The stand-in
    is a subclass of ``real``, so that a test building a scheduler by hand, without a
    constructor (``object.__new__(Scheduler)``), gets vLLM's own: nothing of Feather's
    exists without one."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from feather_sched.integrations.vllm import FeatherScheduler

    options = json.loads(os.environ.get("FEATHER_UPSTREAM_OPTIONS") or "{}")
    is_async = issubclass(real, AsyncScheduler)

    class BuildsFeather(type(real)):
        def __call__(cls, *args, **kwargs):
            vllm_config = kwargs.get("vllm_config", args[0] if args else None)
            if options:
                extra = dict(vllm_config.additional_config or {})
                extra["feather"] = dict(options)
                vllm_config.additional_config = extra
            config = vllm_config.scheduler_config
            platforms, config.async_scheduling = config.async_scheduling, is_async
            try:
                return FeatherScheduler(*args, **kwargs)
            finally:
                config.async_scheduling = platforms

    return BuildsFeather(real.__name__, (real,), {"__module__": real.__module__,
                                                  "__wrapped__": real})


def _patch(module) -> None:
    if getattr(module, "_feather_upstream_patched", False):
        return
    module._feather_upstream_patched = True
    for name in CONFIG_CLASSES:
        if name in vars(module):
            setattr(module, name, _Compat(getattr(module, name), REWRITES.get(name)))
    if _mode() == "feather":
        for name in ("Scheduler", "AsyncScheduler"):
            if name in vars(module):
                setattr(module, name, _feather_scheduler(getattr(module, name)))


@pytest.fixture
def caplog_vllm(caplog):
    """vLLM's conftest fixture (tests/conftest.py, not among the files the sdist's tests
    are taken from): ``caplog`` with the "vllm" logger propagating to the root, where
    caplog's handler listens."""
    logger = logging.getLogger("vllm")
    logger.propagate = True
    try:
        yield caplog
    finally:
        logger.propagate = False


def pytest_configure(config) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    config.addinivalue_line("markers", "cpu_test: vLLM's marker for CPU-only tests")
    hub_models = Path(tempfile.mkdtemp(prefix="feather-hub-models-"))
    config.add_cleanup(lambda: shutil.rmtree(hub_models, ignore_errors=True))
    _prepare_hub_models(hub_models)
    global STAND_IN_TORCHVISION
    STAND_IN_TORCHVISION = _torchvision_for_import_only()


def pytest_collection_modifyitems(session, config, items) -> None:
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith(PATCHED_MODULE_PREFIXES):
            _patch(module)


def pytest_report_header(config):
    return (f"feather upstream plugin: scheduler={_mode()} "
            f"options={os.environ.get('FEATHER_UPSTREAM_OPTIONS') or '{}'} "
            f"model={_model_dir()}")


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or not report.passed:
        outcome = ("error" if report.failed and report.when != "call"
                   else "failed" if report.failed else report.outcome)
        previous = OUTCOMES.get(report.nodeid, "passed")
        OUTCOMES[report.nodeid] = max(previous, outcome, key=RANK.__getitem__)


def pytest_collectreport(report) -> None:
    if report.failed:  # a module that does not import is an error, not a missing test
        OUTCOMES[report.nodeid] = "error"


def pytest_sessionfinish(session) -> None:
    record = os.environ.get("FEATHER_UPSTREAM_RECORD")
    if record:
        Path(record).write_text(json.dumps(dict(sorted(OUTCOMES.items())), indent=1) + "\n")


def pytest_terminal_summary(terminalreporter) -> None:
    if DROPPED:
        terminalreporter.write_line(
            "feather upstream plugin: dropped for version skew: " + ", ".join(sorted(DROPPED)))
