"""Entry-point plugins found through real distribution metadata on ``sys.path``.

Each test writes a ``NAME-1.0.dist-info`` with an ``entry_points.txt`` and the plugin module next
to it (the ``install`` fixture of tests/conftest.py), so discovery goes through
``importlib.metadata`` exactly as for an installed package.
"""

from __future__ import annotations

import pluggy
import pytest

import mtp_hooks
from mtp_hooks._plugin_registry import PluginRegistry

from installed_distributions import FRAMEWORK_PLUGINS

GOOD = """
import mtp_hooks

@mtp_hooks.plugins.hookimpl
def should_run_mtp(model, phase):
    return False if phase == "rollout" else None
"""


def test_an_installed_plugin_is_loaded_on_first_use(install):
    install("mtpx-good", GOOD)
    decision = mtp_hooks.decide(None, "rollout")
    assert (decision.run, decision.decided_by) == (False, "mtpx-good")


def test_list_plugins_reports_the_distribution_and_version(install):
    install("mtpx-good", GOOD, version="2.3")
    info = {i.name: i for i in mtp_hooks.plugins.list_plugins()}["mtpx-good"]
    assert (info.name, info.distribution, info.version) == ("mtpx-good", "mtpx-good", "2.3")
    assert info.hooks == ("should_run_mtp",) and not info.blocked


def test_a_plugin_that_fails_to_import_names_entry_point_distribution_error_and_switch(install):
    install("mtpx-broken", "import does_not_exist_anywhere\n")
    with pytest.raises(mtp_hooks.PluginError) as info:
        mtp_hooks.decide(None, "eval")
    message = str(info.value)
    assert "'mtpx-broken'" in message and "mtpx-broken 1.0" in message
    assert "ModuleNotFoundError" in message and "does_not_exist_anywhere" in message
    assert "MTP_HOOKS_DISABLE=mtpx-broken" in message


def test_a_broken_plugin_is_never_skipped_silently(install):
    install("mtpx-broken", "raise RuntimeError('bad plugin')\n")
    for _ in range(2):  # the next use fails again rather than running without the plugin
        with pytest.raises(mtp_hooks.PluginError, match="bad plugin"):
            mtp_hooks.decide(None, "eval")


def test_a_broken_plugin_leaves_no_other_plugin_half_registered(install):
    install("mtpx-a-good", GOOD)
    install("mtpx-z-broken", "raise RuntimeError('bad plugin')\n")
    registry = PluginRegistry()
    with pytest.raises(mtp_hooks.PluginError):
        registry.load_entry_points()
    assert [name for name, plugin in registry.pm.list_name_plugin() if plugin is not None] == []


def test_a_misspelled_hook_in_an_entry_point_is_an_error_naming_the_plugin(install):
    install(
        "mtpx-typo",
        """
        import mtp_hooks

        @mtp_hooks.plugins.hookimpl
        def should_run_mpt(model, phase):
            return False
        """,
    )
    with pytest.raises(mtp_hooks.PluginError, match="'mtpx-typo'.*mtpx-typo 1.0.*should_run_mpt"):
        mtp_hooks.decide(None, "eval")


def test_a_misspelled_hooks_error_lists_every_hook_the_hookspecs_define(install):
    install(
        "mtpx-typo",
        """
        import mtp_hooks

        @mtp_hooks.plugins.hookimpl
        def mtp_loss_scal(model, phase):
            return 0.5
        """,
    )
    with pytest.raises(mtp_hooks.PluginError) as info:
        mtp_hooks.decide(None, "eval")
    known = str(info.value).split("Known hooks: ")[1].split(". Fix")[0].split(", ")
    fresh = pluggy.PluginManager(mtp_hooks.hookspecs.PROJECT_NAME)
    fresh.add_hookspecs(mtp_hooks.hookspecs)
    assert sorted(known) == sorted(vars(fresh.hook)) and len(known) == len(set(known))
    assert {"should_run_mtp", "declare_phases", "mtp_metrics"} <= set(known)


def test_a_blocked_plugin_is_not_loaded_and_is_listed_as_blocked(install, monkeypatch):
    install("mtpx-good", GOOD)
    monkeypatch.setenv("MTP_HOOKS_DISABLE", f"mtpx-good, other,{FRAMEWORK_PLUGINS}")
    assert mtp_hooks.decide(None, "rollout").decided_by == "default"
    infos = {i.name: i for i in mtp_hooks.plugins.list_plugins()}
    assert infos["mtpx-good"].blocked and infos["mtpx-good"].distribution == "mtpx-good"
    assert infos["other"].blocked


def test_blocking_a_broken_plugin_lets_everything_else_load(install, monkeypatch):
    install("mtpx-broken", "raise RuntimeError('bad plugin')\n")
    monkeypatch.setenv("MTP_HOOKS_DISABLE", f"mtpx-broken,{FRAMEWORK_PLUGINS}")
    assert mtp_hooks.decide(None, "eval").decided_by == "default"


def test_autoload_off_loads_no_entry_point(install, monkeypatch):
    install("mtpx-good", GOOD)
    monkeypatch.setenv("MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert mtp_hooks.decide(None, "rollout").decided_by == "default"
    assert [i.name for i in mtp_hooks.plugins.list_plugins() if not i.blocked] == []


def test_an_entry_point_naming_a_class_registers_an_instance(install):
    install(
        "mtpx-class",
        """
        import mtp_hooks

        class Policy:
            @mtp_hooks.plugins.hookimpl
            def should_run_mtp(self, model, phase):
                return phase == "train"
        """,
        attribute="Policy",
    )
    assert mtp_hooks.decide(None, "eval").run is False
