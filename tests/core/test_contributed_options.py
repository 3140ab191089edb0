"""Policy options that installed distributions contribute (entry-point group
``mtp_hooks.options``), found through real distribution metadata (the ``install`` fixture)."""

from __future__ import annotations

import pytest

import mtp_hooks
from mtp_hooks import _policy, _policy_entry, _runtime
from mtp_hooks.plugins import OPTIONS_GROUP

# docs/contributing.md's '+echo', shipped as a distribution of its own: a flag that plugins may
# also turn on through a hook the option declares
ECHO = """
from mtp_hooks.plugins import Flag, PlanPart, NOTHING, hookspec


class EchoSpecs:
    @hookspec
    def mtp_echo(self, model, phase):
        '''Whether calls of ``phase`` echo their MTP loss; None abstains.'''


class Echo(Flag):
    name = "echo"
    hook = "mtp_echo"
    hookspecs = EchoSpecs
    what = "echoing the MTP loss"
    settle = "run+echo"

    def decide(self, entry, decision, ask):
        if entry is not None and entry.echo is not None:
            return {"echo": True} if entry.echo else None
        return {"echo": True} if any(ask.answers(self).values()) else None

    def plan(self, options, implements):
        return PlanPart(extension=True) if options.echo else NOTHING

    def describe(self, options, implementers):
        return [f"echo: the MTP loss is logged, by {options.by('echo')}"] * options.echo
"""


def install_echo(install, source: str = ECHO, **kwargs) -> str:
    return install("mtpx-echo", source, "echo", group=OPTIONS_GROUP, attribute="Echo", **kwargs)


def test_an_option_a_distribution_contributes_is_parsed_decided_and_explained(install):
    install_echo(install)
    (entry,) = _policy.parse_policy("train=run:0.3+echo+detach").values()
    assert _policy_entry.spell(entry) == "run:0.3+detach+echo"  # after the built-in options
    mtp_hooks.configure("train=run+echo")
    decision = mtp_hooks.decide(None, "train")
    assert (decision.options.echo, decision.options.by("echo")) == (True, "config")
    assert mtp_hooks.decide(None, "eval").options.echo is False
    assert "echo: the MTP loss is logged, by config" in mtp_hooks.explain(None, "train")
    with pytest.raises(mtp_hooks.PolicyError, match=r"did you mean '\+echo'\?"):
        _policy.parse_policy("train=run+ecko")


def test_plugins_answer_the_hook_a_contributed_option_declares(install):
    install_echo(install)

    class Echoes:
        @mtp_hooks.plugins.hookimpl
        def mtp_echo(self, model, phase):
            return phase == "train"

    mtp_hooks.plugins.register(Echoes(), name="echoes")
    assert hasattr(mtp_hooks.plugins.get_plugin_manager().hook, "mtp_echo")
    # what the option's extension would call at a forward
    assert mtp_hooks.plugins.answers("mtp_echo", model=None, phase="train") == {"echoes": True}
    assert mtp_hooks.plugins.answers("mtp_echo", model=None, phase="eval") == {"echoes": False}
    decision = mtp_hooks.decide(None, "train")
    assert (decision.options.echo, decision.options.by("echo")) == (True, "echoes")
    assert mtp_hooks.decide(None, "eval").options.echo is False


def test_without_the_distribution_the_hook_is_unknown_and_the_word_is_refused(install):
    class Echoes:
        @mtp_hooks.plugins.hookimpl
        def mtp_echo(self, model, phase):
            return True

    with pytest.raises(mtp_hooks.PluginError, match="implements a hook mtp-hooks does not define"):
        mtp_hooks.plugins.register(Echoes(), name="echoes")
    with pytest.raises(mtp_hooks.PolicyError, match=r"the '\+' options are"):
        _policy.parse_policy("train=run+echo")


def test_an_option_the_environment_names_is_not_loaded_and_its_word_says_why(install, monkeypatch):
    install_echo(install)
    monkeypatch.setenv("MTP_HOOKS_DISABLE", "echo")
    assert "echo" not in _policy_entry.table_keys()
    kept_out = (
        "policy option 'echo' (entry point 'mtpx_echo:Echo' of distribution mtpx-echo 1.0) "
        "is installed but not loaded: MTP_HOOKS_DISABLE names it; take it out"
    )
    with pytest.raises(mtp_hooks.PolicyError) as written:
        _policy.parse_policy("train=run+echo")
    assert kept_out in str(written.value) and "did you mean" not in str(written.value)
    with pytest.raises(mtp_hooks.PolicyError) as tabled:
        _policy.parse_policy({"train": {"mtp": "run", "echo": True}})
    assert kept_out in str(tabled.value)


