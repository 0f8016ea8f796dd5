"""The vllm import surface (rlserve/vllm_surface): the table's names resolve to rlserve's objects, what rlserve lacks is
refused by name, a real vLLM is never shadowed, `rlserve run` reaches every Python process below it, and an engine
core installs it for a worker extension only when asked (RLSERVE_VLLM_SURFACE=1). The end-to-end use, TRL's
`trl vllm-serve` and `VLLMClient`, is tests/server/test_trl_vllm_serve.py."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import os
import re
import socket
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_source import VllmSource

from rlserve import net, vllm_surface
from rlserve.engine.worker.extension import import_class
from rlserve.vllm_surface import run
from rlserve.vllm_surface.table import MODULES, Entry, Refused
from rlserve.weight_transfer.vllm_sender import packed_nccl_broadcast_producer, trainer_init

TESTS_DIR = Path(__file__).resolve().parent
NOT_PROVIDED = "rlserve does not provide this vLLM API"
RUN_TIMEOUT_S = 120


@pytest.fixture
def surface() -> Iterator[None]:
    vllm_surface.install()
    try:
        yield
    finally:
        vllm_surface.uninstall()


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A vllm package on sys.path, as an installed vLLM is."""
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '0.33.0'\n")
    monkeypatch.syspath_prepend(str(package.parent))
    return package


# Modules that re-export a package of its own, not installed here: importing them says how to install it.
OPTIONAL_PACKAGE_MODULES = {"vllm.distributed.weight_transfer.modelexpress_engine": "modelexpress_client/python"}


def _table_targets() -> Iterator[tuple[str, str, object]]:
    for path, mapping in MODULES.items():
        if path in OPTIONAL_PACKAGE_MODULES:
            continue
        target = mapping.module if isinstance(mapping, Entry) else mapping
        if isinstance(target, str):
            module = importlib.import_module(target)
            for name in module.__all__:
                yield path, name, getattr(module, name)
        else:
            for name, where in target.items():
                if isinstance(where, Refused):
                    yield path, name, where
                else:
                    module_name, _, attribute = where.partition(":")
                    yield path, name, getattr(importlib.import_module(module_name), attribute)


def test_every_table_name_is_rlserves_own_object(surface: None) -> None:
    for path, name, expected in _table_targets():
        value = getattr(importlib.import_module(path), name)
        if isinstance(expected, Refused):
            with pytest.raises(NotImplementedError, match=re.escape(f"{path}.{name}: {expected.why}")):
                value()
        else:
            assert value is expected, f"{path}.{name}"
    import vllm

    assert vllm.__version__ == vllm_surface.VLLM_VERSION
    assert vllm.LLM.__module__ == "rlserve.engine.frontend.llm"


def test_an_optional_backend_module_says_how_to_install_its_package(surface: None) -> None:
    from rlserve.weight_transfer import WeightTransferEngineFactory

    for path, install_hint in OPTIONAL_PACKAGE_MODULES.items():
        spec = importlib.util.find_spec(path)
        assert spec is not None and spec.origin is not None and Path(spec.origin).is_file()  # rlserve's module
        with pytest.raises(ImportError, match=re.escape(install_hint)):
            importlib.import_module(path)
    with pytest.raises(ImportError, match="modelexpress_client/python"):  # registered, imported when asked for
        WeightTransferEngineFactory.get_engine_cls("modelexpress")


def test_a_name_patched_on_a_vllm_module_reaches_rlserves_code_and_is_restored(
    surface: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's tests replace a module's function (`open_trainer_endpoint`) to run a trainer engine without a peer:
    rlserve's trainer engine, which calls the function as a global of its own module, sees the replacement."""
    from vllm.distributed.weight_transfer import nccl_engine

    from rlserve.weight_transfer import nccl_trainer

    original = nccl_trainer.open_trainer_endpoint
    opened: list[object] = []
    with monkeypatch.context() as patch:
        patch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: opened.append(info) or "group")
        engine = nccl_trainer.NCCLTrainerWeightTransferEngine(client=object(), source=None)
        engine._open_trainer_endpoint("info")
        assert (opened, engine.model_update_group) == (["info"], "group")
    assert nccl_trainer.open_trainer_endpoint is original
    assert nccl_engine.open_trainer_endpoint is original


