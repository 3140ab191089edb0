"""Framework plugin tests: the plugins are pip-installed and found through their entry points.

The test sessions (``noxfile.py``) install ``plugins/*`` into the test environments. Here
autoload is back on, and every plugin's configured policy is cleared around each test.
"""

from __future__ import annotations

import pytest
import torch

import mtp_hooks
import mtp_hooks_modelopt
import mtp_hooks_nemo
import mtp_hooks_verl
from mtp_hooks.demo import tiny_models

from model_fixtures import *  # noqa: F401,F403

PLUGINS = (mtp_hooks_verl, mtp_hooks_modelopt, mtp_hooks_nemo)


@pytest.fixture(autouse=True)
def autoload(monkeypatch):
    """Entry-point autoload on, and no plugin configured."""
    monkeypatch.delenv("MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    for plugin in PLUGINS:
        plugin.reset()
    yield
    for plugin in PLUGINS:
        plugin.reset()


@pytest.fixture
def only(monkeypatch):
    """``only("verl")``: block the other installed plugins, as MTP_HOOKS_DISABLE does."""

    def keep(*names: str) -> None:
        others = {"verl", "modelopt", "nemo"} - set(names)
        monkeypatch.setenv("MTP_HOOKS_DISABLE", ",".join(sorted(others)))
        mtp_hooks.reset()

    return keep


def observe(model, batch, phase: str) -> tuple[bool, bool]:
    """One forward as the frameworks run it in ``phase``; returns (MTP ran, MTP loss recorded).

    ``train``: a training forward with labels and backward (the actor/policy update).
    ``rollout``: a log-prob forward, ``eval()`` + ``no_grad``, no labels, phase ``rollout``.
    ``eval``: a validation forward, ``eval()`` + ``no_grad``, with labels.
    """
    ran = tiny_models.MTPForwards(model)
    tiny_models.reset_mtp_loss_tracker()
    try:
        if phase == "train":
            model.train()
            model(*batch.args(), labels=batch.labels).sum().backward()
        elif phase == "rollout":
            model.eval()
            with torch.no_grad(), mtp_hooks.phase("rollout"):
                model(*batch.args())
        else:
            model.eval()
            with torch.no_grad():
                model(*batch.args(), labels=batch.labels)
    finally:
        ran.remove()
    return ran.n > 0, tiny_models.recorded_mtp_loss() > 0
