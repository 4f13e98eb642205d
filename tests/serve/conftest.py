"""Shared fixtures of the server tests: one app for most tests (the models are the run-wide
fixtures of the root conftest.py)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from qkv.serve import Limits, create_app


@pytest.fixture(scope="session")
def app(minilm):
    return create_app({"minilm": minilm}, Limits())


@pytest.fixture(scope="session")
def client(app):
    with TestClient(app) as client:
        yield client


@pytest.fixture(scope="session")
def decoder_client(minilm, smollm2):
    app = create_app({"minilm": minilm, "smollm2": smollm2}, Limits(max_new_tokens=16))
    with TestClient(app) as client:
        yield client