def test_what_rlserve_lacks_is_refused_by_name(surface: None) -> None:
    import vllm

    imports = {
        "from vllm import PoolingParams": "vllm.PoolingParams",
        "from vllm.sampling_params import GuidedDecodingParams": "vllm.sampling_params.GuidedDecodingParams",
        "from vllm.distributed.utils import get_pp_indices": "vllm.distributed.utils.get_pp_indices",
        "import vllm.model_executor.models": "vllm.model_executor.models",
        "from vllm.v1.worker import gpu_worker": "vllm.v1.worker",
    }
    for statement, api in imports.items():
        with pytest.raises(vllm_surface.VllmNotProvidedError, match=re.escape(f"{api}: {NOT_PROVIDED}")):
            exec(statement, {})
    with pytest.raises(AttributeError, match=re.escape(f"vllm.PoolingParams: {NOT_PROVIDED}")):
        vllm.PoolingParams  # noqa: B018
    assert not hasattr(vllm, "PoolingParams") and getattr(vllm, "AsyncLLMEngine", None) is None  # feature probes
    # A ModuleNotFoundError, as a framework's fallback for an optional vLLM module expects (SkyRL's extension has one);
    # SkyRL's allocator-level sleep for weight sync imports this one.
    with pytest.raises(ModuleNotFoundError, match=re.escape(f"vllm.device_allocator: {NOT_PROVIDED}")):
        import vllm.device_allocator  # noqa: F401


