"""Hostile and careless input: every probe gets a clear message (or the right diagnosis), no
code named in a folder runs, and nothing partial is left behind."""

import pytest

from .hostile_probes import PROBES, probe


@pytest.mark.parametrize("name", sorted(PROBES))
def test_hostile_input_is_handled(name, tmp_path):
    outcome = probe(name, tmp_path)
    if outcome.skipped:
        pytest.skip(outcome.skipped)
    assert outcome.handled, outcome.message
    assert not outcome.code_ran, "code named in a folder was executed"
    assert not outcome.left, f"left behind: {outcome.left}"
