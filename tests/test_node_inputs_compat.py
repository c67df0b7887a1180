"""Saved workflows keep validating when a node grows: every required input of every node was there at the node's
first release, and an optional input's default is what the node's function does when the input is missing.
``tests/test_example_workflows.py`` submits the old-format graphs through a real ComfyUI's ``/prompt``."""
from __future__ import annotations

import inspect
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from tests.node_history import FIRST_RELEASE, node_classes  # noqa: E402

pytestmark = pytest.mark.fast

CLASSES = node_classes()


def test_every_node_has_a_first_release_record():
    assert set(CLASSES) == set(FIRST_RELEASE), "add the new node's inputs to tests/node_history.FIRST_RELEASE"


@pytest.mark.parametrize("key", sorted(CLASSES))
def test_required_inputs_were_in_the_first_release(key):
    required = CLASSES[key].INPUT_TYPES()["required"]
    late = [name for name in required if name not in FIRST_RELEASE[key]]
    assert not late, (f"{key}: {late} added after the node's first release must go under 'optional' with a "
                      "default, or workflows saved before them fail validation")


@pytest.mark.parametrize("key", sorted(CLASSES))
def test_a_missing_optional_input_behaves_as_its_default(key):
    cls = CLASSES[key]
    params = inspect.signature(getattr(cls, cls.FUNCTION)).parameters
    for name, entry in cls.INPUT_TYPES().get("optional", {}).items():
        assert name in params, f"{key}.{cls.FUNCTION} does not take its optional input {name!r}"
        opts = entry[1] if len(entry) > 1 else {}
        want = opts.get("default")  # a link input (no default) is None when unconnected
        assert params[name].default == want, (f"{key}.{cls.FUNCTION}: {name} defaults to {params[name].default!r} "
                                              f"there, {want!r} in the UI")
