"""Registering plugins, the lazy plugin manager, roles and reset()."""

from __future__ import annotations

import gc
import importlib.metadata
import subprocess
import sys

import pluggy
import pytest

import mtp_hooks

from plugin_answers import Model, answers


def test_register_returns_the_given_name(voter):
    class P:
        @mtp_hooks.plugins.hookimpl
        def should_run_mtp(self, model, phase):
            return None

    assert mtp_hooks.plugins.register(P(), name="mine") == "mine"
    assert mtp_hooks.plugins.get_plugin_manager().has_plugin("mine")


def test_register_without_a_name_returns_a_generated_one():
    class P:
        @mtp_hooks.plugins.hookimpl
        def should_run_mtp(self, model, phase):
            return None

    plugin = P()
    name = mtp_hooks.plugins.register(plugin)
    assert mtp_hooks.plugins.get_plugin_manager().get_plugin(name) is plugin


def test_unregister_by_name_removes_the_vote(voter):
    voter(False, "skipper")
    mtp_hooks.plugins.unregister("skipper")
    assert mtp_hooks.decide(None, "eval").decided_by == "default"


def test_unregister_by_object_removes_the_vote(voter):
    plugin = voter(False, "skipper")
    mtp_hooks.plugins.unregister(plugin)
    assert mtp_hooks.decide(None, "eval").decided_by == "default"


def test_unregistering_an_unknown_plugin_is_a_lookup_error_naming_it():
    with pytest.raises(mtp_hooks.UnknownPluginError, match="no plugin named 'ghost'") as info:
        mtp_hooks.plugins.unregister("ghost")
    assert isinstance(info.value, LookupError) and not isinstance(info.value, ValueError)


def test_a_misspelled_hook_is_refused_and_nothing_stays_registered():
    class Typo:
        @mtp_hooks.plugins.hookimpl
        def should_run_mpt(self, model, phase):
            return False

    with pytest.raises(mtp_hooks.PluginError, match="'typo'.*should_run_mpt"):
        mtp_hooks.plugins.register(Typo(), name="typo")
    assert not mtp_hooks.plugins.get_plugin_manager().has_plugin("typo")


def test_a_hook_with_an_unknown_argument_is_refused():
    class ExtraArg:
        @mtp_hooks.plugins.hookimpl
        def should_run_mtp(self, model, phase, step):
            return False

    with pytest.raises(mtp_hooks.PluginError, match="extra-arg"):
        mtp_hooks.plugins.register(ExtraArg(), name="extra-arg")
    assert not mtp_hooks.plugins.get_plugin_manager().has_plugin("extra-arg")


def test_get_plugin_manager_returns_one_pluggy_manager_for_the_project():
    pm = mtp_hooks.plugins.get_plugin_manager()
    assert isinstance(pm, pluggy.PluginManager) and pm.project_name == "mtp_hooks"
    assert mtp_hooks.plugins.get_plugin_manager() is pm


def test_reset_forgets_plugins_config_phases_and_roles(voter):
    model = Model()
    voter(False, "skipper")
    mtp_hooks.configure("train=skip")
    mtp_hooks.declare_phase("distill")
    mtp_hooks.set_role(model, "teacher")
    pm = mtp_hooks.plugins.get_plugin_manager()
    mtp_hooks.testing.reset()
    assert mtp_hooks.plugins.get_plugin_manager() is not pm
    assert mtp_hooks.decide(None, "eval").decided_by == "default"
    assert mtp_hooks.decide(None, "train").decided_by == "default"
    assert mtp_hooks.role_of(model) is None
    with pytest.raises(mtp_hooks.PolicyError):
        mtp_hooks.decide(None, "distill")


def test_a_role_does_not_keep_its_model_alive():
    import weakref

    model = Model()
    mtp_hooks.set_role(model, "teacher")
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_role_must_be_an_identifier():
    with pytest.raises(mtp_hooks.PolicyError, match="'bad role'"):
        mtp_hooks.set_role(Model(), "bad role")