def test_with_autoload_off_options_load_and_plugins_registered_by_hand_answer_their_hooks(
    install, monkeypatch
):
    install_echo(install)
    install("mtpx-voter", "def mtp_echo(model, phase):\n    return False\n", "voter")
    monkeypatch.setenv("MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD", "1")

    class Echoes:
        @mtp_hooks.plugins.hookimpl
        def mtp_echo(self, model, phase):
            return phase == "train"

    mtp_hooks.plugins.register(Echoes(), name="echoes")  # the job's own plugin, by hand
    assert "voter" not in {info.name for info in mtp_hooks.plugins.list_plugins()}
    decision = mtp_hooks.decide(None, "train")
    assert (decision.options.echo, decision.options.by("echo")) == (True, "echoes")
    (entry,) = _policy.parse_policy("eval=run+echo").values()
    assert entry.options.echo is True


# a contributed option whose own code fails, in each of the methods the core calls
BUGGY = (
    ECHO
    + """
def fail(*args):
    raise ZeroDivisionError("the option's bug")

Echo.METHOD = fail
"""
)


@pytest.mark.parametrize(
    ("method", "use"),
    [
        ("parse", lambda: _policy.parse_policy("train=run+echo")),
        ("decide", lambda: mtp_hooks.decide(None, "train")),
        (
            "spell",
            lambda: [_policy_entry.spell(e) for e in _policy.parse_policy("train=run").values()],
        ),
        ("describe", lambda: mtp_hooks.explain(None, "train")),
    ],
)
def test_what_a_contributed_option_raises_names_its_distribution(install, method, use):
    install_echo(install, BUGGY.replace("METHOD", method))
    if method != "parse":
        mtp_hooks.configure("train=run+echo")
    with pytest.raises(mtp_hooks.PluginError) as named:
        use()
    message = str(named.value)
    assert "distribution mtpx-echo 1.0" in message and "MTP_HOOKS_DISABLE=echo" in message
    assert f"its {method} raised ZeroDivisionError: the option's bug" in message
    assert isinstance(named.value.__cause__, ZeroDivisionError)
    assert named.value.plugin == "echo"


def test_a_policy_error_a_contributed_option_raises_reaches_the_user_as_it_is(install):
    refusing = (
        ECHO
        + """
from mtp_hooks import PolicyError

def parse(self, table, where, value, parsed):
    if table.get("echo"):
        raise PolicyError(f"{where}: echo needs a quiet room", option="+echo")
    return {"echo": None}

Echo.parse = parse
"""
    )
    install_echo(install, refusing)
    with pytest.raises(mtp_hooks.PolicyError, match="echo needs a quiet room") as refused:
        _policy.parse_policy("train=run+echo")
    assert refused.value.option == "+echo"


CLASHES = {
    "a built-in's name": (ECHO.replace('name = "echo"', 'name = "detach"'), "detach", "name"),
    "the mtp key": (ECHO + "\nEcho.keys = ('echo', 'mtp')\n", "echo", "table key 'mtp'"),
    "mtp-hooks' own hook": (
        ECHO.replace("def mtp_echo", "def should_run_mtp").replace('hook = "mtp_echo"', ""),
        "echo",
        "hook 'should_run_mtp', which mtp-hooks declares already",
    ),
    "a hook nobody declares": (
        ECHO.replace("hookspecs = EchoSpecs", ""),
        "echo",
        "asks the hook 'mtp_echo', which no hookspec declares",
    ),
    "not an option": ("class Echo:\n    name = 'echo'\n", "echo", "not a subclass"),
    "its entry point's name": (ECHO, "ekko", "the entry point's name is the option's name"),
    "an import error": ("import no_such_module_anywhere\n", "echo", "ModuleNotFoundError"),
}


@pytest.mark.parametrize("clash", list(CLASHES))
def test_a_contributed_option_that_cannot_be_told_apart_is_refused_before_anything_parses(
    install, clash
):
    source, ep_name, said = CLASHES[clash]
    if clash == "an import error":
        install("mtpx-echo", source, ep_name, group=OPTIONS_GROUP)
    else:
        install("mtpx-echo", source, ep_name, group=OPTIONS_GROUP, attribute="Echo")
    with pytest.raises(mtp_hooks.PluginError) as refused:
        mtp_hooks.configure("train=run+detach")
    message = str(refused.value)
    assert said in message and "distribution mtpx-echo 1.0" in message
    assert f"MTP_HOOKS_DISABLE={ep_name}" in message  # the fix
    assert _runtime.current.options is None  # nothing loaded: the next parse refuses again
    with pytest.raises(mtp_hooks.PluginError):
        mtp_hooks.decide(None, "train")


def test_contributed_options_load_all_or_nothing(install):
    install_echo(install)
    install("mtpx-broken", "raise RuntimeError('bad option')\n", "zzz", group=OPTIONS_GROUP)
    with pytest.raises(mtp_hooks.PluginError, match="'zzz'.*RuntimeError: bad option"):
        _policy.parse_policy("train=run")
    assert _runtime.current.options is None