def test_skyrl_extensions_vllm_calls_check_what_they_are_given(surface: None) -> None:
    """What SkyRL's worker extension calls around an update (tests/server/test_skyrl_worker_extension.py runs it on a
    server) refuses, by the parameter's name, anything but the worker's own objects it is meant for."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        layerwise,
        meta,
    )

    assert layerwise.initialize_layerwise_reload is initialize_layerwise_reload
    meta.get_numel_loaded = len  # SkyRL rebinds it (a fix of vLLM's count, which rlserve does not make)
    with pytest.raises(TypeError, match="set_current_vllm_config: vllm_config: expected the worker's vllm_config"):
        with set_current_vllm_config(object()):
            pass
    with pytest.raises(TypeError, match=r"initialize_layerwise_reload: model: expected the worker's model"):
        initialize_layerwise_reload(torch.nn.Linear(1, 1))
    with pytest.raises(TypeError, match="finalize_layerwise_reload: model_config: expected the worker's model_config"):
        finalize_layerwise_reload(torch.nn.Linear(1, 1), {})


def test_an_installed_vllm_is_never_shadowed(
    fake_vllm: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(vllm_surface.VllmInstalledError, match=re.escape(str(fake_vllm / "__init__.py"))):
        vllm_surface.install()
    assert not vllm_surface.is_installed()
    assert run.main(["--", sys.executable, "-c", "pass"]) == run.EXIT_USAGE
    assert "a vllm package is importable here" in capsys.readouterr().err
    # Already imported: a real vLLM in this interpreter, whatever the path says now.
    imported = types.ModuleType("vllm")
    imported.__file__ = str(fake_vllm / "__init__.py")
    monkeypatch.setitem(sys.modules, "vllm", imported)
    with pytest.raises(vllm_surface.VllmInstalledError, match="vllm is already imported here"):
        vllm_surface.install()


def test_uninstall_leaves_no_vllm_behind() -> None:
    vllm_surface.install()
    vllm_surface.install()  # idempotent: one finder
    assert sum(isinstance(f, vllm_surface.finder.VllmSurfaceFinder) for f in sys.meta_path) == 1
    importlib.import_module("vllm.distributed.utils")
    # Frameworks gate their vLLM code on the distribution's version (verl refuses its vLLM rollout without one).
    assert importlib.metadata.version("vllm") == vllm_surface.VLLM_VERSION
    assert "vllm" in {dist.metadata["Name"] for dist in importlib.metadata.distributions()}
    vllm_surface.uninstall()
    assert not any(name == "vllm" or name.startswith("vllm.") for name in sys.modules)
    with pytest.raises(ModuleNotFoundError, match="No module named 'vllm'"):
        importlib.import_module("vllm")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")


def test_rlserve_run_reaches_every_python_process_below_it(tmp_path: Path) -> None:
    """A script under `rlserve run`: vllm resolves in it, in its spawn and forkserver children, in a subprocess, and
    `python -m vllm.entrypoints.cli.main` is rlserve's `vllm`; a sitecustomize of the user's still runs."""
    user_site = tmp_path / "user_site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = '1'\n")
    script = tmp_path / "probe.py"
    script.write_text(
        "import multiprocessing, os, subprocess, sys\n"
        "def version(queue):\n"
        "    import vllm\n"
        "    queue.put(vllm.__version__)\n"
        "if __name__ == '__main__':\n"
        "    from vllm.distributed.utils import StatelessProcessGroup\n"
        "    print(StatelessProcessGroup.__module__, os.environ['USER_SITECUSTOMIZE_RAN'])\n"
        "    for method in ('spawn', 'forkserver'):\n"
        "        context = multiprocessing.get_context(method)\n"
        "        queue = context.Queue()\n"
        "        child = context.Process(target=version, args=(queue,))\n"
        "        child.start()\n"
        "        print(method, queue.get(timeout=60))\n"
        "        child.join()\n"
        "    sys.stdout.flush()\n"
        "    code = 'import vllm.sampling_params as s; print(s.SamplingParams.__module__)'\n"
        "    subprocess.run([sys.executable, '-c', code], check=True)\n"
        "    subprocess.run([sys.executable, '-m', 'vllm.entrypoints.cli.main', '--version'], check=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(user_site), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "rlserve.cli", "run", sys.executable, str(script)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    version = vllm_surface.VLLM_VERSION
    assert done.stdout.splitlines() == [
        "rlserve.weight_transfer.stateless_group 1",
        f"spawn {version}",
        f"forkserver {version}",
        "rlserve.sampling_params",
        f"{version} (rlserve {importlib.import_module('rlserve').__version__}'s vllm surface)",
    ]


def test_rlserve_run_names_what_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main([]) == run.EXIT_USAGE
    assert "no COMMAND given" in capsys.readouterr().err
    assert run.main(["--", "rlserve-no-such-command"]) == run.EXIT_NOT_FOUND  # fails before anything is replaced
    assert "rlserve run: rlserve-no-such-command: No such file or directory" in capsys.readouterr().err


def test_the_vllm_command_is_rlserve_serve_only(tmp_path: Path) -> None:
    from rlserve.vllm_cli import EXIT_USAGE, main

    # `rlserve run vllm serve ...`: the surface's `vllm` where PATH has none, an installed one's otherwise.
    surface_vllm = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "m"]
    assert run.resolve_command(["vllm", "serve", "m"], {"PATH": str(tmp_path)}) == surface_vllm
    (tmp_path / "vllm").write_text("#!/bin/sh\n")
    (tmp_path / "vllm").chmod(0o755)
    assert run.resolve_command(["vllm", "serve", "m"], {"PATH": str(tmp_path)}) == ["vllm", "serve", "m"]

    assert main(["bench", "latency"]) == EXIT_USAGE
    assert main(["frobnicate"]) == EXIT_USAGE
    assert main([]) == EXIT_USAGE


def test_an_engine_core_installs_it_for_a_worker_extension_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    monkeypatch.delitem(sys.modules, "vllm_extension", raising=False)
    monkeypatch.delenv(vllm_surface.ENV_VAR, raising=False)
    with pytest.raises(ValueError, match=f"No module named 'vllm' \\(set {vllm_surface.ENV_VAR}=1"):
        import_class("vllm_extension:VllmImportingExtension")
    monkeypatch.setenv(vllm_surface.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=f"{vllm_surface.ENV_VAR}: expected 1 .* got 'yes'"):
        import_class("vllm_extension:VllmImportingExtension")
    monkeypatch.setenv(vllm_surface.ENV_VAR, "1")
    try:
        extension = import_class("vllm_extension:VllmImportingExtension")
        classes = extension.vllm_classes(None)
    finally:
        vllm_surface.uninstall()
        sys.modules.pop("vllm_extension", None)
    assert classes["PyNcclCommunicator"] == "rlserve.weight_transfer.pynccl.PyNcclCommunicator"


def test_network_helpers_follow_vllms_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(net.HOST_IP_ENV, "10.1.2.3")
    assert net.get_ip() == "10.1.2.3"
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setenv(net.PORT_ENV, str(busy))
        assert net.get_open_port() > busy  # scans up from VLLM_PORT past the port in use
    for bad, message in (("http://x:1", "expected a port number"), ("70000", "is not a TCP port")):
        monkeypatch.setenv(net.PORT_ENV, bad)
        with pytest.raises(ValueError, match=f"{net.PORT_ENV}: .*{message}"):
            net.get_open_port()


def test_the_trainer_helpers_name_bad_arguments() -> None:
    cases = {
        "init_info lacks \\['master_port'\\]": {"master_address": "127.0.0.1", "world_size": 2},
        "master_port must be an int": {"master_address": "127.0.0.1", "master_port": "1", "world_size": 2},
        "world_size 1 leaves no rank": {"master_address": "127.0.0.1", "master_port": 1234, "world_size": 1},
        "master_address must be": {"master_address": "", "master_port": 1234, "world_size": 2},
    }
    for message, info in cases.items():
        with pytest.raises(ValueError, match=f"trainer_init: {message}"):
            trainer_init(info)
    with pytest.raises(TypeError, match="packed_nccl_broadcast_producer: group must be .* got object"):
        packed_nccl_broadcast_producer(iter([]), object(), 0, lambda item: item[1])


def _defined_names(source: Path) -> set[str]:
    """The names a vLLM module defines or imports at any level (its lazy MODULE_ATTRS keys too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Dict):
            names |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return names


def test_the_table_is_vllms_own_paths(vllm_source) -> None:
    """Every table path is a module of vLLM 0.33.0 and every name one it defines, read from the release's own source
    (the `vllm_source` fixture); or, for the few paths the table keeps for 0.24.0's RL tests, of 0.24.0."""
    releases = [vllm_source(vllm_surface.VLLM_VERSION), vllm_source("0.24.0")]

    def defined_in(source: VllmSource, path: str, name: str) -> bool:
        module = source.module_file(path)
        return module is not None and name in _defined_names(module)

    missing = [
        f"{path}.{name}"
        for path, name, _ in _table_targets()
        if not any(defined_in(source, path, name) for source in releases)
    ]
    assert not missing
