"""What register() refuses, and how a plugin that fails at decision time is reported."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mtp_hooks


def registered_names() -> set[str]:
    return {name for name, _ in mtp_hooks.plugins.get_plugin_manager().list_name_plugin()}


class NewStyleWrapper:
    @mtp_hooks.plugins.hookimpl(wrapper=True)
    def should_run_mtp(self, model, phase):
        result = yield
        return result


class OldStyleWrapper:
    @mtp_hooks.plugins.hookimpl(hookwrapper=True)
    def should_run_mtp(self, model, phase):
        yield


@pytest.mark.parametrize("plugin", [NewStyleWrapper(), OldStyleWrapper()], ids=["new", "old"])
def test_a_hook_wrapper_is_refused_at_register_and_nothing_stays(plugin):
    with pytest.raises(mtp_hooks.PluginError, match="should_run_mtp.*hook wrapper"):
        mtp_hooks.plugins.register(plugin, name="wrapping")
    assert "wrapping" not in registered_names()
    assert mtp_hooks.decide(None, "train").decided_by == "default"


@pytest.mark.parametrize("plugin", [None, "mtp_hooks_verl", 3], ids=["None", "str", "int"])
def test_a_non_plugin_object_is_refused_with_a_clear_error(plugin):
    with pytest.raises(mtp_hooks.PluginError, match="cannot register"):
        mtp_hooks.plugins.register(plugin)
    assert registered_names() == set()


def test_register_none_is_a_clear_error_under_python_dash_o():
    code = (
        "import mtp_hooks\n"
        "try:\n    mtp_hooks.plugins.register(None)\n"
        "except mtp_hooks.PluginError as exc:\n    print('refused:', exc)\n"
    )
    env = {"MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.startswith("refused: cannot register None")


def test_an_object_without_mtp_hooks_is_refused():
    class Forgot:
        def should_run_mtp(self, model, phase):  # no @hookimpl
            return False

    with pytest.raises(mtp_hooks.PluginError, match="implements no mtp_hooks hook"):
        mtp_hooks.plugins.register(Forgot(), name="forgot")
    assert "forgot" not in registered_names()


def test_declare_phases_returning_a_bare_string_names_the_plugin():
    class Distill:
        @mtp_hooks.plugins.hookimpl
        def declare_phases(self):
            return "distill"

    mtp_hooks.plugins.register(Distill(), name="distill-plugin")
    with pytest.raises(mtp_hooks.PolicyError, match="'distill-plugin'.*'distill'.*list"):
        mtp_hooks.decide(None, "distill")
    with pytest.raises(mtp_hooks.PolicyError, match="distill-plugin"):
        mtp_hooks.decide(None, "d")


def test_a_plugin_that_raises_is_named_and_its_error_chained():
    class Broken:
        @mtp_hooks.plugins.hookimpl
        def should_run_mtp(self, model, phase):
            raise KeyError("step")

    mtp_hooks.plugins.register(Broken(), name="broken")
    with pytest.raises(mtp_hooks.PluginError, match="'broken'.*KeyError") as info:
        mtp_hooks.decide(None, "train")
    assert isinstance(info.value.__cause__, KeyError)
    assert "MTP_HOOKS_DISABLE=broken" in str(info.value)


def test_star_import_works_without_torch():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # as on a core-only install\n"
        "from mtp_hooks import *\n"
        "assert 'attach' in dir() and 'configure' in dir()\n"
        "try:\n    attach(object())\n"
        "except UnsupportedModelError as exc:\n    print('refused:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "refused: mtp_hooks.attach needs torch and megatron-core" in out.stdout
