"""A skipped or re-weighted forward sees a view of the model's config, never a changed config.

The view reads every field from the model's own config, live, and answers the one field the
decision changes (``mtp_num_layers=None`` for a skip, ``mtp_loss_scaling_factor`` for a
weight). It behaves as a config object everywhere a config is used: ``isinstance``, dataclass
fields, ``copy``, ``deepcopy`` and ``pickle``.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

from megatron.core.transformer import TransformerConfig

import mtp_hooks
from mtp_hooks.megatron._config_view import config_view


def configs_seen_by_forward(model, batch, forwards: int = 1) -> list:
    """``model.config`` as megatron's forward reads it, once per forward."""
    seen = []
    hook = model.decoder.register_forward_pre_hook(lambda m, a: seen.append(model.config))
    try:
        for _ in range(forwards):
            model(*batch.args(), labels=batch.labels)
    finally:
        hook.remove()
    return seen


def skipped(build, batch) -> tuple:
    """A model attached with ``train=skip``, and the config its first forward saw."""
    model = build()
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    (view,) = configs_seen_by_forward(model, batch)
    return model, view


def test_a_skipped_forward_sees_its_config_with_no_mtp_layers(build, batch):
    model, view = skipped(build, batch)
    shared = model.config
    assert isinstance(view, type(shared)) and dataclasses.is_dataclass(view)
    assert view.mtp_num_layers is None and shared.mtp_num_layers == 1
    fields = [f.name for f in dataclasses.fields(shared) if f.name != "mtp_num_layers"]
    assert all(getattr(view, name) is getattr(shared, name) for name in fields)


def test_the_view_reads_the_config_live(build, batch):
    model, view = skipped(build, batch)
    shared = model.config
    shared.hidden_dropout = 0.25
    assert view.hidden_dropout == 0.25


def test_a_write_during_a_skipped_forward_reaches_the_model_config(build, batch):
    model = build()
    shared = model.config
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    hook = model.decoder.register_forward_pre_hook(
        lambda m, a: setattr(model.config, "hidden_dropout", 0.5)
    )
    model(*batch.args(), labels=batch.labels)
    hook.remove()
    assert model.config is shared and shared.hidden_dropout == 0.5


def test_a_write_to_the_changed_field_stays_in_that_view_and_the_next_call_gets_a_new_one(
    build, batch
):
    model, first = skipped(build, batch)
    first.mtp_num_layers = 7  # as code running inside that forward could have done
    (second,) = configs_seen_by_forward(model, batch)
    assert second is not first and second.mtp_num_layers is None
    assert model.config.mtp_num_layers == 1


def test_skipped_forwards_reuse_one_view_until_the_config_object_is_replaced(build, batch):
    model = build()
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=skip")
    first, second = configs_seen_by_forward(model, batch, forwards=2)
    assert first is second
    model.config = replacement = copy.copy(model.config)
    (third,) = configs_seen_by_forward(model, batch)
    assert third is not first and third.mtp_num_layers is None
    replacement.hidden_dropout = 0.75
    assert third.hidden_dropout == 0.75 and first.hidden_dropout != 0.75


def test_a_weighted_forward_sees_the_weight_and_a_new_weight_gets_a_new_view(build, batch):
    model = build()
    mtp_hooks.attach(model)
    mtp_hooks.configure("train=run:0.3")
    first, again = configs_seen_by_forward(model, batch, forwards=2)
    mtp_hooks.configure("train=run:0.5")
    (other,) = configs_seen_by_forward(model, batch)
    assert first is again and first.mtp_loss_scaling_factor == 0.3
    assert other.mtp_loss_scaling_factor == 0.5 and other.mtp_num_layers == 1


def test_copies_and_pickles_of_a_view_are_plain_configs_with_the_changed_value(build, batch):
    model, view = skipped(build, batch)
    for made in (copy.copy(view), copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert type(made) is type(model.config) and made.mtp_num_layers is None
        assert made.hidden_size == model.config.hidden_size
    replaced = dataclasses.replace(view, hidden_size=view.hidden_size)
    assert type(replaced) is type(model.config)
    assert replaced.mtp_num_layers is None and replaced.hidden_size == view.hidden_size


def test_a_view_has_a_class_name_of_its_own(build, batch):
    model, view = skipped(build, batch)
    assert type(view).__name__ == f"{type(model.config).__name__}View"
    assert isinstance(view, type(model.config)) and view.__class__ is type(view)


def test_a_megatron_config_view_is_a_transformer_config():
    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
    view = config_view(config, (("mtp_num_layers", None),))
    assert isinstance(view, TransformerConfig) and repr(view).startswith("TransformerConfigView(")


def test_a_config_class_without_an_instance_dict_gets_a_copy():
    @dataclasses.dataclass(slots=True)
    class Slotted:
        mtp_num_layers: int | None = 1
        hidden_size: int = 8

    config = Slotted()
    copied = config_view(config, (("mtp_num_layers", None),))
    assert type(copied) is Slotted and copied.mtp_num_layers is None
    config.hidden_size = 16
    assert copied.hidden_size == 8 and config.mtp_num_layers == 1


def test_the_view_shares_the_config_attribute_dict_nothing_is_copied(build, batch):
    model, view = skipped(build, batch)
    assert vars(view) is vars(model.config)


def test_a_view_with_several_changed_fields_copies_into_a_config_holding_all_of_them():
    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
    changes = (("mtp_loss_scaling_factor", 0.3), ("mtp_num_layers", None))
    view = config_view(config, changes)
    assert (view.mtp_loss_scaling_factor, view.mtp_num_layers) == (0.3, None)
    for plain in (copy.copy(view), copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert type(plain) is TransformerConfig
        assert (plain.mtp_loss_scaling_factor, plain.mtp_num_layers) == (0.3, None)
    assert (config.mtp_loss_scaling_factor, config.mtp_num_layers) == (0.1, None)
    assert dataclasses.replace(view, hidden_size=16).mtp_loss_scaling_factor == 0.3
