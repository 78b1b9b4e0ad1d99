"""The validator's rule table (`gymrl.preflight.validate.RULES`, `SHARD_RULES`) against the rule
modules (`gymrl.preflight.rules`): a rule written in a module runs, and each module is named for a
schema group, so a rule is found where its group's fields are."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import gymrl.config.schema
import gymrl.preflight.rules
from gymrl.preflight.validate import RULES, SHARD_RULES


def _rule_modules():
    return [
        importlib.import_module(f"gymrl.preflight.rules.{info.name}")
        for info in pkgutil.iter_modules(gymrl.preflight.rules.__path__)
    ]


def test_every_public_function_of_a_rule_module_is_in_the_table_once():
    written = {
        f"{module.__name__}.{name}"
        for module in _rule_modules()
        for name, function in inspect.getmembers(module, inspect.isfunction)
        if not name.startswith("_") and function.__module__ == module.__name__
    }
    tabled = [f"{rule.__module__}.{rule.__name__}" for rule in (*RULES, *SHARD_RULES)]
    assert sorted(tabled) == sorted(written)


def test_rule_modules_are_named_for_schema_groups():
    groups = {info.name for info in pkgutil.iter_modules(gymrl.config.schema.__path__)}
    assert {module.__name__.rsplit(".", 1)[1] for module in _rule_modules()} <= groups
    assert {rule.__module__.rsplit(".", 1)[1] for rule in SHARD_RULES} == {"env"}
