"""Upstream errors of every known shape become OpenAI's error shape, with the right retry/failover verdict."""

from __future__ import annotations

import logging

import pytest

from llmdeploy.router.normalize import body_error, normalize, parse_retry_after

SECRET = "bce-v3/ALTAK-very-secret"


def test_qianfan_rate_limits_are_retryable_429_with_retry_after():
    for code in ("rpm_rate_limit_exceeded", "tpm_rate_limit_exceeded"):
        f = normalize(
            429,
            {"error": {"code": code, "message": "Rate limit reached", "type": "rate_limit_error"}},
            {"retry-after": "3"},
        )
        assert (f.error.status, f.error.code, f.retryable, f.retry_after_s) == (
            429,
            "rate_limit_exceeded",
            True,
            3.0,
        )
        assert f.error.headers["Retry-After"] == "3"


def test_insufficient_quota_is_not_retried_but_may_fail_over():
    f = normalize(429, {"error": {"code": "insufficient_quota", "message": "You exceeded your quota"}})
    assert (f.error.status, f.error.code, f.retryable, f.failover) == (429, "insufficient_quota", False, True)


def test_qianfan_tokens_too_long_becomes_context_length_exceeded():
    f = normalize(
        400,
        b'{"error":{"code":"tokens_too_long","message":"prompt tokens too long","type":"invalid_request_error"},"id":"as-1"}',
    )
    assert (f.error.status, f.error.code, f.error.param) == (400, "context_length_exceeded", "messages")
    assert not f.retryable and f.failover  # another backend may have a longer context


def test_qianfan_no_permission_is_a_config_error_logged_without_the_key(caplog):
    body = {
        "error": {
            "code": "invalid_model",
            "message": f"No permission to use the model ({SECRET})",
            "type": "invalid_request_error",
        }
    }
    with caplog.at_level(logging.ERROR, logger="llmdeploy.router.upstream"):
        f = normalize(401, body, secrets=(SECRET,))
    assert f.error.status == 502 and f.error.code == "upstream_config_error"
    assert f.error.status != 401  # the client's key is fine: never tell it otherwise
    assert "cloud.model" in caplog.text and "No permission" in caplog.text
    assert SECRET not in caplog.text and SECRET not in str(f.error.body())


def test_legacy_200_with_error_body_336501_is_a_rate_limit():
    f = normalize(200, {"code": 336501, "msg": "Rate limit reached for RPM"})
    assert (f.error.status, f.retryable) == (429, True)
    f = normalize(200, {"error_code": 18, "error_msg": "Open api qps request limit reached"})
    assert f.error.status == 429


def test_vllm_nested_and_flat_shapes():
    nested = {
        "error": {
            "message": "max_tokens is too large",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    }
    f = normalize(400, nested, backend="local")
    assert (f.error.status, f.error.message, f.error.param, f.failover) == (
        400,
        "max_tokens is too large",
        "max_tokens",
        False,
    )
    flat = {
        "object": "error",
        "message": "engine overloaded",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }
    f = normalize(200, flat, backend="local")
    assert (f.error.status, f.retryable, f.failover) == (502, True, True)
    assert "engine overloaded" in f.error.message


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_server_errors_are_retryable(status):
    f = normalize(status, b"<html>bad gateway</html>")
    assert (
        f.retryable
        and f.failover
        and f.error.status == 502
        and set(f.error.body()["error"]) == {"message", "type", "param", "code"}
    )


def test_body_error_ignores_normal_answers():
    assert body_error({"id": "x", "choices": [], "usage": {}}) is None
    assert body_error({"code": 0, "msg": "ok", "choices": []}) is None
    assert body_error([1, 2]) is None


def test_retry_after_parsing():
    assert parse_retry_after("2") == 2.0 and parse_retry_after("0.5") == 0.5
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None and parse_retry_after(None) is None
