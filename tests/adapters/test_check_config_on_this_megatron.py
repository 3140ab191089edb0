"""``mtp-hooks check-config`` checks a policy against the megatron-core installed beside it:
the grammar is the same on every release, but ``+detach`` (and the ``+objective:kl``/``tv``
that need it) is refused at attach where ``TransformerConfig`` has no ``mtp_detach_heads``."""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.transformer_config import TransformerConfig

from command_line import cli


def test_check_config_fails_a_detach_this_megatron_core_would_refuse_at_attach():
    detaches = "mtp_detach_heads" in {f.name for f in dataclasses.fields(TransformerConfig)}
    out = cli(
        "check-config",
        "--policy",
        "train=run+detach+objective:kl,teacher.train=run+detach,eval=skip",
    )
    assert "valid (3 entries)" in out.stdout
    if detaches:
        assert out.returncode == 0 and "refused" not in out.stderr
    else:
        assert out.returncode == 1
        assert "teacher.train, train: +detach" in out.stderr
        assert "no mtp_detach_heads field" in out.stderr and "Upgrade megatron-core" in out.stderr


def test_check_config_passes_a_policy_without_detach_on_every_megatron_core():
    out = cli("check-config", "--policy", "train=run,eval=run+metrics")
    assert out.returncode == 0 and "refused" not in out.stderr and "not checked" not in out.stdout
