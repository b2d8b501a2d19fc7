"""Runs last: every report.json any test wrote validates against the shipped JSON Schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ckptforensics.report import schema


def test_every_report_written_by_the_suite_validates(tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.getbasetemp()
    docs = sorted(root.rglob("report.json"))
    assert docs, "the suite wrote no report"
    validator = jsonschema.Draft202012Validator(schema())
    for d in docs:
        errors = sorted(validator.iter_errors(json.loads(d.read_text())), key=str)
        assert not errors, f"{d}: {errors[0].message}"
