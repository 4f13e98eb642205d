"""Shared fixtures of the server tests: each model loaded once, one app for most tests."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import qkv
from qkv.serve import Limits, create_app


@pytest.fixture(scope="session")
def minilm():
    return qkv.load("minilm")


@pytest.fixture(scope="session")
def smollm2():
    return qkv.load("smollm2")  # about 2.5 s: only the tests that need a decoder ask for it


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