def test_importing_mtp_hooks_has_no_side_effects():
    code = (
        "import sys, mtp_hooks, mtp_hooks._runtime as r;"
        "assert r.current.registry is None, 'plugin manager created at import';"
        "assert r.current.sources is None, 'policy sources read at import';"
        "assert 'megatron' not in sys.modules, 'megatron imported';"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "print('clean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "clean"


def test_reset_replaces_every_store_at_once_and_cached_decisions_cannot_survive_it():
    from mtp_hooks import _runtime

    mtp_hooks.configure("eval=skip")
    mtp_hooks.declare_phase("distill")
    model = type("Model", (), {})()
    mtp_hooks.set_role(model, "teacher")
    assert mtp_hooks.decide(model, "eval").run is False
    before = _runtime.current
    mtp_hooks.testing.reset()
    after = _runtime.current
    assert after is not before and after.snapshot.version > before.snapshot.version
    assert mtp_hooks.role_of(model) is None and mtp_hooks.decide(model, "eval").run is True
    with pytest.raises(mtp_hooks.PolicyError, match="unknown phase 'distill'"):
        mtp_hooks.decide(None, "distill")


ELSEWHERE = {  # names that live in a submodule, and that submodule
    "get_plugin_manager": "plugins", "hookimpl": "plugins", "hookspec": "plugins",
    "list_plugins": "plugins", "register": "plugins", "unregister": "plugins",
    "reset": "testing",
}  # fmt: skip


def test_each_public_name_has_one_home():
    homes = {
        "mtp_hooks": mtp_hooks.__all__,
        "mtp_hooks.plugins": mtp_hooks.plugins.__all__,
        "mtp_hooks.framework": mtp_hooks.framework.__all__,
        "mtp_hooks.testing": mtp_hooks.testing.__all__,
    }
    seen: dict[str, str] = {}
    for home, names in homes.items():
        for name in names:
            assert name not in seen, f"{name} is exported by {seen[name]} and {home}"
            seen[name] = home
    assert {"hookimpl", "hookspec", "register"} <= set(mtp_hooks.plugins.__all__)
    assert "PluginRegistry" not in mtp_hooks.plugins.__all__
    assert mtp_hooks.plugins.hookspec is mtp_hooks.hookspecs.hookspec


def test_a_name_looked_for_at_the_root_that_lives_in_a_submodule_is_named_with_its_home():
    import importlib

    for name, home in ELSEWHERE.items():
        assert getattr(importlib.import_module(f"mtp_hooks.{home}"), name) is not None
        with pytest.raises(AttributeError, match=f"import it from mtp_hooks.{home}"):
            getattr(mtp_hooks, name)
    with pytest.raises(AttributeError, match="has no attribute 'PluginLoadError'$"):
        mtp_hooks.PluginLoadError  # noqa: B018  (0.1's name of PluginError, never released)


def test_a_reset_clears_plugin_settings_and_runs_reset_callbacks_held_weakly():
    import gc

    from mtp_hooks.framework import RoleSettings

    settings = RoleSettings[str]()
    settings.set("skip eval", role="teacher")
    calls = []

    class Plugin:
        def forget(self):
            calls.append("plugin")

    plugin = Plugin()
    mtp_hooks.plugins.on_reset(plugin.forget)
    mtp_hooks.testing.reset()
    assert settings.get("teacher") is None and calls == ["plugin"]
    del plugin
    gc.collect()
    mtp_hooks.testing.reset()
    assert calls == ["plugin"]  # the dropped plugin's method is gone


def test_every_public_name_is_exported():
    for name in mtp_hooks.__all__:
        if name in {"AttachHandle", "attach", "detach", "freeze_mtp"}:
            continue  # need torch; covered by the adapter tests
        assert getattr(mtp_hooks, name) is not None


def test_errors_print_under_the_name_they_are_imported_by():
    names = [n for n in mtp_hooks.__all__ if n.endswith("Error")]
    assert names and all(
        getattr(mtp_hooks, n).__module__ == "mtp_hooks"
        and repr(getattr(mtp_hooks, n)) == f"<class 'mtp_hooks.{n}'>"
        for n in names
    )


def test_the_package_has_a_version_and_lists_it():
    assert mtp_hooks.__version__ == importlib.metadata.version("mtp-hooks")
    assert {"attach", "AttachHandle", "remove", "__version__", "decide"} <= set(dir(mtp_hooks))


def test_answers_calls_each_plugin_with_the_arguments_and_leaves_abstentions_out():
    model = Model()
    loud = answers("mtp_loss_scale", 0.5, name="loud")
    quiet = answers("mtp_loss_scale", None, name="quiet")
    assert mtp_hooks.plugins.implements("mtp_loss_scale")
    assert not mtp_hooks.plugins.implements("mtp_loss_mask")
    found = mtp_hooks.plugins.answers("mtp_loss_scale", model=model, phase="eval")
    assert found == {"loud": 0.5}
    assert loud.calls == quiet.calls == [(model, "eval")]


def test_answers_names_the_plugin_phase_and_role_of_what_a_plugin_raised():
    model = Model()
    mtp_hooks.set_role(model, "teacher")
    answers("mtp_loss_scale", RuntimeError("no schedule"), name="failing")
    with pytest.raises(mtp_hooks.PluginError, match="'failing'.*no schedule") as raised:
        mtp_hooks.plugins.answers("mtp_loss_scale", model=model, phase="eval")
    error = raised.value
    assert (error.plugin, error.hook, error.phase, error.role) == (
        "failing",
        "mtp_loss_scale",
        "eval",
        "teacher",
    )


def test_answers_refuses_a_hook_no_hookspec_declares_naming_the_hooks():
    with pytest.raises(
        mtp_hooks.PluginError, match="no hookspec declares the hook 'mtp_echo'"
    ) as e:
        mtp_hooks.plugins.answers("mtp_echo", model=None, phase="train")
    assert "should_run_mtp" in str(e.value) and e.value.hook == "mtp_echo"
